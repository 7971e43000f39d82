"""The model families' tensor-name tables, and what both conversion directions derive from them.

A table (llada_names.py, dream_names.py, diffusion_gemma_names.py beside this file) lists one
TensorRule per Hugging Face tensor; ``tensor_entries(config)`` expands the family's table for a
config. DiffusionGemma stacks its layers by attention kind, so a per-layer rule there fills
only the layers of its stack, at their index within it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from dllm_jax.models.checkpoint import diffusion_gemma_names, dream_names, llada_names
from dllm_jax.models.checkpoint.tensor_rule import TensorRule
from dllm_jax.models.config import ModelConfig

_TABLES = {"llada": llada_names.RULES, "dream": dream_names.RULES}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One concrete HF tensor: its name, expected shape, target leaf and block index."""

    hf_name: str
    hf_shape: tuple[int, ...]
    rule: TensorRule
    layer: int | None


def family_rules(config: ModelConfig) -> tuple[TensorRule, ...]:
    """The table of the config's family."""
    return _TABLES[config.family]


def rules_for(config: ModelConfig) -> tuple[TensorRule, ...]:
    """The rules that apply to this config (no LM head tensor when weights are tied, no bias
    tensors without qkv_bias)."""
    if config.family == "diffusion_gemma":
        return diffusion_gemma_names.rules_for(config)
    return tuple(
        r
        for r in family_rules(config)
        if not (config.weight_tying and r.path[0] == "lm_head") and not (not config.qkv_bias and r.path[-1] == "bias")
    )


def tensor_entries(config: ModelConfig) -> Iterator[TensorEntry]:
    """Every HF tensor a checkpoint of this config holds, block by block as HF shards them."""
    rules = rules_for(config)
    for rule in rules:
        if not rule.per_layer and rule.path[0] == "wte":
            yield TensorEntry(rule.hf_name, rule.hf_shape(config), rule, None)
    stacked = {rule: dict(_stacked_layers(rule, config)) for rule in rules if rule.per_layer}
    for layer in range(config.n_layers):
        for rule in rules:
            if rule.per_layer and layer in stacked[rule]:
                yield TensorEntry(rule.hf_name.format(layer=layer), rule.hf_shape(config), rule, stacked[rule][layer])
    for rule in rules:
        if not rule.per_layer and rule.path[0] != "wte":
            yield TensorEntry(rule.hf_name, rule.hf_shape(config), rule, None)


def is_skipped(config: ModelConfig, name: str) -> bool:
    """A tensor of a checkpoint of this family that is not read (DiffusionGemma's vision tower)."""
    return config.family == "diffusion_gemma" and diffusion_gemma_names.is_ignored(name)


def leaf_shape(rule: TensorRule, config: ModelConfig) -> tuple[int, ...]:
    """Shape of the dllm_jax leaf a rule fills."""
    shape = rule.hf_shape(config)
    if rule.transpose:
        shape = shape[::-1]
    if rule.per_layer:
        shape = (len(_stacked_layers(rule, config)), *shape)
    return shape


def _stacked_layers(rule: TensorRule, config: ModelConfig) -> list[tuple[int, int]]:
    """(layer index, index in the rule's stacked leaf) of every layer a per-layer rule fills."""
    if config.family == "diffusion_gemma":
        return diffusion_gemma_names.stacked_layers(rule, config)
    return [(layer, layer) for layer in range(config.n_layers)]
