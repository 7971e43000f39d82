"""Load a model for inference from a converted dllm_jax folder or straight from a Hugging Face folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dllm_jax.checkpoint.converted import METADATA_FILE, is_converted, load_converted, move_to_jax
from dllm_jax.checkpoint.errors import ConversionError
from dllm_jax.checkpoint.hf_reader import CONFIG_FILE, read_checkpoint
from dllm_jax.config import ModelConfig
from dllm_jax.model import Params
from dllm_jax.quantization import QUANTIZATIONS, quantize_params
from dllm_jax.tokenizer import Tokenizer, has_tokenizer_files


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run.

    config: the architecture; ``config.dtype`` is the dtype of ``params``.
    params: the params tree of jax arrays (layout: dllm_jax.model).
    tokenizer: the folder's tokenizer, or None when it holds no tokenizer files.
    path: the folder it came from.
    """

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    path: Path


def load_model(path: str | Path, *, dtype: str = "bfloat16", quantization: str | None = None) -> LoadedModel:
    """Loads a converted folder (has dllm_jax_metadata.json) or a Hugging Face LLaDA folder.

    A Hugging Face folder is converted in memory by the same streaming reader as
    ``python -m convert.hf_to_jax``; nothing is written. Params are cast to ``dtype``.
    quantization: "none", "fp8" or "int8-weights" (dllm_jax.quantization); None = as the folder
    stores it (a Hugging Face folder: "none").

    Raises:
      ConversionError for a folder that is neither kind, or whose files are missing or malformed;
      TokenizerError for tokenizer files that cannot be loaded.
    """
    path = Path(path)
    if is_converted(path):
        config, params = load_converted(path, dtype=dtype, quantization=quantization)
    elif (path / CONFIG_FILE).is_file():
        quantization = quantization or "none"
        if quantization not in QUANTIZATIONS:
            raise ConversionError(f"quantization={quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
        info, host_params = read_checkpoint(path, dtype=dtype)
        config = dataclasses.replace(info.config, quantization=quantization)
        params = move_to_jax(quantize_params(host_params, quantization))
    else:
        raise ConversionError(
            f"{path}: neither a converted dllm_jax checkpoint (no {METADATA_FILE}) "
            f"nor a Hugging Face LLaDA folder (no {CONFIG_FILE})"
        )
    tokenizer = Tokenizer.from_dir(path) if has_tokenizer_files(path) else None
    return LoadedModel(config=config, params=params, tokenizer=tokenizer, path=path)
