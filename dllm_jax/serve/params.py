"""A request body's generation parameters, as the engine takes them."""

from __future__ import annotations

import hashlib
from typing import Any

from dllm_jax.sampling.params import MAX_SEED, SamplingParams, server_knobs
from dllm_jax.serve.protocol import _Sampling


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a request of `seed` (n > 1: independent samples): choice
    0 keeps the request's seed (n=1 answers as before), the others a hash of (seed, choice).
    None stays None: each choice then draws its own stream by its add order."""
    if seed is None or choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{choice}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % MAX_SEED


def make_params(body: _Sampling, defaults: dict[str, Any] | None = None, *, choice: int = 0) -> SamplingParams:
    """The SamplingParams of choice `choice` of a body. OpenAI's fields map to their
    SamplingParams namesakes (max_tokens -> max_new_tokens: the answer's cut); the "dllm"
    object's knobs are SamplingParams fields by name (dllm.gen_length: the canvas).
    Unset fields take `defaults` (the server's, by field name), else SamplingParams' own; the
    logprobs asked (chat: logprobs/top_logprobs, completions: logprobs) are recorded.
    Raises SamplingParamsError (a ValueError) naming a bad value."""
    values: dict[str, Any] = dict(defaults or {})
    for name in server_knobs():
        given = getattr(body.dllm, name)
        if given is not None:
            values[name] = given
    openai = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.effective_top_k,
        "seed": choice_seed(body.seed, choice),
    }
    values.update({name: value for name, value in openai.items() if value is not None})
    return SamplingParams(
        max_new_tokens=body.requested_max_tokens(),
        stop=tuple(body.stop_list),
        logprobs=body.top_logprobs_wanted,
        **values,
    )
