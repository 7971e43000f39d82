"""DecodeConfig: the engine-level, compile-time choice of how to generate.

Its fields choose the compiled program: the method, window/block length, schedule, cache,
query rows, Flash-Verify's rules, the number of slots and the generation-length bucket.
What one request may choose (dllm_jax.sampling.params.SamplingParams) is per-slot state of
the loop; `threshold`, `temperature`, `seed` and `gamma` here are only the defaults of
requests that do not set them, so changing them never recompiles.

Options default to None where "not set" must be told apart from a value, so that an option
that does not apply to the chosen method is an error rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from dllm_jax.common.validate import check_bool, check_choice, check_float, check_int

Method = Literal["llada", "fast_dllm", "flash_cache", "dream"]
METHODS: tuple[str, ...] = ("llada", "fast_dllm", "flash_cache", "dream")
DREAM_ALGORITHMS: tuple[str, ...] = ("origin", "maskgit_plus", "topk_margin", "entropy")
CACHES: tuple[str, ...] = ("prefix", "dual")
ACCEPT_RULES: tuple[str, ...] = ("cumprod", "paper")
PIN_POLICIES: tuple[str, ...] = ("all_commits", "reference")
MAX_SEED = 2**31

# Default decoding window / block length per method (published settings).
_DEFAULT_BLOCK = {"llada": 32, "fast_dllm": 32, "flash_cache": 16}
# Which method each method-specific option belongs to.
_ONLY_FOR = {
    "steps": ("llada", "fast_dllm", "dream"),
    "cache": ("fast_dllm",),
    "mask_num": ("flash_cache",),
    "track_num": ("flash_cache",),
    "cfg": ("llada",),
    "alg": ("dream",),
    "eps": ("dream",),
}
_VERIFY_ONLY = ("gamma", "accept", "pin")


class DecodeConfigError(ValueError):
    """An invalid combination of decoding options; the message names the option."""


def _fail(message: str) -> DecodeConfigError:
    return DecodeConfigError(message)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Options of the compiled decode loop.

    Attributes:
      method: "llada" (no cache, fixed tokens per step), "fast_dllm" (block cache refreshed at
        block boundaries, confidence threshold), "flash_cache" (flat cache, sliding window,
        selective refresh by tracking score) or "dream" (Dream's own sampler, its
        diffusion_generate: the whole generation is one block, every step a full pass).
      gen_length: the generation-length bucket G: the most positions a request may generate
        (SamplingParams.max_new_tokens <= G; shorter requests share the loop).
      block_length: llada/fast_dllm: semi-autoregressive block size; flash_cache: the
        decoding window W; dream: the whole generation (leave it None). None = the method's
        default (32, 32, 16).
      steps: llada, dream and fast_dllm without threshold: denoising steps over the whole
        generation (tokens per step = gen_length / steps; dream: its timestep schedule).
        None = gen_length (one token per step).
      threshold: default confidence threshold of requests (fast_dllm, flash_cache); a value
        above 1 commits exactly one token per step, 0 the whole window. None = 0.9 for
        flash_cache, and for fast_dllm 0.9 unless `steps` asks for a fixed schedule; llada
        always uses the fixed schedule.
      cache: fast_dllm only: "prefix" (recompute block + suffix) or "dual" (recompute block);
        None = "dual".
      mask_num: flash_cache only: masked rows recomputed per step, in blocks of W (the window
        included): look-ahead = (mask_num - 1) * W rows. None = 4.
      track_num: flash_cache only: decoded rows refreshed per step, in blocks of W; negative =
        refresh every position every step (exact). None = 4.
      temperature: default temperature of requests (0 = greedy).
      batch_size: slots decoded together (continuous batching refills finished slots); the
        engine uses fewer when a call has fewer requests.
      seed: base of the random streams of requests that set no seed.
      verify: Flash-Verify (flash_cache only); gamma (default of requests, None = 0.8),
        accept (None = "cumprod") and pin (None = "all_commits") apply only with verify.
      cfg: compile the classifier-free-guidance variant (llada only: a second, unconditional
        full pass per step). The engine turns it on when a request sets cfg_scale > 0.
      alg: dream only: which masked positions a step unmasks (dllm_jax.policies.dream_unmasking):
        "origin" (each with probability 1 - s/t), "maskgit_plus" (top probability),
        "topk_margin" (top-1 minus top-2) or "entropy" (negative entropy); None = "entropy".
        Its alg_temp, like temperature, top_p and top_k, is per request (SamplingParams).
      eps: dream only: the end of the timestep schedule linspace(1, eps, steps + 1), in
        (0, 1); None = 1e-3.
    """

    method: Method = "flash_cache"
    gen_length: int = 256
    block_length: int | None = None
    steps: int | None = None
    threshold: float | None = None
    cache: str | None = None
    mask_num: int | None = None
    track_num: int | None = None
    temperature: float = 0.0
    batch_size: int = 8
    seed: int = 0
    verify: bool = False
    gamma: float | None = None
    accept: str | None = None
    pin: str | None = None
    cfg: bool = False
    alg: str | None = None
    eps: float | None = None

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        check_choice("method", self.method, METHODS, _fail)
        check_int("gen_length", self.gen_length, _fail, low=1)
        check_int("block_length", self.block_length, _fail, low=1, optional=True)
        check_int("steps", self.steps, _fail, low=1, optional=True)
        check_int("batch_size", self.batch_size, _fail, low=1)
        check_int("seed", self.seed, _fail, low=0, high=MAX_SEED - 1)
        check_bool("verify", self.verify, _fail)
        check_bool("cfg", self.cfg, _fail)
        put("temperature", check_float("temperature", self.temperature, _fail, low=0.0))
        put("threshold", check_float("threshold", self.threshold, _fail, low=0.0, optional=True))
        for name, methods in _ONLY_FOR.items():
            value = getattr(self, name)
            if value is not None and value is not False and self.method not in methods:
                raise _fail(f"{name}={value!r} does not apply to method={self.method!r} (only to {', '.join(methods)})")
        if not self.verify:
            for name in _VERIFY_ONLY:
                if getattr(self, name) is not None:
                    raise _fail(f"{name}={getattr(self, name)!r} applies only with verify=True")
        if self.method == "llada" and self.threshold is not None:
            raise _fail("threshold does not apply to method='llada' (it commits a fixed number of tokens per step: set steps)")
        if self.method == "dream":
            if self.threshold is not None:
                raise _fail("threshold does not apply to method='dream' (it unmasks by its timestep schedule: set steps)")
            if self.block_length not in (None, self.gen_length):
                raise _fail(f"block_length={self.block_length} does not apply to method='dream' (the whole generation is one block)")
            if self.total_steps > self.gen_length:
                raise _fail(f"steps={self.steps}: expected at most gen_length={self.gen_length}")
            put("alg", "entropy" if self.alg is None else check_choice("alg", self.alg, DREAM_ALGORITHMS, _fail))
            put("eps", 1e-3 if self.eps is None else check_float("eps", self.eps, _fail, low=0.0, high=1.0, low_open=True))
            if self.eps == 1.0:
                raise _fail("eps=1.0: expected a number in (0, 1) (the schedule runs from 1 down to eps)")

        if self.method == "fast_dllm":
            put("cache", "dual" if self.cache is None else check_choice("cache", self.cache, CACHES, _fail))
        if self.method == "flash_cache":
            put("mask_num", 4 if self.mask_num is None else check_int("mask_num", self.mask_num, _fail, low=1))
            put("track_num", 4 if self.track_num is None else check_int("track_num", self.track_num, _fail))
            if self.steps is not None:
                raise _fail("steps does not apply to method='flash_cache' (it commits by threshold)")
        if self.threshold is None and (self.method == "flash_cache" or (self.method == "fast_dllm" and self.steps is None)):
            put("threshold", 0.9)
        if self.method == "fast_dllm" and self.steps is not None and self.threshold is not None:
            raise _fail("fast_dllm takes steps (a fixed schedule) or threshold, not both")

        W = self.window
        if self.method in ("llada", "fast_dllm"):
            if self.gen_length % W:
                raise _fail(f"gen_length={self.gen_length} is not a multiple of block_length={W}")
            if self.uses_schedule:
                steps = self.total_steps
                blocks = self.gen_length // W
                if steps > self.gen_length or steps % blocks:
                    raise _fail(f"steps={steps}: expected a multiple of the {blocks} blocks and at most gen_length={self.gen_length}")
        if self.verify:
            if self.method != "flash_cache":
                raise _fail(f"verify=True is available with method='flash_cache', not {self.method!r}")
            put("gamma", 0.8 if self.gamma is None else check_float("gamma", self.gamma, _fail, low=0.0, high=1.0, low_open=True))
            put("accept", "cumprod" if self.accept is None else check_choice("accept", self.accept, ACCEPT_RULES, _fail))
            put("pin", "all_commits" if self.pin is None else check_choice("pin", self.pin, PIN_POLICIES, _fail))
            if self.window < 2:
                raise _fail("verify needs a window of at least 2 positions")

    @property
    def window(self) -> int:
        """W: the block (llada, fast_dllm; dream: the whole generation) or decoding window
        (flash_cache) length."""
        if self.block_length is not None:
            return self.block_length
        return self.gen_length if self.method == "dream" else _DEFAULT_BLOCK[self.method]

    @property
    def uses_schedule(self) -> bool:
        """Commit a fixed number of tokens per step (LLaDA's sampler) instead of a threshold."""
        return self.method != "flash_cache" and self.threshold is None

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.gen_length

    def static_key(self) -> DecodeConfig:
        """This config with the per-request defaults neutralised: equal keys share one loop."""
        return dataclasses.replace(
            self,
            threshold=None if self.threshold is None else 0.0,
            temperature=0.0,
            gamma=None if self.gamma is None else 1.0,
            seed=0,
        )
