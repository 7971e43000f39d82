"""The seam between the model's per-layer ops and the Pallas kernels (backend="pallas").

The kernels take the full layer-stacked weights and caches plus the layer index, so no
per-layer slice is materialised inside the layer scan.
"""

from __future__ import annotations

import jax

from dllm_jax.config import ModelConfig


def pallas_preferred() -> bool:
    """Whether backend='auto' should pick the Pallas kernels: only on an NVIDIA GPU."""
    try:
        return jax.devices()[0].platform == "gpu" and "nvidia" in jax.devices()[0].device_kind.lower()
    except RuntimeError:
        return False


def pallas_qkv_to_cache(config: ModelConfig, spec, stacked, x, positions, rows, k_cache, v_cache, layer):
    """Fused projection + RoPE + cache write for the rows of all groups: x [S, R, D] -> q [S, R, H, Dh]."""
    from pallas_kernels.qkv_rope_cache import qkv_rope_cache

    S, R, D = x.shape
    q, k_cache, v_cache = qkv_rope_cache(
        x.reshape(S * R, D),
        stacked["q_proj"]["kernel"],
        stacked["k_proj"]["kernel"],
        stacked["v_proj"]["kernel"],
        positions.reshape(S * R),
        rows.reshape(S * R),
        k_cache,
        v_cache,
        layer,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        rope_theta=config.rope_theta,
        interpret=spec.interpret,
    )
    return q.reshape(S, R, config.n_heads, config.head_dim), k_cache, v_cache


def pallas_layer_attention(config: ModelConfig, spec, q, k_cache, v_cache, layer, group_slot, key_len, score_rows, verify, extra_kv):
    """Attention of each group's rows over its slot's cache rows (plus verify's in-query keys)."""
    from pallas_kernels.cache_attention import cache_attention

    S, R = q.shape[:2]
    slots = group_slot if group_slot is not None else jax.numpy.arange(S, dtype=jax.numpy.int32)
    extra = None
    key_exclude = None
    if verify is not None:
        k_extra, v_extra = extra_kv
        extra = (k_extra.reshape(S, R, -1), v_extra.reshape(S, R, -1), verify.extra_mask)
        key_exclude = verify.key_exclude
    if score_rows is None:
        score_rows = jax.numpy.zeros((S, R), bool)
    out, scores = cache_attention(
        q.reshape(S, R, -1),
        k_cache,
        v_cache,
        layer,
        slots,
        key_len,
        score_rows,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        max_len=spec.max_len,
        key_exclude=key_exclude,
        extra=extra,
        interpret=spec.interpret,
    )
    return out, (scores if spec.score_scale is not None else None)
