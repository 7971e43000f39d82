"""A small DiffusionGemma config with every feature of the family, for tests that build the
network from random weights (no checkpoint): a sliding and a full layer (the full one with wider
heads, one kv head and k = v, a quarter of its pairs rotated), 4 experts of which 2 per token."""

from __future__ import annotations

from dllm_jax.models.diffusion_gemma_config import AttentionKind, DiffusionGemmaConfig, RopeSettings


def small_config(**overrides) -> DiffusionGemmaConfig:
    """The config, float32, with any field overridden."""
    values = dict(
        d_model=32,
        n_heads=4,
        layer_types=(AttentionKind.SLIDING, AttentionKind.FULL),
        sliding_head_dim=8,
        sliding_kv_heads=2,
        full_head_dim=16,
        full_kv_heads=1,
        mlp_hidden_size=48,
        n_experts=4,
        top_k_experts=2,
        expert_hidden_size=16,
        vocab_size=96,
        sliding_window=4,
        sliding_rope=RopeSettings(10_000.0),
        full_rope=RopeSettings(1_000_000.0, rotated_fraction=0.25),
        canvas_length=6,
        max_sequence_length=64,
        dtype="float32",
    )
    return DiffusionGemmaConfig(**{**values, **overrides})
