"""A model's defaults of the per-request values: its generation_config.json mapped onto SamplingParams.

transformers and vLLM take the sampling values a model was published with from its
generation_config.json (transformers' ``model.generation_config``; vLLM's ``--generation-config
auto``): a request's unset values take them, a value the request sets wins. Here the keys that
supply a SamplingParams field are declared with the field (``knob(generation_config=...)``);
every other key of the file has no per-request meaning in dllm_jax and is ignored (named in a
debug log): the token ids (the model's config.json and tokenizer say which ids end an answer),
transformers' switches (``do_sample``: a temperature above 0 samples, as in vLLM), and the
compiled choices of Dream's own sampler (``steps``, ``alg``, ``eps``: DecodeConfig fields, which
Dream's file holds at its generation class's defaults). A null value is no default.

The defaults are applied where a request's values are resolved against its loop
(dllm_jax.engine.request.slot_values): a default that does not apply to the loop's method (a
temperature for DiffusionGemma's own sampler) is not taken there.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dllm_jax.common.errors import SamplingParamsError
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.generation_config import GENERATION_CONFIG_FILE, read_generation_config
from dllm_jax.sampling.params import annealing_problem, knobs

log = logging.getLogger(__name__)

# --generation-config (dllm-generate, dllm-serve) and the library's generation_config=: the
# model's file, or none (every unset value takes SamplingParams' own default)
GENERATION_CONFIG_MODES: tuple[str, ...] = ("auto", "none")
# The --generation-config help of every command line, so they say the same.
GENERATION_CONFIG_HELP = (
    "auto: the per-request values left unset (temperature, top_p, top_k, min_p, DiffusionGemma's sampler values, "
    "the answer's most tokens) take the model's generation_config.json values, as in transformers and vLLM; "
    "none: SamplingParams' own defaults. Default: auto"
)
# What transformers writes besides the settings themselves.
_BOOKKEEPING = ("transformers_version", "_from_model_config", "_commit_hash")
# transformers' DiffusionGemma sampler whose entropy_bound dllm_jax's canvas loop runs.
_ENTROPY_BOUND_SAMPLER = "EntropyBoundSamplerConfig"


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """The values a model's generation_config.json gives the SamplingParams fields a request
    leaves unset.

    values: field name -> value, each checked as the field checks it (e.g. {"max_new_tokens": 64,
      "t_min": 0.1}); empty: no defaults (SamplingParams' own).
    source: the file they came from (None: none read).
    ignored: the file's keys that set no field, in the file's order.
    """

    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str | None = None
    ignored: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "values", types.MappingProxyType(dict(self.values)))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | None, *, source: str | Path) -> GenerationDefaults:
        """The defaults of a parsed generation_config.json (None: a folder without one: no
        defaults); `source` names the file in errors.

        Raises:
          ConversionError naming the file and key: a value of the wrong type or out of the
          field's range, or t_max not above t_min.
        """
        if hf is None:
            return cls()
        source = str(source)
        values: dict[str, Any] = {}
        used: set[str] = set()
        for name, spec in knobs().items():
            if spec.generation_config is None:
                continue
            value = _lookup(hf, spec.generation_config, source)
            used.add(spec.generation_config.split(".")[0])
            if value is None:
                continue
            try:
                values[name] = spec.check(name, value)
            except SamplingParamsError as e:
                problem = str(e).removeprefix("SamplingParams: ")  # names the field, and so a plain key
                key = "" if spec.generation_config == name else f"{spec.generation_config}: "
                raise ConversionError(f"{source}: {key}{problem}") from None
        if "t_min" in values and "t_max" in values and (problem := annealing_problem(values["t_min"], values["t_max"])):
            raise ConversionError(f"{source}: {problem}")
        ignored = tuple(key for key in hf if key not in used and key not in _BOOKKEEPING)
        if ignored:
            log.debug("%s: not used (no per-request value of dllm_jax): %s", source, ", ".join(ignored))
        return cls(values, source, ignored)

    @classmethod
    def of_folder(cls, folder: str | Path, mode: str = "auto") -> GenerationDefaults:
        """The defaults of a model folder's generation_config.json (mode "auto"; none when the
        folder has no such file), or none at all (mode "none").

        Raises:
          ConversionError naming the file and key (from_hf), or ValueError for another mode.
        """
        if mode not in GENERATION_CONFIG_MODES:
            raise ValueError(f"generation_config={mode!r}: expected one of {', '.join(GENERATION_CONFIG_MODES)}")
        hf = read_generation_config(folder) if mode == "auto" else None
        return cls.from_hf(hf, source=Path(folder) / GENERATION_CONFIG_FILE)

    def value(self, name: str, decode: Any, cfg: bool) -> Any:
        """The model's default of field `name` for a loop compiled for `decode` (a DecodeConfig;
        cfg: with the guidance pass), or None: the model sets none, or one that does not apply
        to the loop (SamplingParams.not_applying would refuse it from a request)."""
        value = self.values.get(name)
        applies = knobs()[name].applies
        if value is None or applies is None or applies[0](decode, cfg):
            return value
        return None

    def canvas_bucket(self, canvas_length: int, limit: int) -> int:
        """The generation bucket a DiffusionGemma front end picks when it is given none: the
        whole canvases that hold the model's max_new_tokens (one canvas without it), as many as
        fit in `limit` positions (at least one). A canvas decodes only while the answer has not
        ended, so room for more costs a short answer nothing."""
        wanted = -(-self.values.get("max_new_tokens", canvas_length) // canvas_length)
        return max(1, min(wanted, limit // canvas_length)) * canvas_length

    def describe(self) -> str:
        """One line for a log: where they come from and the values (e.g. "tiny/generation_config.json:
        max_new_tokens=64, t_min=0.1"), or that there are none."""
        if not self.values:
            return f"{self.source}: no sampling defaults" if self.source else "no model defaults"
        return f"{self.source}: " + ", ".join(f"{name}={value!r}" for name, value in self.values.items())


def _lookup(hf: Mapping[str, Any], key: str, source: str) -> Any:
    """The value of a (dotted) key, None when absent. An enclosing object must be one; the
    sampler_config of another sampler than the entropy bound has no value here."""
    outer, _, inner = key.partition(".")
    value = hf.get(outer)
    if not inner or value is None:
        return value
    if not isinstance(value, dict):
        raise ConversionError(f"{source}: {outer}={value!r} ({type(value).__name__}): expected an object")
    sampler = value.get("_cls_name", _ENTROPY_BOUND_SAMPLER)
    if outer == "sampler_config" and sampler != _ENTROPY_BOUND_SAMPLER:
        log.warning("%s: sampler_config of %r: dllm_jax runs the entropy-bound sampler; not used", source, sampler)
        return None
    return value.get(inner)
