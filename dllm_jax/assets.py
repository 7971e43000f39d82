"""Files shipped inside the package."""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent / "assets"


def tiny_model_path() -> Path:
    """Folder of the embedded tiny LLaDA (Hugging Face LLaDA format: config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json); see its README.md."""
    path = _ASSETS / "tiny-llada"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: the embedded tiny model is missing (broken install?)")
    return path
