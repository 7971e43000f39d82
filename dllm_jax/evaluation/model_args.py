"""The ``--model_args`` of the ``dllm_jax`` lm-eval model: parsed, type-checked, split.

lm-eval hands the constructor a dict (from ``key=value,...`` or ``simple_evaluate``'s
``model_args``) plus its own ``batch_size``/``device``/``max_batch_size``. Every key is either a
decoding option (a ``DecodeConfig`` field) or an option of the adapter (``AdapterArgs``, which
also holds the values of every request: threshold, gamma, DiffusionGemma's sampler values,
seed); anything else, or a value of the wrong type, is a ``ModelArgsError`` naming the key.
Without ``method`` the model's family picks it once the model is known (decode_config_for).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from dllm_jax.common.validate import check_float
from dllm_jax.models.checkpoint.dtypes import QUANTIZATIONS
from dllm_jax.runtime.decode_config import (
    DEPRECATED_REQUEST_DEFAULTS,
    DecodeConfig,
    DecodeConfigError,
    default_method,
)
from dllm_jax.sampling.generation_defaults import GENERATION_CONFIG_MODES
from dllm_jax.sampling.params import FLOAT32_MAX, SamplingParams, SamplingParamsError

# Per-request generation parameters come from lm-eval's gen_kwargs, not from model_args.
_REQUEST_LEVEL = {
    "temperature": "a generation kwarg (the task's generation_kwargs or --gen_kwargs temperature=...)",
    "cfg": "chosen by the engine (LLaDA's guidance in loglikelihood is the cfg_scale key)",
}
# Passed by lm-eval's CLI to every model; JAX places arrays on its default backend
# (choose it with JAX_PLATFORMS), so these are accepted and not used.
_HARNESS_KEYS = ("device", "max_batch_size")


class ModelArgsError(ValueError):
    """A bad model_args key or value; the one-line message names the key."""


@dataclasses.dataclass(frozen=True)
class AdapterArgs:
    """Options of the lm-eval adapter (everything in model_args that is not a DecodeConfig field).

    Attributes:
      pretrained: a Hugging Face LLaDA, Dream or DiffusionGemma folder or a converted dllm_jax
        checkpoint.
      dtype: weights and activations; None = float32 on CPU, bfloat16 elsewhere.
      quantization: "none", "fp8" or "int8-weights" (load_model's; None = as the folder stores it).
      backend: "auto", "xla" or "pallas" (Engine backend).
      mc_num: Monte-Carlo samples per loglikelihood request (LLaDA's mc_num).
      mc_batch_size: samples per forward pass; None = batch_size (as LLaDA's eval_llada.py).
        mc_num must be a multiple of it.
      cfg_scale: LLaDA's unsupervised classifier-free guidance in loglikelihood, 0 = off.
      is_check_greedy: also report whether greedy one-token-per-step decoding of the
        continuation reproduces it (LLaDA's suffix_greedy_prediction; one forward per token).
      stats_path: write the throughput counters (tokens/s, tokens per step, NFE) to this JSON.
      threshold, gamma: the requests' SamplingParams.threshold and gamma (None: their defaults);
      max_denoising_steps, t_min, t_max, entropy_bound, stability_threshold,
        confidence_threshold: the requests' values of DiffusionGemma's sampler (method
        diffusion_gemma; None: the model's generation_config.json values, else SamplingParams'
        defaults).
      generation_config: "auto" (what neither model_args nor a task's generation kwargs set takes
        the model's generation_config.json values) or "none" (SamplingParams' own defaults).
      seed: request i of a generate_until call that samples takes seed + i (every request of
        method diffusion_gemma, whose sampler always samples); also the Monte-Carlo masks' seed.
    """

    pretrained: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    backend: str = "auto"
    mc_num: int = 128
    mc_batch_size: int | None = None
    cfg_scale: float = 0.0
    is_check_greedy: bool = False
    stats_path: str | None = None
    threshold: float | None = None
    gamma: float | None = None
    max_denoising_steps: int | None = None
    t_min: float | None = None
    t_max: float | None = None
    entropy_bound: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    generation_config: str = "auto"
    seed: int = 0

    def request_defaults(self) -> dict[str, Any]:
        """The SamplingParams values every request takes (those given, and the seed)."""
        given = {name: getattr(self, name) for name in _REQUEST_DEFAULTS if getattr(self, name) is not None}
        return {**given, "seed": self.seed}


# AdapterArgs fields that are SamplingParams values of every request (None: not given)
_REQUEST_DEFAULTS = (
    "threshold",
    "gamma",
    "max_denoising_steps",
    "t_min",
    "t_max",
    "entropy_bound",
    "stability_threshold",
    "confidence_threshold",
)


@dataclasses.dataclass(frozen=True)
class ParsedArgs:
    """adapter: the adapter's options; decode_config: the DecodeConfig of model_args (the model
    completes it: decode_config_for); decode_options: the DecodeConfig fields model_args give."""

    adapter: AdapterArgs
    decode_config: DecodeConfig
    decode_options: dict[str, Any] = dataclasses.field(default_factory=dict)


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether value fits a dataclass annotation (int, float, bool, str, Literal, X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _coerce(annotation: Any, value: Any) -> Any:
    """An int given for a float field (threshold=1) becomes a float."""
    if _accepts(int, value) and not _accepts_exactly_int(annotation):
        return float(value)
    return value


def _accepts_exactly_int(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_accepts_exactly_int(arg) for arg in typing.get_args(annotation))
    return annotation is int


def parse_model_args(args: dict[str, Any], *, harness_batch_size: Any = None) -> ParsedArgs:
    """Splits and checks model_args.

    Args:
      args: the model_args dict (values already typed by lm-eval: bool, int, float, str, None).
      harness_batch_size: lm-eval's own --batch_size (the CLI always passes one, default 1);
        used only when model_args has no batch_size.

    Raises:
      ModelArgsError naming the first bad key.
    """
    adapter_types = _field_types(AdapterArgs)
    decode_types = {k: v for k, v in _field_types(DecodeConfig).items() if k not in DEPRECATED_REQUEST_DEFAULTS}
    adapter, decode = {}, {}
    for key, value in args.items():
        if key in _HARNESS_KEYS:
            continue
        if key in _REQUEST_LEVEL:
            raise ModelArgsError(f"model_args: {key} is {_REQUEST_LEVEL[key]}, not a model_args key")
        if key in adapter_types:
            target, annotation = adapter, adapter_types[key]
        elif key in decode_types:
            target, annotation = decode, decode_types[key]
        else:
            known = sorted(set(adapter_types) | set(decode_types) - set(_REQUEST_LEVEL))
            raise ModelArgsError(f"model_args: unknown key {key!r} (known keys: {', '.join(known)})")
        if not _accepts(annotation, value):
            raise ModelArgsError(
                f"model_args: {key}={value!r} ({type(value).__name__}): expected {_describe(annotation)}"
            )
        target[key] = _coerce(annotation, value)
    if "batch_size" not in decode and harness_batch_size is not None:
        size = harness_batch_size
        if isinstance(size, str) and size.isdigit():
            size = int(size)
        if not _accepts(int, size):
            raise ModelArgsError(f"batch_size={size!r}: dllm_jax needs an integer number of decode slots")
        decode["batch_size"] = size
    if adapter.get("pretrained") is None:
        raise ModelArgsError(
            "model_args: pretrained=PATH is required (a Hugging Face LLaDA, Dream or DiffusionGemma folder or a "
            "converted checkpoint)"
        )
    try:
        decode_config = DecodeConfig(**decode)
    except DecodeConfigError as e:
        raise ModelArgsError(f"model_args: {e}") from None
    parsed = AdapterArgs(**adapter)
    _check_adapter(parsed, decode_config, method_given="method" in decode)
    return ParsedArgs(adapter=parsed, decode_config=decode_config, decode_options=decode)


def decode_config_for(parsed: ParsedArgs, model: Any) -> DecodeConfig:
    """The DecodeConfig model_args ask of `model` (a ModelConfig or DiffusionGemmaConfig): the
    family's method when model_args name none (default_method), completed for the model
    (DecodeConfig.for_model), its requests' values checked against it. Raises ModelArgsError."""
    decode = parsed.decode_config
    try:
        if "method" not in parsed.decode_options:
            decode = DecodeConfig(**parsed.decode_options, method=default_method(model))
        decode = decode.for_model(model)
    except DecodeConfigError as e:
        raise ModelArgsError(f"model_args: pretrained={parsed.adapter.pretrained}: {e}") from None
    _check_request_defaults(parsed.adapter, decode)
    return decode


def _check_adapter(a: AdapterArgs, decode: DecodeConfig, *, method_given: bool) -> None:
    """The adapter's values alone; the requests' values against the method when it is given
    (else the model's family picks it: decode_config_for checks them then)."""
    if a.dtype not in (None, "float32", "bfloat16", "float16"):
        raise ModelArgsError(f"model_args: dtype={a.dtype!r}: expected float32, bfloat16 or float16")
    if a.quantization not in (None, *QUANTIZATIONS):
        raise ModelArgsError(f"model_args: quantization={a.quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if a.backend not in ("auto", "xla", "pallas"):
        raise ModelArgsError(f"model_args: backend={a.backend!r}: expected auto, xla or pallas")
    if a.generation_config not in GENERATION_CONFIG_MODES:
        raise ModelArgsError(
            f"model_args: generation_config={a.generation_config!r}: expected one of {', '.join(GENERATION_CONFIG_MODES)}"
        )
    if a.mc_num < 1:
        raise ModelArgsError(f"model_args: mc_num={a.mc_num}: expected >= 1")
    mc_batch = a.mc_batch_size if a.mc_batch_size is not None else decode.batch_size
    if mc_batch < 1 or a.mc_num % mc_batch:
        raise ModelArgsError(
            f"model_args: mc_num={a.mc_num} is not a multiple of mc_batch_size={mc_batch} "
            "(LLaDA draws mc_num masks in batches of mc_batch_size; default: batch_size)"
        )
    # a float32 on the device: the range of the type it is stored in, as the requests' knobs
    check_float("model_args: cfg_scale", a.cfg_scale, ModelArgsError, low=0.0, high=FLOAT32_MAX)
    try:
        SamplingParams(**a.request_defaults())
    except SamplingParamsError as e:
        raise ModelArgsError(f"model_args: {e}") from None
    if method_given:
        _check_request_defaults(a, decode)


def _check_request_defaults(a: AdapterArgs, decode: DecodeConfig) -> None:
    problem = SamplingParams(**a.request_defaults()).not_applying(decode, cfg=False)
    if problem is not None:
        raise ModelArgsError(f"model_args: {problem}")
