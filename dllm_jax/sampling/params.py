"""SamplingParams: what one request may choose, without changing the compiled program.

Every field becomes per-slot state of the decode loop when the request is installed
(dllm_jax.runtime.slots.SlotParams), so requests with different values share one compiled loop. The
engine-level, compile-time choices (method, window, slots, generation-length bucket) are
dllm_jax.runtime.decode_config.DecodeConfig.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dllm_jax.common.errors import SamplingParamsError
from dllm_jax.common.validate import check_choice, check_float, check_int

REMASKING: tuple[str, ...] = ("low_confidence", "random")
MAX_SEED = 2**31  # seeds are int32 on the device


def _fail(message: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams: {message}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Generation parameters of one request.

    Attributes:
      max_new_tokens: generated positions of this request; None = the engine's generation
        bucket (DecodeConfig.gen_length), capped by the model's max_sequence_length minus the
        prompt. At most the bucket; the positions after it are EOS padding.
      temperature: 0 = greedy; > 0 = Gumbel-max sampling at this temperature (LLaDA's
        add_gumbel_noise). None-free: 0.0 by default.
      top_p: nucleus filtering before sampling (Dream's top_p_logits), 1 = off.
      top_k: keep the k largest logits before sampling (Dream's top_k_logits), 0 = off.
      seed: this request's random stream (same seed, same answer, wherever it runs); None =
        the DecodeConfig seed and the request's index in its generate() call.
      stop: strings that end the answer (cut before the first occurrence).
      stop_token_ids: token ids that end the answer (cut before the first one).
      cfg_scale: LLaDA's classifier-free guidance, 0 = off (needs method="llada").
      remasking: "low_confidence" (commit the most confident) or "random" (LLaDA's random
        remasking: confidence is a uniform random number).
      threshold: confidence threshold for parallel commits (fast_dllm with threshold,
        flash_cache); None = the DecodeConfig's.
      gamma: Flash-Verify acceptance threshold in (0, 1]; None = the DecodeConfig's.
      alg_temp: Dream's sampler (method "dream") only: 0 = unmask the most confident masked
        positions; > 0 = draw them from softmax(confidence / alg_temp).
    """

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    threshold: float | None = None
    gamma: float | None = None
    alg_temp: float = 0.0

    def __post_init__(self):
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        check_int("max_new_tokens", self.max_new_tokens, _fail, low=1, optional=True)
        put("temperature", check_float("temperature", self.temperature, _fail, low=0.0))
        put("top_p", check_float("top_p", self.top_p, _fail, low=0.0, high=1.0, low_open=True))
        check_int("top_k", self.top_k, _fail, low=0)
        check_int("seed", self.seed, _fail, low=0, high=MAX_SEED - 1, optional=True)
        put("stop", _string_tuple(self.stop))
        put("stop_token_ids", _id_tuple(self.stop_token_ids))
        put("cfg_scale", check_float("cfg_scale", self.cfg_scale, _fail, low=0.0))
        check_choice("remasking", self.remasking, REMASKING, _fail)
        put("threshold", check_float("threshold", self.threshold, _fail, low=0.0, optional=True))
        put("gamma", check_float("gamma", self.gamma, _fail, low=0.0, high=1.0, low_open=True, optional=True))
        put("alg_temp", check_float("alg_temp", self.alg_temp, _fail, low=0.0))
        for name in ("max_new_tokens", "top_k", "seed"):
            value = getattr(self, name)
            if value is not None:
                put(name, int(value))


def _string_tuple(stop: Any) -> tuple[str, ...]:
    """One string or a list/tuple of non-empty strings."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise _fail(f"stop={stop!r} ({type(stop).__name__}): expected a string or a list of strings")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise _fail(f"stop contains {s!r}: expected non-empty strings")
    return tuple(stop)


def _id_tuple(ids: Any) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)):
        raise _fail(f"stop_token_ids={ids!r} ({type(ids).__name__}): expected a list of token ids")
    return tuple(check_int("stop_token_ids entry", t, _fail, low=0) for t in ids)
