"""SamplingParams: what one request may choose, without changing the compiled program.

This is the one schema of per-request values. A field declared with ``knob(...)`` travels to the
device as one scalar per slot: the declaration gives its device dtype, its bounds (within what
that dtype can hold), how the stored value is encoded when it differs from the request's, what
an unset value (None) becomes, which key of a model's generation_config.json supplies its
default, which compiled configurations it applies to, and whether the server takes it in the
``dllm`` extension. The per-slot arrays (dllm_jax.runtime.slots.SlotSampling),
their zero constructor, the host's request ring and the server's options are derived from these
declarations, so a new knob is one field here plus its use in a policy.

What is compiled (method, window, slots, generation bucket) is dllm_jax.runtime.decode_config.DecodeConfig.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from dllm_jax.common.errors import SamplingParamsError
from dllm_jax.common.validate import check_choice, check_float, check_int

REMASKING: tuple[str, ...] = ("low_confidence", "random")
# Flash-Cache's tracking rules (dllm_jax.policies.tracking_rules), stored per slot as the index.
TRACK_RULES: tuple[str, ...] = ("attention", "recent", "random", "drift", "none")
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_SEED = 2**31  # seeds are int32 on the device
DEFAULT_THRESHOLD = 0.9  # the published Fast-dLLM / Flash-dLLM confidence threshold
DEFAULT_GAMMA = 0.8  # the published Flash-Verify acceptance threshold


@dataclasses.dataclass(frozen=True)
class Knob:
    """How one SamplingParams field is checked and stored per slot.

    dtype: the device dtype of its per-slot value (np.int32, np.float32 or np.bool_).
    low, high, low_open: bounds of an int or float (None: the dtype's own limit);
      choices: the allowed strings of a choice field.
    optional: None is allowed (it means "unset": see `unset`).
    slot_name: the per-slot value's name where it differs from the field's.
    encode: request value -> stored value (e.g. remasking -> whether it is "random").
    unset: what an unset value stores, given the compiled configuration (a DecodeConfig);
      fallback: the same for a value that does not depend on it (e.g. temperature 0.0). Both
      come after the model's default (generation_config).
    generation_config: the key of a model's generation_config.json (transformers'
      GenerationConfig) whose value is this field's default for that model; a dotted key names
      one inside an object ("sampler_config.entropy_bound").
    applies: (predicate over the compiled configuration and its cfg flag, why not): a set value
      that does not apply to the loop is refused.
    compiled_high: the name of the compiled configuration's field that holds this value's most
      (e.g. the history a loop keeps); a larger value is refused when the request is resolved
      against the loop.
    server: the server takes it in the request's "dllm" object.
    flag: dllm-generate takes it as --NAME (with `help`); max_new_tokens, gen_length and seed
      have flags of their own meaning there (--gen-length is the generation bucket).
    """

    dtype: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    optional: bool = False
    slot_name: str | None = None
    encode: Callable[[Any], Any] | None = None
    unset: Callable[[Any], Any] | None = None
    fallback: Any = None
    generation_config: str | None = None
    applies: tuple[Callable[[Any, bool], bool], str] | None = None
    compiled_high: str | None = None
    server: bool = False
    flag: bool = True
    help: str = ""

    @property
    def kind(self) -> str:
        if self.choices is not None:
            return "choice"
        return "int" if self.dtype is np.int32 else "float"

    def check(self, name: str, value: Any) -> Any:
        """The value, normalised (ints as int, floats as float), or SamplingParamsError naming `name`."""
        if self.kind == "choice":
            return check_choice(name, value, self.choices, _fail)
        if self.kind == "int":
            low = -INT32_MAX - 1 if self.low is None else self.low
            high = INT32_MAX if self.high is None else self.high
            return check_int(name, value, _fail, low=low, high=high, optional=self.optional)
        low = -FLOAT32_MAX if self.low is None else self.low
        high = FLOAT32_MAX if self.high is None else self.high
        return check_float(name, value, _fail, low=low, high=high, low_open=self.low_open, optional=self.optional)

    def unset_value(self, decode: Any) -> Any:
        """What an unset value (None) stores when the model sets no default: unset(decode), else
        the fallback (None for a field whose None is meaningful, e.g. seed)."""
        return self.unset(decode) if self.unset is not None else self.fallback


def knob(default: Any, dtype: type, **spec: Any) -> Any:
    """A SamplingParams field that travels to the device (see Knob)."""
    return dataclasses.field(default=default, metadata={"knob": Knob(dtype, **spec)})


def _fail(message: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams: {message}")


def _threshold_schedule(decode: Any) -> bool:
    return decode.schedule == "threshold"


def _has_tracking_budget(decode: Any) -> bool:
    return decode.method == "flash_cache" and decode.track_num >= 0


def _diffusion_gemma(decode: Any) -> bool:
    return decode.method == "diffusion_gemma"


# DiffusionGemma's sampler (dllm_jax.policies.canvas) takes its own values and none of the others'.
_ONLY_DIFFUSION_GEMMA = (
    lambda decode, cfg: _diffusion_gemma(decode),
    "applies only to method='diffusion_gemma' (DiffusionGemma's entropy-bound sampler), not {method}",
)
_NOT_DIFFUSION_GEMMA = (
    lambda decode, cfg: not _diffusion_gemma(decode),
    "does not apply to method='diffusion_gemma' (its sampler anneals the temperature from t_max to t_min "
    "and accepts by entropy_bound)",
)
_CANVAS_NOT_CHOSEN = (
    lambda decode, cfg: not _diffusion_gemma(decode),
    "does not apply to method='diffusion_gemma' (its canvases are the model's canvas length; "
    "max_new_tokens cuts the answer)",
)
_LOGPROBS_NOT_RECORDED = (
    lambda decode, cfg: not _diffusion_gemma(decode),
    "does not apply to method='diffusion_gemma' (its canvas loop records no log-probabilities)",
)
# transformers' DiffusionGemmaGenerationConfig defaults (google/diffusiongemma-26B-A4B-it's too).
DEFAULT_T_MIN, DEFAULT_T_MAX = 0.4, 0.8
MAX_DENOISING_STEPS = 2**16


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Generation parameters of one request.

    A field left at None is unset: it takes the model's default where its generation_config.json
    sets one (the fields named in the Knob's generation_config; Engine.generation_defaults),
    else the value said below. A value the request sets always wins.

    Attributes:
      max_new_tokens: the most tokens of the answer: it is cut after this many (finish_reason
        "length"), and its decoding ends once they are all decoded. The canvas stays
        gen_length, so the answer is a prefix of the one without the cut. None = the model's
        max_new_tokens (at most the canvas), else gen_length; at most gen_length.
      gen_length: the request's canvas: the masked positions it decodes (the positions after
        it are EOS padding). A smaller canvas changes the answer itself (the model sees a
        shorter masked answer: the diffusion behaviour), unlike max_new_tokens. None = the
        engine's generation bucket (DecodeConfig.gen_length), capped by the model's
        max_sequence_length minus the prompt; at most the bucket.
      temperature: 0 = greedy; > 0 = Gumbel-max sampling at this temperature (LLaDA's
        add_gumbel_noise); None = 0.
      top_p: nucleus filtering before sampling (Dream's top_p_logits), 1 = off; None = 1.
      top_k: keep the k largest logits before sampling (Dream's top_k_logits), 0 = off; None = 0.
      min_p: keep the tokens whose probability is at least min_p times the most likely one's
        (transformers' MinPLogitsWarper, at the request's temperature), 0 = off; None = 0.
      seed: this request's random stream (same seed, same answer, wherever it runs); None =
        seed 0 and the request's index in its generate() call (its add order in a session).
      stop: strings that end the answer (cut before the first occurrence).
      stop_token_ids: token ids that end the answer (cut before the first one).
      threshold: confidence threshold of parallel commits (loops with the threshold schedule:
        fast_dllm, flash_cache); a value above 1 commits exactly one token per step, 0 the
        whole window; None = 0.9.
      gamma: Flash-Verify acceptance threshold in (0, 1] (loops with verify=True); None = 0.8.
      cfg_scale: LLaDA's classifier-free guidance, 0 = off (method="llada").
      remasking: "low_confidence" (commit the most confident) or "random" (LLaDA's random
        remasking: confidence is a uniform random number).
      alg_temp: Dream's sampler (method "dream") only: 0 = unmask the most confident masked
        positions; > 0 = draw them from softmax(confidence / alg_temp); None = 0.
      track_rule: flash_cache with track_num >= 0: which decoded rows fill the step's tracking
        budget after this step's fresh commits: "attention" (the highest tracking scores, the
        published rule), "recent" (the most recently committed), "random" (uniform, from the
        request's random stream), "drift" (the largest K/V change at their last refresh), or
        "none" (refresh no decoded row: budget 0, the fresh commits included).
      logprobs: None = off; k >= 0: each answer token comes with the log-probability it had
        when it was committed (log_softmax of the model's logits at that step, before
        temperature, top_p and top_k) and the k most likely tokens of that step
        (GenerationResult.logprobs); k is at most the loop's DecodeConfig.max_logprobs (a
        loop compiled with max_logprobs=None records none). Recorded on the device only for
        the requests that ask.
      max_denoising_steps, t_min, t_max, entropy_bound, stability_threshold,
        confidence_threshold: DiffusionGemma's sampler (method "diffusion_gemma") only, under
        transformers' names and defaults (None = 48, 0.4, 0.8, 0.1, 1, 0.005): a canvas is
        denoised for at most max_denoising_steps steps, step n of N at temperature
        t_min + (t_max - t_min) * (N - n) / N;
        each step accepts the lowest-entropy positions while their entropies (less the largest)
        sum to at most entropy_bound and renoises the others; a canvas stops early once its
        argmax equals that of each of the previous stability_threshold steps (at most the
        loop's DecodeConfig.max_stability_threshold) and its mean entropy is below
        confidence_threshold.
    """

    max_new_tokens: int | None = knob(
        None, np.int32, low=1, optional=True, flag=False, generation_config="max_new_tokens"
    )
    gen_length: int | None = knob(
        None,
        np.int32,
        low=1,
        optional=True,
        server=True,
        flag=False,
        applies=_CANVAS_NOT_CHOSEN,
        help="the request's canvas (masked answer positions); a smaller one changes the answer, "
        "where max_tokens cuts it",
    )
    temperature: float | None = knob(
        None,
        np.float32,
        low=0.0,
        optional=True,
        fallback=0.0,
        generation_config="temperature",
        applies=_NOT_DIFFUSION_GEMMA,
        help="0 decodes greedily, > 0 samples (Gumbel-max)",
    )
    top_p: float | None = knob(
        None,
        np.float32,
        low=0.0,
        high=1.0,
        low_open=True,
        optional=True,
        fallback=1.0,
        generation_config="top_p",
        applies=_NOT_DIFFUSION_GEMMA,
        help="nucleus sampling: keep the smallest set of tokens of this total probability (1: off)",
    )
    top_k: int | None = knob(
        None,
        np.int32,
        low=0,
        optional=True,
        fallback=0,
        generation_config="top_k",
        server=True,
        applies=_NOT_DIFFUSION_GEMMA,
        help="sample among the k most likely tokens (0: off)",
    )
    min_p: float | None = knob(
        None,
        np.float32,
        low=0.0,
        high=1.0,
        optional=True,
        fallback=0.0,
        generation_config="min_p",
        server=True,
        help="sample among the tokens at least min_p times as likely as the most likely one (0: off)",
        applies=_NOT_DIFFUSION_GEMMA,
    )
    seed: int | None = knob(None, np.int32, low=0, high=MAX_SEED - 1, optional=True, flag=False)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    threshold: float | None = knob(
        None,
        np.float32,
        low=0.0,
        optional=True,
        server=True,
        help=f"confidence threshold for parallel commits (fast_dllm, flash_cache); default: {DEFAULT_THRESHOLD} "
        "(llada and fast_dllm --steps commit a fixed number per step)",
        # a fixed schedule never reads it: 2.0 would commit one token per step
        unset=lambda decode: decode.default_threshold if _threshold_schedule(decode) else 2.0,
        applies=(
            lambda decode, cfg: _threshold_schedule(decode),
            "does not apply to method={method} with schedule={schedule} (it commits a fixed number of tokens "
            "per step, set by steps); threshold commits are fast_dllm's and flash_cache's schedule='threshold'",
        ),
    )
    gamma: float | None = knob(
        None,
        np.float32,
        low=0.0,
        high=1.0,
        low_open=True,
        optional=True,
        server=True,
        help=f"Flash-Verify's acceptance threshold; default: {DEFAULT_GAMMA}",
        unset=lambda decode: decode.default_gamma if decode.verify else 1.0,
        applies=(lambda decode, cfg: decode.verify, "applies only with verify=True (Flash-Verify)"),
    )
    cfg_scale: float = knob(
        0.0,
        np.float32,
        low=0.0,
        server=True,
        help="llada: classifier-free guidance scale (a second, unconditional pass per step; 0: off)",
        applies=(
            lambda decode, cfg: cfg,
            "is available with method='llada' compiled with DecodeConfig(cfg=True) "
            "(a second, unconditional full pass per step), not {method} (cfg={cfg})",
        ),
    )
    remasking: str = knob(
        "low_confidence",
        np.bool_,
        choices=REMASKING,
        slot_name="random_remasking",
        encode=lambda value: value == "random",
        server=True,
        applies=_NOT_DIFFUSION_GEMMA,
        help="which predictions commit first: the most confident, or random ones (LLaDA's options)",
    )
    alg_temp: float | None = knob(
        None,
        np.float32,
        low=0.0,
        optional=True,
        fallback=0.0,
        generation_config="alg_temp",
        server=True,
        help="dream: 0 unmasks the most confident positions, > 0 draws them from softmax(confidence / alg_temp)",
        applies=(lambda decode, cfg: decode.method == "dream", "applies only to method='dream', not {method}"),
    )
    track_rule: str = knob(
        "attention",
        np.int32,
        choices=TRACK_RULES,
        encode=TRACK_RULES.index,
        server=True,
        help="flash_cache: which decoded rows fill the tracking budget after the fresh commits: the most attended "
        "(attention), the most recently committed (recent), random ones (random), those whose K/V changed most "
        "at their last refresh (drift), or none (budget 0)",
        applies=(
            lambda decode, cfg: _has_tracking_budget(decode),
            "applies only to method='flash_cache' with track_num >= 0 (this loop: method={method}; a negative "
            "track_num refreshes every position every step)",
        ),
    )
    max_denoising_steps: int | None = knob(
        None,
        np.int32,
        low=1,
        high=MAX_DENOISING_STEPS,
        optional=True,
        fallback=48,
        generation_config="max_denoising_steps",
        server=True,
        applies=_ONLY_DIFFUSION_GEMMA,
        help="diffusion_gemma: denoising steps of a canvas at most (it stops earlier once stable and confident)",
    )
    t_min: float | None = knob(
        None,
        np.float32,
        low=0.0,
        optional=True,
        fallback=DEFAULT_T_MIN,
        generation_config="t_min",
        server=True,
        applies=_ONLY_DIFFUSION_GEMMA,
        help="diffusion_gemma: the temperature of a canvas's last denoising step",
    )
    t_max: float | None = knob(
        None,
        np.float32,
        low=0.0,
        low_open=True,
        optional=True,
        fallback=DEFAULT_T_MAX,
        generation_config="t_max",
        server=True,
        applies=_ONLY_DIFFUSION_GEMMA,
        help="diffusion_gemma: the temperature of a canvas's first denoising step (falling linearly to t_min)",
    )
    entropy_bound: float | None = knob(
        None,
        np.float32,
        low=0.0,
        low_open=True,
        optional=True,
        fallback=0.1,
        generation_config="sampler_config.entropy_bound",
        server=True,
        applies=_ONLY_DIFFUSION_GEMMA,
        help="diffusion_gemma: a step accepts the lowest-entropy positions while their summed entropy, less the "
        "largest, stays within this bound",
    )
    stability_threshold: int | None = knob(
        None,
        np.int32,
        low=0,
        optional=True,
        fallback=1,
        generation_config="stability_threshold",
        server=True,
        applies=_ONLY_DIFFUSION_GEMMA,
        compiled_high="max_stability_threshold",
        help="diffusion_gemma: a canvas may stop once its argmax is that of this many previous steps "
        "(at most the loop's max_stability_threshold)",
    )
    confidence_threshold: float | None = knob(
        None,
        np.float32,
        low=0.0,
        low_open=True,
        optional=True,
        fallback=0.005,
        generation_config="confidence_threshold",
        server=True,
        applies=_ONLY_DIFFUSION_GEMMA,
        help="diffusion_gemma: a stable canvas stops once its mean entropy is below this",
    )

    logprobs: int | None = knob(
        None,
        np.int32,
        low=0,
        optional=True,
        flag=False,
        applies=_LOGPROBS_NOT_RECORDED,
        help="record each answer token's log-probability at its commit and this many alternatives",
        unset=lambda decode: -1,  # off
    )

    def __post_init__(self):
        for field in dataclasses.fields(self):
            spec = field.metadata.get("knob")
            if spec is not None:
                object.__setattr__(self, field.name, spec.check(field.name, getattr(self, field.name)))
        if self.t_min is not None and self.t_max is not None and (problem := annealing_problem(self.t_min, self.t_max)):
            raise _fail(problem)
        object.__setattr__(self, "stop", _string_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _id_tuple(self.stop_token_ids))

    def not_applying(self, decode: Any, cfg: bool) -> str | None:
        """Why a value this request sets does not apply to a loop compiled for `decode` (with
        the guidance pass when `cfg`), or None when all apply. A value that changes nothing (None,
        the default, the fallback: temperature 0, top_p 1) always applies."""
        for name, spec in knobs().items():
            value = getattr(self, name)
            default = SamplingParams.__dataclass_fields__[name].default
            if spec.applies is None or value is None or value == default or value == spec.fallback:
                continue
            holds, why = spec.applies
            if not holds(decode, cfg):
                return f"{name}={value} " + why.format(
                    method=repr(decode.method), schedule=repr(decode.schedule), cfg=cfg
                )
        return None


def annealing_problem(t_min: float, t_max: float) -> str | None:
    """What is wrong with DiffusionGemma's temperature range, or None: it falls from t_max to t_min."""
    if t_max > t_min:
        return None
    return f"t_max={t_max} must be above t_min={t_min} (the temperature falls from t_max to t_min)"


def knobs() -> dict[str, Knob]:
    """The fields of SamplingParams that travel to the device, in declaration order."""
    return {f.name: f.metadata["knob"] for f in dataclasses.fields(SamplingParams) if "knob" in f.metadata}


def flag_knobs() -> dict[str, Knob]:
    """The knobs dllm-generate takes as flags of their own name."""
    return {name: spec for name, spec in knobs().items() if spec.flag}


def server_knobs() -> dict[str, Knob]:
    """The knobs the server takes in a request's "dllm" object."""
    return {name: spec for name, spec in knobs().items() if spec.server}


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
    return tuple(check_int("stop_token_ids entry", t, _fail, low=0, high=INT32_MAX) for t in ids)
