"""The metadata file of a converted dllm_jax checkpoint folder (read without importing JAX or
orbax: a command line checks its input with it first)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dllm_jax.models.checkpoint.dtypes import DTYPES, QUANTIZATIONS
from dllm_jax.models.checkpoint.errors import ConversionError

METADATA_FILE = "dllm_jax_metadata.json"
FORMAT_VERSION = 1


def is_converted(path: Path) -> bool:
    """True when ``path`` is a converted dllm_jax checkpoint folder."""
    return (path / METADATA_FILE).is_file()


def read_metadata(folder: Path) -> dict[str, Any]:
    """The parsed metadata file of a converted folder, checked for the fields loading needs."""
    path = folder / METADATA_FILE
    try:
        metadata = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: cannot read the metadata ({e})") from None
    if not isinstance(metadata, dict) or metadata.get("format_version") != FORMAT_VERSION:
        version = metadata.get("format_version") if isinstance(metadata, dict) else None
        raise ConversionError(
            f"{path}: format_version={version!r}, this dllm_jax reads format_version={FORMAT_VERSION}"
        )
    if not isinstance(metadata.get("hf_config"), dict):
        raise ConversionError(f"{path}: missing the 'hf_config' object")
    if metadata.get("dtype") not in DTYPES:
        raise ConversionError(f"{path}: dtype={metadata.get('dtype')!r}, expected one of {', '.join(DTYPES)}")
    if metadata.setdefault("quantization", "none") not in QUANTIZATIONS:
        raise ConversionError(
            f"{path}: quantization={metadata['quantization']!r}, expected one of {', '.join(QUANTIZATIONS)}"
        )
    return metadata
