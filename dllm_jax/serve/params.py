"""A request body's generation parameters, as the engine takes them."""

from __future__ import annotations

from typing import Any

from dllm_jax.sampling.params import SamplingParams, server_knobs
from dllm_jax.serve.protocol import _Sampling


def make_params(body: _Sampling, max_new_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The SamplingParams of a body (max_new_tokens: its answer length). OpenAI's fields map to
    their SamplingParams namesakes; the "dllm" object's knobs are SamplingParams fields by name.
    Unset fields take `defaults` (the server's, by field name), else SamplingParams' own.
    Raises SamplingParamsError (a ValueError) naming a bad value."""
    values: dict[str, Any] = dict(defaults or {})
    for name in server_knobs():
        given = getattr(body.dllm, name)
        if given is not None:
            values[name] = given
    openai = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.effective_top_k, "seed": body.seed}
    values.update({name: value for name, value in openai.items() if value is not None})
    return SamplingParams(max_new_tokens=max_new_tokens, stop=tuple(body.stop_list), **values)
