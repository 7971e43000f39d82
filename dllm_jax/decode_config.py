"""DecodeConfig: how to generate (method, lengths, thresholds, batching).

Fields that change the compiled program's shapes are static; thresholds and temperature are
passed to the compiled loop as traced scalars, so sweeping them never recompiles.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
from flax import struct

Method = Literal["llada", "fast_dllm", "flash_cache", "dream"]
METHODS: tuple[str, ...] = ("llada", "fast_dllm", "flash_cache", "dream")
DREAM_ALGORITHMS: tuple[str, ...] = ("origin", "maskgit_plus", "topk_margin", "entropy")
CACHES: tuple[str, ...] = ("prefix", "dual")
ACCEPT_RULES: tuple[str, ...] = ("cumprod", "paper")
PIN_POLICIES: tuple[str, ...] = ("all_commits", "reference")

# Default decoding window / block length per method (published settings).
_DEFAULT_BLOCK = {"llada": 32, "fast_dllm": 32, "flash_cache": 16}


class DecodeConfigError(ValueError):
    """An invalid combination of decoding options; the message names the option."""


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Options of one generation run.

    Attributes:
      method: "llada" (no cache, fixed tokens per step), "fast_dllm" (block cache refreshed at
        block boundaries, confidence threshold) or "flash_cache" (flat cache, sliding window,
        selective refresh by tracking score).
      gen_length: generated positions per request (G).
      block_length: llada/fast_dllm: semi-autoregressive block size; flash_cache: the
        decoding window W. None = the method's default (32, 32, 16).
      steps: llada and fast_dllm without threshold: denoising steps over the whole generation
        (tokens per step = gen_length / steps). None = gen_length (one token per step).
      threshold: confidence threshold for parallel commits (fast_dllm, flash_cache); a value
        above 1 commits exactly one token per step, 0 the whole window. None = 0.9 for
        flash_cache, and for fast_dllm 0.9 unless `steps` asks for a fixed schedule; llada
        always uses the fixed schedule.
      cache: fast_dllm cache: "prefix" (recompute block + suffix) or "dual" (recompute block).
      mask_num: flash_cache: masked rows recomputed per step, in blocks of W (the window
        included): look-ahead = (mask_num - 1) * W rows.
      track_num: flash_cache: decoded rows refreshed per step, in blocks of W; negative =
        refresh every position every step (exact).
      temperature: 0 = greedy; > 0 = Gumbel-max sampling at this temperature.
      batch_size: slots decoded together (continuous batching refills finished slots).
      seed: base of the per-request random streams (used when temperature > 0).
      verify, gamma, accept, pin: Flash-Verify options (flash_cache only).
      alg, alg_temp, eps, top_p, top_k: Dream's sampler (method "dream", its diffusion_generate:
        dllm_jax.dream_sampling): which positions to unmask (alg, alg_temp), the timestep
        schedule's eps, and the token filters (top_p 1 and top_k 0 = off; traced scalars).
    """

    method: Method = "flash_cache"
    gen_length: int = 256
    block_length: int | None = None
    steps: int | None = None
    threshold: float | None = None
    cache: str = "dual"
    mask_num: int = 4
    track_num: int = 4
    temperature: float = 0.0
    batch_size: int = 8
    seed: int = 0
    verify: bool = False
    gamma: float = 0.8
    accept: str = "cumprod"
    pin: str = "all_commits"
    alg: str = "entropy"
    alg_temp: float = 0.0
    eps: float = 1e-3
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        def fail(message: str):
            raise DecodeConfigError(message)

        if self.method not in METHODS:
            fail(f"method={self.method!r}: expected one of {METHODS}")
        if not isinstance(self.gen_length, int) or self.gen_length <= 0:
            fail(f"gen_length={self.gen_length!r}: expected a positive integer")
        if self.block_length is not None and (not isinstance(self.block_length, int) or self.block_length <= 0):
            fail(f"block_length={self.block_length!r}: expected a positive integer")
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            fail(f"batch_size={self.batch_size!r}: expected a positive integer")
        if self.threshold is None and (
            self.method == "flash_cache" or (self.method == "fast_dllm" and self.steps is None)
        ):
            object.__setattr__(self, "threshold", 0.9)
        if self.temperature < 0:
            fail(f"temperature={self.temperature}: expected >= 0")
        if self.threshold is not None and self.threshold < 0:
            fail(f"threshold={self.threshold}: expected >= 0 (above 1 commits one token per step)")
        if self.method == "dream":
            self._check_dream(fail)
        W = self.window
        if self.method in ("llada", "fast_dllm"):
            if self.gen_length % W:
                fail(f"gen_length={self.gen_length} is not a multiple of block_length={W}")
            if self.uses_schedule:
                steps = self.total_steps
                blocks = self.gen_length // W
                if steps <= 0 or steps > self.gen_length or steps % blocks:
                    fail(f"steps={steps}: expected a multiple of the {blocks} blocks and at most gen_length={self.gen_length}")
        if self.method == "fast_dllm" and self.cache not in CACHES:
            fail(f"cache={self.cache!r}: expected one of {CACHES}")
        if self.method == "llada" and self.threshold is not None:
            fail("llada commits a fixed number of tokens per step: set steps, not threshold")
        if self.method == "flash_cache":
            if self.mask_num < 1:
                fail(f"mask_num={self.mask_num}: expected >= 1 (the window counts as one block)")
        if self.verify:
            if self.method != "flash_cache":
                fail(f"verify=True is available with method='flash_cache', not {self.method!r}")
            if not 0 < self.gamma <= 1:
                fail(f"gamma={self.gamma}: expected 0 < gamma <= 1")
            if self.accept not in ACCEPT_RULES:
                fail(f"accept={self.accept!r}: expected one of {ACCEPT_RULES}")
            if self.pin not in PIN_POLICIES:
                fail(f"pin={self.pin!r}: expected one of {PIN_POLICIES}")
            if self.window < 2:
                fail("verify needs a window of at least 2 positions")

    def _check_dream(self, fail) -> None:
        if self.alg not in DREAM_ALGORITHMS:
            fail(f"alg={self.alg!r}: expected one of {DREAM_ALGORITHMS}")
        if self.block_length not in (None, self.gen_length):
            fail("method='dream' decodes the whole generation as one block: leave block_length unset")
        if self.threshold is not None:
            fail("method='dream' unmasks by its timestep schedule: set steps, not threshold")
        if not 0 < self.total_steps <= self.gen_length:
            fail(f"steps={self.steps}: expected 1 <= steps <= gen_length={self.gen_length}")
        if not 0 < self.eps < 1:
            fail(f"eps={self.eps}: expected 0 < eps < 1")
        if self.alg_temp < 0:
            fail(f"alg_temp={self.alg_temp}: expected >= 0")
        if not 0 < self.top_p <= 1:
            fail(f"top_p={self.top_p}: expected 0 < top_p <= 1")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail(f"top_k={self.top_k!r}: expected an integer >= 0 (0 = off)")

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

    def knobs(self) -> DecodeKnobs:
        """The traced scalars of this config."""
        threshold = 2.0 if self.threshold is None else self.threshold
        return DecodeKnobs(
            threshold=jnp.float32(threshold), temperature=jnp.float32(self.temperature), gamma=jnp.float32(self.gamma),
            top_p=jnp.float32(self.top_p), top_k=jnp.int32(self.top_k), alg_temp=jnp.float32(self.alg_temp),
        )

    def static_key(self) -> DecodeConfig:
        """This config with the traced scalars neutralised: equal keys share one compiled loop."""
        return dataclasses.replace(
            self,
            threshold=None if self.threshold is None else 0.0,
            temperature=0.0,
            gamma=1.0,
            seed=0,
            top_p=1.0,
            top_k=0,
            alg_temp=0.0,
        )


@struct.dataclass
class DecodeKnobs:
    """Scalars the compiled loop reads at run time."""

    threshold: jnp.ndarray
    temperature: jnp.ndarray
    gamma: jnp.ndarray
    top_p: jnp.ndarray  # Dream's sampler (method "dream")
    top_k: jnp.ndarray
    alg_temp: jnp.ndarray
