"""A request body's generation parameters, as the session takes them."""

from __future__ import annotations

from typing import Any

from dllm_jax.serve.protocol import _Sampling


def make_params(body: _Sampling, max_new_tokens: int) -> dict[str, Any]:
    """The per-request parameters of a body (max_new_tokens: its answer length)."""
    return {"max_new_tokens": max_new_tokens}
