"""A Hugging Face folder's config.json as the family's config, without reading any weights
(and without importing JAX: a command line checks its input with it first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.config import ConfigError, ModelConfig, read_config_json
from dllm_jax.models.diffusion_gemma_config import MODEL_TYPE as DIFFUSION_GEMMA
from dllm_jax.models.diffusion_gemma_config import DiffusionGemmaConfig

CONFIG_FILE = "config.json"


def config_from_hf(hf: Any, *, dtype: str, source: str) -> ModelConfig:
    """The family's config of a config.json dict (a DiffusionGemmaConfig for model_type
    "diffusion_gemma", else a ModelConfig), with ``dtype``; ``source`` names the file in errors.

    Raises:
      ConfigError naming ``source`` and the key.
    """
    diffusion_gemma = isinstance(hf, dict) and hf.get("model_type") == DIFFUSION_GEMMA
    family = DiffusionGemmaConfig if diffusion_gemma else ModelConfig
    return family.from_hf_config(hf, dtype=dtype, source=source)


def read_config(hf_dir: Path, *, dtype: str) -> tuple[ModelConfig, dict[str, Any]]:
    """The family's config (config_from_hf) and the raw dict of ``hf_dir/config.json``."""
    path = hf_dir / CONFIG_FILE
    try:
        hf = read_config_json(path)
        config = config_from_hf(hf, dtype=dtype, source=str(path))
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    return config, hf
