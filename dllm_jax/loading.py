"""Load a model for inference from a converted dllm_jax folder or straight from a Hugging Face folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dllm_jax.config import ModelConfig
from dllm_jax.models import Params
from dllm_jax.tokenizer import Tokenizer, has_tokenizer_files


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run.

    config: the architecture; ``config.dtype`` is the dtype of ``params``.
    params: the params tree of jax arrays (layout: dllm_jax.models).
    tokenizer: the folder's tokenizer, or None when it holds no tokenizer files.
    path: the folder it came from.
    """

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    path: Path


def load_model(path: str | Path, *, dtype: str = "bfloat16") -> LoadedModel:
    """Loads a converted folder (has dllm_jax_metadata.json) or a Hugging Face LLaDA or Dream folder.

    A Hugging Face folder is converted in memory by the same streaming reader as
    ``python -m convert.hf_to_jax``; nothing is written. Params are cast to ``dtype``.

    Raises:
      ConversionError for a folder that is neither kind, or whose files are missing or malformed;
      TokenizerError for tokenizer files that cannot be loaded.
    """
    # convert/ imports dllm_jax modules: importing it here keeps `import dllm_jax` acyclic
    from convert.checkpoint import METADATA_FILE, is_converted, load_converted, move_to_jax
    from convert.errors import ConversionError
    from convert.hf_reader import CONFIG_FILE, read_checkpoint

    path = Path(path)
    if is_converted(path):
        config, params = load_converted(path, dtype=dtype)
    elif (path / CONFIG_FILE).is_file():
        info, host_params = read_checkpoint(path, dtype=dtype)
        config, params = info.config, move_to_jax(host_params)
    else:
        raise ConversionError(
            f"{path}: neither a converted dllm_jax checkpoint (no {METADATA_FILE}) "
            f"nor a Hugging Face LLaDA or Dream folder (no {CONFIG_FILE})"
        )
    tokenizer = Tokenizer.from_dir(path) if has_tokenizer_files(path) else None
    return LoadedModel(config=config, params=params, tokenizer=tokenizer, path=path)
