"""The one declarative table between Hugging Face LLaDA tensor names and dllm_jax parameters.

Hugging Face (PyTorch ``nn.Linear``) stores a projection as [out_features, in_features];
dllm_jax stores ``kernel`` as [in_features, out_features] and stacks the blocks on a leading
[n_layers] axis. Both directions of the conversion read this table and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from dllm_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """How one Hugging Face tensor maps to one parameter leaf.

    hf_name: the tensor's name; ``{layer}`` stands for the block index.
    path: the leaf's path in the params tree.
    hf_shape: the tensor's shape in the Hugging Face file, from the config.
    transpose: the HF tensor is the transpose of the dllm_jax kernel.
    per_layer: one HF tensor per block, stacked along axis 0 of the leaf.
    """

    hf_name: str
    path: tuple[str, ...]
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    transpose: bool = False
    per_layer: bool = False


_PREFIX = "model.transformer."

RULES: tuple[TensorRule, ...] = (
    TensorRule(_PREFIX + "wte.weight", ("wte", "embedding"), lambda c: (c.vocab_size, c.d_model)),
    TensorRule(_PREFIX + "blocks.{layer}.attn_norm.weight", ("layers", "attn_norm", "weight"),
               lambda c: (c.d_model,), per_layer=True),
    TensorRule(_PREFIX + "blocks.{layer}.q_proj.weight", ("layers", "q_proj", "kernel"),
               lambda c: (c.n_heads * c.head_dim, c.d_model), transpose=True, per_layer=True),
    TensorRule(_PREFIX + "blocks.{layer}.k_proj.weight", ("layers", "k_proj", "kernel"),
               lambda c: (c.kv_dim, c.d_model), transpose=True, per_layer=True),
    TensorRule(_PREFIX + "blocks.{layer}.v_proj.weight", ("layers", "v_proj", "kernel"),
               lambda c: (c.kv_dim, c.d_model), transpose=True, per_layer=True),
    TensorRule(_PREFIX + "blocks.{layer}.attn_out.weight", ("layers", "attn_out", "kernel"),
               lambda c: (c.d_model, c.n_heads * c.head_dim), transpose=True, per_layer=True),
    TensorRule(_PREFIX + "blocks.{layer}.ff_norm.weight", ("layers", "ff_norm", "weight"),
               lambda c: (c.d_model,), per_layer=True),
    TensorRule(_PREFIX + "blocks.{layer}.ff_proj.weight", ("layers", "ff_proj", "kernel"),
               lambda c: (c.mlp_hidden_size, c.d_model), transpose=True, per_layer=True),
    TensorRule(_PREFIX + "blocks.{layer}.up_proj.weight", ("layers", "up_proj", "kernel"),
               lambda c: (c.mlp_hidden_size, c.d_model), transpose=True, per_layer=True),
    TensorRule(_PREFIX + "blocks.{layer}.ff_out.weight", ("layers", "ff_out", "kernel"),
               lambda c: (c.d_model, c.mlp_hidden_size), transpose=True, per_layer=True),
    TensorRule(_PREFIX + "ln_f.weight", ("ln_f", "weight"), lambda c: (c.d_model,)),
    TensorRule(_PREFIX + "ff_out.weight", ("lm_head", "kernel"), lambda c: (c.vocab_size, c.d_model),
               transpose=True),
)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One concrete HF tensor: its name, expected shape, target leaf and block index."""

    hf_name: str
    hf_shape: tuple[int, ...]
    rule: TensorRule
    layer: int | None


def rules_for(config: ModelConfig) -> tuple[TensorRule, ...]:
    """The rules that apply to this config (no LM head tensor when weights are tied)."""
    return tuple(r for r in RULES if not (config.weight_tying and r.path[0] == "lm_head"))


def tensor_entries(config: ModelConfig) -> Iterator[TensorEntry]:
    """Every HF tensor a checkpoint of this config holds, block by block as HF shards them."""
    rules = rules_for(config)
    for rule in rules:
        if not rule.per_layer and rule.path[0] == "wte":
            yield TensorEntry(rule.hf_name, rule.hf_shape(config), rule, None)
    for layer in range(config.n_layers):
        for rule in rules:
            if rule.per_layer:
                yield TensorEntry(rule.hf_name.format(layer=layer), rule.hf_shape(config), rule, layer)
    for rule in rules:
        if not rule.per_layer and rule.path[0] != "wte":
            yield TensorEntry(rule.hf_name, rule.hf_shape(config), rule, None)


def leaf_shape(rule: TensorRule, config: ModelConfig) -> tuple[int, ...]:
    """Shape of the dllm_jax leaf a rule fills."""
    shape = rule.hf_shape(config)
    if rule.transpose:
        shape = shape[::-1]
    if rule.per_layer:
        shape = (config.n_layers, *shape)
    return shape
