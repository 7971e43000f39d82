"""The declarative table between Hugging Face DiffusionGemma tensor names and dllm_jax parameters.

transformers' DiffusionGemmaForBlockDiffusion ties the encoder's text stack to the decoder's,
so a checkpoint saved by it stores the shared weights once, under ``model.decoder.``; the
encoder keeps only its own layer scalars (``model.encoder.language_model.layers.N.layer_scalar``,
a buffer it does not tie), and the LM head is the decoder's embedding. The vision tower and its
projector (``model.encoder.vision_tower.``, ``model.encoder.embed_vision.``) are not ours: the
reader skips them and says so.

Per-layer tensors fill the stack of their layer's attention kind (``sliding_layers`` or
``full_layers``, see dllm_jax.models.diffusion_gemma) at the layer's index within that kind; a
full-attention layer has no v_proj. Projections are [out, in] in the file and [in, out]
(``kernel``) here; the experts keep the file's [E, out, in] layout.
"""

from __future__ import annotations

from dllm_jax.models.checkpoint.tensor_rule import TensorRule
from dllm_jax.models.diffusion_gemma import STACKS
from dllm_jax.models.diffusion_gemma_config import AttentionKind, DiffusionGemmaConfig

_DECODER = "model.decoder."
_LAYER = _DECODER + "layers.{layer}."
_ENCODER_LAYER = "model.encoder.language_model.layers.{layer}."

# Tensors of a DiffusionGemma checkpoint that dllm_jax does not read (the vision part).
IGNORED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")

_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2",
    "post_feedforward_layernorm",
)


def _layer_rules(kind: AttentionKind) -> tuple[TensorRule, ...]:
    stack = STACKS[kind]

    def rule(hf: str, path: tuple[str, ...], shape, transpose: bool = False, prefix: str = _LAYER) -> TensorRule:
        return TensorRule(prefix + hf, (stack, *path), shape, transpose=transpose, per_layer=True)

    def heads(c: DiffusionGemmaConfig) -> int:
        return c.n_heads * c.head_dim(kind)

    def kv(c: DiffusionGemmaConfig) -> int:
        return c.kv_heads(kind) * c.head_dim(kind)

    rules = [rule(f"{norm}.weight", (norm, "weight"), lambda c: (c.d_model,)) for norm in _LAYER_NORMS]
    rules += [
        rule("self_attn.q_proj.weight", ("q_proj", "kernel"), lambda c: (heads(c), c.d_model), transpose=True),
        rule("self_attn.k_proj.weight", ("k_proj", "kernel"), lambda c: (kv(c), c.d_model), transpose=True),
        rule("self_attn.o_proj.weight", ("o_proj", "kernel"), lambda c: (c.d_model, heads(c)), transpose=True),
        rule("self_attn.q_norm.weight", ("q_norm", "weight"), lambda c: (c.head_dim(kind),)),
        rule("self_attn.k_norm.weight", ("k_norm", "weight"), lambda c: (c.head_dim(kind),)),
        rule(
            "mlp.gate_proj.weight",
            ("mlp", "gate_proj", "kernel"),
            lambda c: (c.mlp_hidden_size, c.d_model),
            transpose=True,
        ),
        rule(
            "mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), lambda c: (c.mlp_hidden_size, c.d_model), transpose=True
        ),
        rule(
            "mlp.down_proj.weight",
            ("mlp", "down_proj", "kernel"),
            lambda c: (c.d_model, c.mlp_hidden_size),
            transpose=True,
        ),
        rule("router.proj.weight", ("router", "proj", "kernel"), lambda c: (c.n_experts, c.d_model), transpose=True),
        rule("router.scale", ("router", "scale"), lambda c: (c.d_model,)),
        rule("router.per_expert_scale", ("router", "per_expert_scale"), lambda c: (c.n_experts,)),
        rule(
            "experts.gate_up_proj",
            ("experts", "gate_up_proj"),
            lambda c: (c.n_experts, 2 * c.expert_hidden_size, c.d_model),
        ),
        rule("experts.down_proj", ("experts", "down_proj"), lambda c: (c.n_experts, c.d_model, c.expert_hidden_size)),
        rule("layer_scalar", ("layer_scalar",), lambda c: (1,)),
        rule("layer_scalar", ("encoder_layer_scalar",), lambda c: (1,), prefix=_ENCODER_LAYER),
    ]
    if kind is AttentionKind.SLIDING:
        rules.append(
            rule("self_attn.v_proj.weight", ("v_proj", "kernel"), lambda c: (kv(c), c.d_model), transpose=True)
        )
    return tuple(rules)


def _self_conditioning_rules() -> tuple[TensorRule, ...]:
    prefix, path = _DECODER + "self_conditioning.", "self_conditioning"
    return (
        TensorRule(prefix + "pre_norm.weight", (path, "pre_norm", "weight"), lambda c: (c.d_model,)),
        TensorRule(
            prefix + "gate_proj.weight",
            (path, "gate_proj", "kernel"),
            lambda c: (c.mlp_hidden_size, c.d_model),
            transpose=True,
        ),
        TensorRule(
            prefix + "up_proj.weight",
            (path, "up_proj", "kernel"),
            lambda c: (c.mlp_hidden_size, c.d_model),
            transpose=True,
        ),
        TensorRule(
            prefix + "down_proj.weight",
            (path, "down_proj", "kernel"),
            lambda c: (c.d_model, c.mlp_hidden_size),
            transpose=True,
        ),
    )


RULES: tuple[TensorRule, ...] = (
    TensorRule(_DECODER + "embed_tokens.weight", ("embed_tokens", "embedding"), lambda c: (c.vocab_size, c.d_model)),
    *_layer_rules(AttentionKind.SLIDING),
    *_layer_rules(AttentionKind.FULL),
    TensorRule(_DECODER + "norm.weight", ("norm", "weight"), lambda c: (c.d_model,)),
    *_self_conditioning_rules(),
)

_KIND_OF_STACK = {stack: kind for kind, stack in STACKS.items()}


def rules_for(config: DiffusionGemmaConfig) -> tuple[TensorRule, ...]:
    """The rules of this config: no stack for a kind without layers."""
    return tuple(r for r in RULES if not r.per_layer or config.layers_of(_KIND_OF_STACK[r.path[0]]))


def stacked_layers(rule: TensorRule, config: DiffusionGemmaConfig) -> list[tuple[int, int]]:
    """(layer index, index in the rule's stack) of every layer a per-layer rule fills."""
    kind = _KIND_OF_STACK[rule.path[0]]
    return [(layer, config.stack_index(layer)) for layer in range(config.n_layers) if config.layer_types[layer] is kind]


def is_ignored(name: str) -> bool:
    """A tensor of the checkpoint that dllm_jax skips (the vision tower and its projector)."""
    return name.startswith(IGNORED_PREFIXES)
