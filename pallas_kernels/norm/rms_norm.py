"""RMSNorm: weight * cast(x * rsqrt(mean(x^2) + eps)), statistics in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] (any float dtype) and weight [D] -> [..., D] in x's dtype: the statistics in
    float32, the weight applied in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)
