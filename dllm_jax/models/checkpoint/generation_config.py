"""A model folder's generation_config.json (transformers' GenerationConfig, as save_pretrained
writes it): the sampling values the model was published with. A Hugging Face folder and a
converted one (dllm-convert copies it) hold it under the same name; what it means for a
request is dllm_jax.sampling.generation_defaults'. Read without importing JAX."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dllm_jax.common.json_file import read_json
from dllm_jax.models.checkpoint.errors import ConversionError

GENERATION_CONFIG_FILE = "generation_config.json"
# A generation config is a few hundred bytes; anything near this is not one.
_MAX_BYTES = 2**20


def read_generation_config(folder: str | Path) -> dict[str, Any] | None:
    """The parsed generation_config.json of a model folder, or None when it has none.

    Raises:
      ConversionError naming the file: unreadable, not JSON, or not a JSON object.
    """
    path = Path(folder) / GENERATION_CONFIG_FILE
    if not path.exists():
        return None
    hf = read_json(path, max_bytes=_MAX_BYTES, error=ConversionError)
    if not isinstance(hf, dict):
        raise ConversionError(f"{path}: expected a JSON object of generation settings, got {type(hf).__name__}")
    return hf
