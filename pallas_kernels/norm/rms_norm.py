"""RMSNorm, statistics in float32: Llama's weight * cast(x * rsqrt(mean(x^2) + eps)) (rms_norm)
and Gemma's cast(x * rsqrt(mean(x^2) + eps) * weight) (rms_normalize)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] (any float dtype) and weight [D] -> [..., D] in x's dtype: the statistics in
    float32, the weight applied in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float, weight: jax.Array | None = None) -> jax.Array:
    """Gemma's RMSNorm: x * (mean(x^2) + eps)^-1/2 (times weight, when given) in float32, then
    rounded once to x's dtype. x [..., D], weight [D]."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        normed = normed * weight.astype(jnp.float32)
    return normed.astype(x.dtype)
