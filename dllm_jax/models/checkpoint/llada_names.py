"""The declarative table between Hugging Face LLaDA tensor names and dllm_jax parameters.

Hugging Face (PyTorch ``nn.Linear``) stores a projection as [out_features, in_features];
dllm_jax stores ``kernel`` as [in_features, out_features] and stacks the blocks on a leading
[n_layers] axis. Both directions of the conversion read this table (through
tensor_names.py) and nothing else.
"""

from __future__ import annotations

from dllm_jax.models.checkpoint.tensor_rule import TensorRule

_PREFIX = "model.transformer."

RULES: tuple[TensorRule, ...] = (
    TensorRule(_PREFIX + "wte.weight", ("wte", "embedding"), lambda c: (c.vocab_size, c.d_model)),
    TensorRule(
        _PREFIX + "blocks.{layer}.attn_norm.weight",
        ("layers", "attn_norm", "weight"),
        lambda c: (c.d_model,),
        per_layer=True,
    ),
    TensorRule(
        _PREFIX + "blocks.{layer}.q_proj.weight",
        ("layers", "q_proj", "kernel"),
        lambda c: (c.n_heads * c.head_dim, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _PREFIX + "blocks.{layer}.k_proj.weight",
        ("layers", "k_proj", "kernel"),
        lambda c: (c.kv_dim, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _PREFIX + "blocks.{layer}.v_proj.weight",
        ("layers", "v_proj", "kernel"),
        lambda c: (c.kv_dim, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _PREFIX + "blocks.{layer}.attn_out.weight",
        ("layers", "attn_out", "kernel"),
        lambda c: (c.d_model, c.n_heads * c.head_dim),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _PREFIX + "blocks.{layer}.ff_norm.weight",
        ("layers", "ff_norm", "weight"),
        lambda c: (c.d_model,),
        per_layer=True,
    ),
    TensorRule(
        _PREFIX + "blocks.{layer}.ff_proj.weight",
        ("layers", "ff_proj", "kernel"),
        lambda c: (c.mlp_hidden_size, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _PREFIX + "blocks.{layer}.up_proj.weight",
        ("layers", "up_proj", "kernel"),
        lambda c: (c.mlp_hidden_size, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _PREFIX + "blocks.{layer}.ff_out.weight",
        ("layers", "ff_out", "kernel"),
        lambda c: (c.d_model, c.mlp_hidden_size),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(_PREFIX + "ln_f.weight", ("ln_f", "weight"), lambda c: (c.d_model,)),
    TensorRule(_PREFIX + "ff_out.weight", ("lm_head", "kernel"), lambda c: (c.vocab_size, c.d_model), transpose=True),
)
