"""Load a model for inference: a converted dllm_jax folder, a Hugging Face folder, or a Hub id.

``load_model`` is three cheap steps and one expensive one, also callable one by one so that a
command line can check its input before the weights load: ``resolve_model_path`` (a name to a
local folder), ``read_model_config`` (config.json or the converted metadata only),
``load_tokenizer``, then the params.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dllm_jax.common.deprecation import warn_renamed
from dllm_jax.models.checkpoint.converted import load_converted, move_to_jax
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.generation_config import GENERATION_CONFIG_FILE, read_generation_config
from dllm_jax.models.checkpoint.hf_config import CONFIG_FILE
from dllm_jax.models.checkpoint.hf_reader import read_checkpoint
from dllm_jax.models.checkpoint.metadata import is_converted
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.model_source import ModelNotFoundError, load_tokenizer, not_a_model, resolve_model_path
from dllm_jax.models.model_source import read_model_config as read_config_without_jax
from dllm_jax.models.quantization import QUANTIZATIONS, quantize_params
from dllm_jax.models.transformer import Weights
from dllm_jax.text.tokenizer import Tokenizer

# resolve_model_path, load_tokenizer and ModelNotFoundError live in model_source (no JAX); public here too
__all__ = [
    "LoadedModel",
    "ModelNotFoundError",
    "default_dtype",
    "load_model",
    "load_tokenizer",
    "read_model_config",
    "resolve_model_path",
]


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run.

    config: the architecture; ``config.dtype`` is the dtype of ``weights``.
    weights: the weights tree of jax arrays (layout: dllm_jax.models.transformer; `params` is
      its deprecated name).
    tokenizer: the folder's tokenizer, or None when it holds no tokenizer files.
    path: the local folder it came from (for a Hub id, its snapshot in the cache).
    generation_config: its generation_config.json, parsed (the sampling values the model was
      published with; dllm_jax.sampling.generation_defaults maps them onto SamplingParams), or
      None when it has none.
    """

    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer | None
    path: Path
    generation_config: dict[str, Any] | None = None

    @property
    def generation_config_file(self) -> Path:
        """Where generation_config comes from (the file may not exist)."""
        return self.path / GENERATION_CONFIG_FILE

    @property
    def params(self) -> Weights:
        """Deprecated name of `weights`."""
        warn_renamed("LoadedModel.params", "LoadedModel.weights")
        return self.weights


def default_dtype() -> str:
    """The weights' dtype used when none is given: float32 on the CPU, bfloat16 on accelerators.

    The CPU has no fast bfloat16 matmuls (bfloat16 is slower there, and less exact); GPUs and
    TPUs are built for it and the weights take half the memory.
    """
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def read_model_config(path: str | Path, *, dtype: str | None = None) -> ModelConfig:
    """dllm_jax.models.model_source.read_model_config with ``dtype`` defaulting to default_dtype()."""
    return read_config_without_jax(path, dtype=dtype or default_dtype())


def load_model(name: str | Path, *, dtype: str | None = None, quantization: str | None = None) -> LoadedModel:
    """Loads a converted folder (has dllm_jax_metadata.json), a Hugging Face LLaDA, Dream or
    DiffusionGemma folder, or a Hub id from the Hugging Face cache (``resolve_model_path``; a local folder wins).

    A Hugging Face folder is converted in memory by the same streaming reader as
    ``python -m convert.hf_to_jax``; nothing is written. Weights are cast to ``dtype``
    (None: ``default_dtype()``). quantization: "none", "fp8" or "int8-weights"
    (dllm_jax.models.quantization); None = as the folder stores it (a Hugging Face folder: "none").

    Raises:
      ModelNotFoundError for a name that is neither a folder nor a cached (or downloadable) Hub id;
      ConversionError for a folder that is neither kind, or whose files are missing or malformed
      (a generation_config.json that is not a JSON object too);
      TokenizerError for tokenizer files that cannot be loaded.
    """
    path = resolve_model_path(name)
    dtype = dtype or default_dtype()
    if not is_converted(path) and not (path / CONFIG_FILE).is_file():
        raise not_a_model(path)
    generation_config = read_generation_config(path)  # a bad file fails before the weights load
    if is_converted(path):
        config, params = load_converted(path, dtype=dtype, quantization=quantization)
    else:
        quantization = quantization or "none"
        if quantization not in QUANTIZATIONS:
            raise ConversionError(f"quantization={quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
        info, host_params = read_checkpoint(path, dtype=dtype)
        config = dataclasses.replace(info.config, quantization=quantization)
        params = move_to_jax(quantize_params(host_params, quantization))
    return LoadedModel(
        config=config,
        weights=params,
        tokenizer=load_tokenizer(path),
        path=path,
        generation_config=generation_config,
    )
