"""DecodeConfig: the engine-level, compile-time choice of how to generate.

Its fields choose the compiled program: the method, window/block length, schedule, cache,
query rows, Flash-Verify's rules, the number of slots and the generation-length bucket.
What one request may choose (dllm_jax.sampling.params.SamplingParams: temperature, threshold,
gamma, seed, ...) is per-slot state of the loop, never part of this configuration.

Options default to None where "not set" must be told apart from a value, so that an option
that does not apply to the chosen method is an error rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Literal

from dllm_jax.common.validate import check_bool, check_choice, check_float, check_int
from dllm_jax.sampling.params import DEFAULT_GAMMA, DEFAULT_THRESHOLD

Method = Literal["llada", "fast_dllm", "flash_cache", "dream", "diffusion_gemma"]
METHODS: tuple[str, ...] = ("llada", "fast_dllm", "flash_cache", "dream", "diffusion_gemma")
DREAM_ALGORITHMS: tuple[str, ...] = ("origin", "maskgit_plus", "topk_margin", "entropy")
CACHES: tuple[str, ...] = ("prefix", "dual")
ACCEPT_RULES: tuple[str, ...] = ("cumprod", "paper")
PIN_POLICIES: tuple[str, ...] = ("all_commits", "reference")
SCHEDULES: tuple[str, ...] = ("threshold", "fixed", "entropy_bound")
# Fields that were defaults of requests, kept one release as deprecated aliases of SamplingParams'.
DEPRECATED_REQUEST_DEFAULTS: tuple[str, ...] = ("threshold", "temperature", "seed", "gamma")
MAX_SEED = 2**31
MAX_LOGPROBS = 64  # the most alternatives per token a loop records (OpenAI's API asks at most 20)
# The most steps of a canvas's stability test the diffusion_gemma loop keeps by default.
DEFAULT_MAX_STABILITY_THRESHOLD = 4

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
    "max_stability_threshold": ("diffusion_gemma",),
    # the canvas loop records no log-probabilities
    "max_logprobs": ("llada", "fast_dllm", "flash_cache", "dream"),
    "canvas_rows": ("diffusion_gemma",),
}
_VERIFY_ONLY = ("gamma", "accept", "pin")


class DecodeConfigError(ValueError):
    """An invalid combination of decoding options; the message names the option."""


def _fail(message: str) -> DecodeConfigError:
    return DecodeConfigError(message)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Options of the compiled decode loop (equal configs share one compiled loop).

    Attributes:
      method: "llada" (no cache, fixed tokens per step), "fast_dllm" (block cache refreshed at
        block boundaries, confidence threshold), "flash_cache" (flat cache, sliding window,
        selective refresh by tracking score), "dream" (Dream's own sampler, its
        diffusion_generate: the whole generation is one block, every step a full pass) or
        "diffusion_gemma" (DiffusionGemma's block diffusion: canvases of the model's
        canvas_length denoised one after the other over the encoder's cache, its
        entropy-bound sampler; dllm_jax.policies.canvas).
      gen_length: the generation-length bucket G: the most positions a request may generate
        (SamplingParams.max_new_tokens <= G; shorter requests share the loop). diffusion_gemma
        generates whole canvases: ceil(G / canvas length) of them at most.
      block_length: llada/fast_dllm: semi-autoregressive block size; flash_cache: the
        decoding window W; dream: the whole generation (leave it None); diffusion_gemma: the
        canvas length, which is the model's (None: taken from it by ``for_model``). None =
        the method's default (32, 32, 16).
      steps: loops with the fixed schedule (llada, dream, fast_dllm with schedule="fixed"):
        denoising steps over the whole generation (tokens per step = gen_length / steps;
        dream: its timestep schedule). None = gen_length (one token per step).
      schedule: how a step decides how many tokens to commit: "threshold" (every candidate
        whose confidence reaches the request's SamplingParams.threshold, at least one) or
        "fixed" (a fixed number per step, from `steps`), or diffusion_gemma's "entropy_bound"
        (the lowest-entropy positions within the request's entropy_bound). None = the method's:
        "threshold" for flash_cache, and for fast_dllm unless `steps` is given; "fixed" for
        llada and dream, "entropy_bound" for diffusion_gemma (the only one each takes).
      cache: fast_dllm only: "prefix" (recompute block + suffix) or "dual" (recompute block);
        None = "dual".
      mask_num: flash_cache only: masked rows recomputed per step, in blocks of W (the window
        included): look-ahead = (mask_num - 1) * W rows. None = 4.
      track_num: flash_cache only: decoded rows refreshed per step, in blocks of W; negative =
        refresh every position every step (exact). None = 4.
      batch_size: slots decoded together (continuous batching refills finished slots); the
        engine uses fewer when a call has fewer requests.
      verify: Flash-Verify (flash_cache only); accept (None = "cumprod") and pin (None =
        "all_commits") apply only with verify. Its gamma is per request (SamplingParams).
      cfg: compile the classifier-free-guidance variant (llada only: a second, unconditional
        full pass per step). The engine turns it on when a request sets cfg_scale > 0.
      alg: dream only: which masked positions a step unmasks (dllm_jax.policies.dream_unmasking):
        "origin" (each with probability 1 - s/t), "maskgit_plus" (top probability),
        "topk_margin" (top-1 minus top-2) or "entropy" (negative entropy); None = "entropy".
        Its alg_temp, like temperature, top_p and top_k, is per request (SamplingParams).
      eps: dream only: the end of the timestep schedule linspace(1, eps, steps + 1), in
        (0, 1); None = 1e-3.
      max_logprobs: the most alternatives per token a request may ask with
        SamplingParams.logprobs (their per-position arrays are part of the loop's state); 0:
        requests may ask for their tokens' log-probabilities only; None (default): the loop
        records none (no code for it in the step). Not for diffusion_gemma (its canvas loop
        records none).
      max_stability_threshold: diffusion_gemma only: the most previous steps a canvas's
        stability test compares (the history the loop keeps; a request's
        SamplingParams.stability_threshold is at most this). None = 4.
      canvas_rows: diffusion_gemma only: Flash-Cache on the canvas. After a canvas's first
        denoising step, each step recomputes this many of its rows (those whose token changed,
        then the most attended: dllm_jax.policies.canvas) and the others keep the keys, values
        and last-layer rows of their last recomputation; the canvas length recomputes every
        row through the same cached path. None = every row every step, read-only (exact).
      threshold, temperature, seed, gamma: deprecated (they were the defaults of requests that
        do not set them; set them in SamplingParams): still taken for one release, with a
        DeprecationWarning. They never change the compiled loop (not compared).
    """

    method: Method = "flash_cache"
    gen_length: int = 256
    _: dataclasses.KW_ONLY
    block_length: int | None = None
    steps: int | None = None
    schedule: str | None = None
    cache: str | None = None
    mask_num: int | None = None
    track_num: int | None = None
    batch_size: int = 8
    verify: bool = False
    accept: str | None = None
    pin: str | None = None
    cfg: bool = False
    alg: str | None = None
    eps: float | None = None
    max_logprobs: int | None = None
    max_stability_threshold: int | None = None
    canvas_rows: int | None = None
    threshold: float | None = dataclasses.field(default=None, compare=False)
    temperature: float | None = dataclasses.field(default=None, compare=False)
    seed: int | None = dataclasses.field(default=None, compare=False)
    gamma: float | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        check_choice("method", self.method, METHODS, _fail)
        check_int("gen_length", self.gen_length, _fail, low=1)
        check_int("block_length", self.block_length, _fail, low=1, optional=True)
        check_int("steps", self.steps, _fail, low=1, optional=True)
        check_int("batch_size", self.batch_size, _fail, low=1)
        check_int("max_logprobs", self.max_logprobs, _fail, low=0, high=MAX_LOGPROBS, optional=True)
        check_int("canvas_rows", self.canvas_rows, _fail, low=1, optional=True)
        check_bool("verify", self.verify, _fail)
        check_bool("cfg", self.cfg, _fail)
        if self.schedule is not None:
            check_choice("schedule", self.schedule, SCHEDULES, _fail)
        given = [name for name in DEPRECATED_REQUEST_DEFAULTS if getattr(self, name) is not None]
        if given:
            warnings.warn(
                f"DecodeConfig({', '.join(f'{n}=...' for n in given)}): request defaults in DecodeConfig are "
                "deprecated; set them per request in SamplingParams",
                DeprecationWarning,
                stacklevel=3,
            )
        check_int("seed", self.seed, _fail, low=0, high=MAX_SEED - 1, optional=True)
        put("temperature", check_float("temperature", self.temperature, _fail, low=0.0, optional=True))
        put("threshold", check_float("threshold", self.threshold, _fail, low=0.0, optional=True))
        for name, methods in _ONLY_FOR.items():
            value = getattr(self, name)
            if value is not None and value is not False and self.method not in methods:
                raise _fail(f"{name}={value!r} does not apply to method={self.method!r} (only to {', '.join(methods)})")
        if not self.verify:
            for name in _VERIFY_ONLY:
                if getattr(self, name) is not None:
                    raise _fail(f"{name}={getattr(self, name)!r} applies only with verify=True")
        put("schedule", self._resolved_schedule())
        if self.method == "dream":
            if self.block_length not in (None, self.gen_length):
                raise _fail(
                    f"block_length={self.block_length} does not apply to method='dream' (the whole generation is one block)"
                )
            if self.total_steps > self.gen_length:
                raise _fail(f"steps={self.steps}: expected at most gen_length={self.gen_length}")
            put("alg", "entropy" if self.alg is None else check_choice("alg", self.alg, DREAM_ALGORITHMS, _fail))
            put(
                "eps",
                1e-3 if self.eps is None else check_float("eps", self.eps, _fail, low=0.0, high=1.0, low_open=True),
            )
            if self.eps == 1.0:
                raise _fail("eps=1.0: expected a number in (0, 1) (the schedule runs from 1 down to eps)")

        if self.method == "diffusion_gemma":
            put(
                "max_stability_threshold",
                DEFAULT_MAX_STABILITY_THRESHOLD
                if self.max_stability_threshold is None
                else check_int("max_stability_threshold", self.max_stability_threshold, _fail, low=0),
            )
        if self.method == "fast_dllm":
            put("cache", "dual" if self.cache is None else check_choice("cache", self.cache, CACHES, _fail))
        if self.method == "flash_cache":
            put("mask_num", 4 if self.mask_num is None else check_int("mask_num", self.mask_num, _fail, low=1))
            put("track_num", 4 if self.track_num is None else check_int("track_num", self.track_num, _fail))

        if self.method in ("llada", "fast_dllm"):
            W = self.window
            if self.gen_length % W:
                raise _fail(f"gen_length={self.gen_length} is not a multiple of block_length={W}")
            if self.fixed_schedule:
                steps = self.total_steps
                blocks = self.gen_length // W
                if steps > self.gen_length or steps % blocks:
                    raise _fail(
                        f"steps={steps}: expected a multiple of the {blocks} blocks and at most gen_length={self.gen_length}"
                    )
        if self.verify:
            if self.method != "flash_cache":
                raise _fail(f"verify=True is available with method='flash_cache', not {self.method!r}")
            put("gamma", check_float("gamma", self.gamma, _fail, low=0.0, high=1.0, low_open=True, optional=True))
            put(
                "accept", "cumprod" if self.accept is None else check_choice("accept", self.accept, ACCEPT_RULES, _fail)
            )
            put("pin", "all_commits" if self.pin is None else check_choice("pin", self.pin, PIN_POLICIES, _fail))
            if self.window < 2:
                raise _fail("verify needs a window of at least 2 positions")

    def _resolved_schedule(self) -> str:
        """The schedule, checked against the method, steps and the deprecated threshold."""
        only = {"llada": "fixed", "dream": "fixed", "flash_cache": "threshold", "diffusion_gemma": "entropy_bound"}.get(
            self.method
        )
        if self.threshold is not None and only == "fixed":
            raise _fail(
                f"threshold does not apply to method={self.method!r} (it commits by its fixed schedule: set steps)"
            )
        if self.method == "flash_cache" and self.steps is not None:
            raise _fail("steps does not apply to method='flash_cache' (it commits by threshold)")
        if only is not None:
            if self.schedule not in (None, only):
                raise _fail(f"schedule={self.schedule!r} does not apply to method={self.method!r} (it takes {only!r})")
            return only
        # fast_dllm: a fixed schedule of `steps`, or threshold commits
        wanted = self.schedule
        if wanted is None:
            wanted = "fixed" if self.steps is not None else "threshold"
        if wanted == "entropy_bound":
            raise _fail("schedule='entropy_bound' does not apply to method='fast_dllm' (it is diffusion_gemma's)")
        if wanted == "threshold" and self.steps is not None:
            raise _fail("fast_dllm takes steps (a fixed schedule) or threshold, not both")
        if wanted == "fixed" and self.threshold is not None:
            raise _fail("fast_dllm takes steps (a fixed schedule) or threshold, not both")
        return wanted

    @property
    def window(self) -> int:
        """W: the block (llada, fast_dllm; dream: the whole generation; diffusion_gemma: the
        canvas) or decoding window (flash_cache) length."""
        if self.block_length is not None:
            return self.block_length
        if self.method == "diffusion_gemma":
            raise _fail(
                "method='diffusion_gemma' takes its canvas length from the model: DecodeConfig.for_model(config)"
            )
        return self.gen_length if self.method == "dream" else _DEFAULT_BLOCK[self.method]

    @property
    def canvases(self) -> int:
        """diffusion_gemma: the most canvases of a request, ceil(gen_length / canvas length)."""
        return -(-self.gen_length // self.window)

    def for_model(self, model: Any) -> DecodeConfig:
        """This configuration as it runs on `model` (a ModelConfig or DiffusionGemmaConfig):
        diffusion_gemma's block_length set to the model's canvas length. Raises
        DecodeConfigError when the method and the model's family do not go together."""
        block_diffusion = getattr(model, "family", None) == "diffusion_gemma"
        if block_diffusion != (self.method == "diffusion_gemma"):
            family = getattr(model, "family", type(model).__name__)
            wanted = "method='diffusion_gemma'" if block_diffusion else "a method other than 'diffusion_gemma'"
            raise _fail(f"method={self.method!r} does not run a {family} model (it takes {wanted})")
        if not block_diffusion:
            return self
        if self.block_length not in (None, model.canvas_length):
            raise _fail(
                f"block_length={self.block_length}: diffusion_gemma denoises canvases of the model's "
                f"canvas_length={model.canvas_length}"
            )
        if self.canvas_rows is not None and self.canvas_rows > model.canvas_length:
            raise _fail(f"canvas_rows={self.canvas_rows}: expected at most the canvas length {model.canvas_length}")
        return self if self.block_length is not None else dataclasses.replace(self, block_length=model.canvas_length)

    def step_limit(self, prompt_len: int, max_new_tokens: int, max_denoising_steps: int) -> int:
        """A hard bound on one request's loop steps (a request past it ends with an error).

        Block methods commit at least one position per step: twice the most steps they can
        need. diffusion_gemma: its prompt's encoding in canvas-length chunks, then per canvas
        at most max_denoising_steps denoising steps and one encoding step (with an unresolved
        canvas length, a bound for length 1)."""
        if self.method != "diffusion_gemma":
            return 2 * max_new_tokens + 2
        length = self.block_length or 1
        canvases = -(-max_new_tokens // length)
        return -(-prompt_len // length) + canvases * (max_denoising_steps + 1) + 1

    @property
    def fixed_schedule(self) -> bool:
        """Commit a fixed number of tokens per step (LLaDA's sampler) instead of by threshold."""
        return self.schedule == "fixed"

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.gen_length

    @property
    def default_threshold(self) -> float:
        """The threshold of requests that set none (the deprecated `threshold`, else 0.9)."""
        return DEFAULT_THRESHOLD if self.threshold is None else self.threshold

    @property
    def default_gamma(self) -> float:
        """The gamma of requests that set none (the deprecated `gamma`, else 0.8)."""
        return DEFAULT_GAMMA if self.gamma is None else self.gamma

    @property
    def base_seed(self) -> int:
        """The seed of requests that set none (the deprecated `seed`, else 0)."""
        return 0 if self.seed is None else self.seed


def default_method(model: Any) -> str:
    """The method of a run that names none on `model` (a ModelConfig or DiffusionGemmaConfig):
    its family's (DiffusionGemma: its own block diffusion), else DecodeConfig's default."""
    if getattr(model, "family", None) == "diffusion_gemma":
        return "diffusion_gemma"
    return DecodeConfig.__dataclass_fields__["method"].default
