"""The model families by name: which Flax modules compute a config's family."""

from __future__ import annotations

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.dream import DreamBlock, DreamModel
from dllm_jax.models.llada import LLaDABlock, LLaDAModel
from dllm_jax.models.transformer import Block, Transformer

_FAMILIES = {"llada": (LLaDAModel, LLaDABlock), "dream": (DreamModel, DreamBlock)}


def model_class(config: ModelConfig) -> type[Transformer]:
    """The family's model module class (LLaDAModel, DreamModel)."""
    return _FAMILIES[config.family][0]


def block_class(config: ModelConfig) -> type[Block]:
    """The family's block module class (LLaDABlock, DreamBlock)."""
    return _FAMILIES[config.family][1]
