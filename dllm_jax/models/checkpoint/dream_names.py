"""The declarative table between Hugging Face Dream (Qwen2 layout) tensor names and dllm_jax
parameters.

Dream's checkpoints use Qwen2's names: ``model.embed_tokens``, per block
``self_attn.{q,k,v,o}_proj`` (q/k/v with biases), ``mlp.{gate,up,down}_proj``,
``input_layernorm`` and ``post_attention_layernorm``, then ``model.norm`` and ``lm_head``.
Projections are [out_features, in_features] in the file (transposed into ``kernel``); biases
are stored as they are. Both directions of the conversion read this table (through
tensor_names.py) and nothing else.
"""

from __future__ import annotations

from dllm_jax.models.checkpoint.tensor_rule import TensorRule

_LAYER = "model.layers.{layer}."

RULES: tuple[TensorRule, ...] = (
    TensorRule("model.embed_tokens.weight", ("wte", "embedding"), lambda c: (c.vocab_size, c.d_model)),
    TensorRule(
        _LAYER + "input_layernorm.weight", ("layers", "attn_norm", "weight"), lambda c: (c.d_model,), per_layer=True
    ),
    TensorRule(
        _LAYER + "self_attn.q_proj.weight",
        ("layers", "q_proj", "kernel"),
        lambda c: (c.n_heads * c.head_dim, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _LAYER + "self_attn.q_proj.bias",
        ("layers", "q_proj", "bias"),
        lambda c: (c.n_heads * c.head_dim,),
        per_layer=True,
    ),
    TensorRule(
        _LAYER + "self_attn.k_proj.weight",
        ("layers", "k_proj", "kernel"),
        lambda c: (c.kv_dim, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(_LAYER + "self_attn.k_proj.bias", ("layers", "k_proj", "bias"), lambda c: (c.kv_dim,), per_layer=True),
    TensorRule(
        _LAYER + "self_attn.v_proj.weight",
        ("layers", "v_proj", "kernel"),
        lambda c: (c.kv_dim, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(_LAYER + "self_attn.v_proj.bias", ("layers", "v_proj", "bias"), lambda c: (c.kv_dim,), per_layer=True),
    TensorRule(
        _LAYER + "self_attn.o_proj.weight",
        ("layers", "attn_out", "kernel"),
        lambda c: (c.d_model, c.n_heads * c.head_dim),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _LAYER + "post_attention_layernorm.weight",
        ("layers", "ff_norm", "weight"),
        lambda c: (c.d_model,),
        per_layer=True,
    ),
    TensorRule(
        _LAYER + "mlp.gate_proj.weight",
        ("layers", "ff_proj", "kernel"),
        lambda c: (c.mlp_hidden_size, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _LAYER + "mlp.up_proj.weight",
        ("layers", "up_proj", "kernel"),
        lambda c: (c.mlp_hidden_size, c.d_model),
        transpose=True,
        per_layer=True,
    ),
    TensorRule(
        _LAYER + "mlp.down_proj.weight",
        ("layers", "ff_out", "kernel"),
        lambda c: (c.d_model, c.mlp_hidden_size),
        transpose=True,
        per_layer=True,
    ),
    TensorRule("model.norm.weight", ("ln_f", "weight"), lambda c: (c.d_model,)),
    TensorRule("lm_head.weight", ("lm_head", "kernel"), lambda c: (c.vocab_size, c.d_model), transpose=True),
)
