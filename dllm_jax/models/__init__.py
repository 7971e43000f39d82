"""Model families: shared building blocks (layers.py, transformer.py) and one file per family.

``model_class(config)`` / ``block_class(config)`` pick the family's Flax modules; the
functions below take any family's config.
"""

from __future__ import annotations

from dllm_jax.config import ModelConfig
from dllm_jax.models.dream import DreamBlock, DreamModel
from dllm_jax.models.llada import LLaDABlock, LLaDAModel
from dllm_jax.models.transformer import (
    Block,
    Params,
    Transformer,
    abstract_params,
    count_params,
    forward,
    init_params,
    init_params_per_layer,
    predictions,
    unstack_layers,
)

_FAMILIES = {"llada": (LLaDAModel, LLaDABlock), "dream": (DreamModel, DreamBlock)}


def model_class(config: ModelConfig) -> type[Transformer]:
    """The family's model module class (LLaDAModel, DreamModel)."""
    return _FAMILIES[config.family][0]


def block_class(config: ModelConfig) -> type[Block]:
    """The family's block module class (LLaDABlock, DreamBlock)."""
    return _FAMILIES[config.family][1]


__all__ = [
    "Block",
    "DreamBlock",
    "DreamModel",
    "LLaDABlock",
    "LLaDAModel",
    "Params",
    "Transformer",
    "abstract_params",
    "block_class",
    "count_params",
    "forward",
    "init_params",
    "init_params_per_layer",
    "model_class",
    "predictions",
    "unstack_layers",
]
