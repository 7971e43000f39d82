"""Files shipped inside the package."""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"

# The embedded tiny models (Hugging Face folders: config.json, model.safetensors,
# tokenizer.json, tokenizer_config.json; each has a README.md saying how it was trained).
EMBEDDED_MODELS: tuple[str, ...] = ("tiny-llada", "tiny-dream", "tiny-diffusiongemma")


def tiny_model_path(name: str = "tiny-llada") -> Path:
    """Folder of an embedded tiny model: "tiny-llada" (LLaDA architecture), "tiny-dream"
    (Dream architecture, HF Dream layout) or "tiny-diffusiongemma" (DiffusionGemma's block
    diffusion, transformers' layout)."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"{name!r}: not an embedded model (expected one of {EMBEDDED_MODELS})")
    path = _ASSETS / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: the embedded {name} is missing (broken install, or not trained yet: scripts/train_tiny.py)"
        )
    return path


def model_folder(name: str | Path) -> Path:
    """``name`` as a path, or the embedded model's folder when ``name`` is one of
    EMBEDDED_MODELS and no local folder of that name exists (a local folder wins)."""
    if not Path(name).exists() and str(name) in EMBEDDED_MODELS:
        return tiny_model_path(str(name))
    return Path(name)
