"""A request body's generation parameters, as the engine takes them."""

from __future__ import annotations

from dllm_jax.sampling.params import SamplingParams
from dllm_jax.serve.protocol import _Sampling


def make_params(body: _Sampling, max_new_tokens: int) -> SamplingParams:
    """The SamplingParams of a body (max_new_tokens: its answer length). Unset fields take the
    engine's defaults: greedy (temperature 0), no top-p/top-k filtering, the server's
    threshold and gamma. Raises SamplingParamsError (a ValueError) naming a bad value."""
    dllm = body.dllm
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.effective_top_k or 0,
        seed=body.seed,
        stop=tuple(body.stop_list),
        cfg_scale=dllm.cfg_scale or 0.0,
        remasking=dllm.remasking or "low_confidence",
        threshold=dllm.threshold,
        gamma=dllm.gamma,
    )
