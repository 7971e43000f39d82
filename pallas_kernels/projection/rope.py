"""Rotate-half rotary position embedding (GPT-NeoX / Llama / LLaDA convention), in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
    """inv_freq[i] = theta^(-2i / head_dim) for i < head_dim / 2, float32 [head_dim // 2]."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / (jnp.float32(theta) ** exponents)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the angles position * inv_freq.

    Args:
      positions: int [...] absolute positions (0 = first prompt token).
    Returns:
      cos, sin: float32 [..., head_dim // 2]; column i serves both x[i] and x[i + head_dim/2].
    """
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(head_dim, theta)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [..., head_dim] in float32; cos/sin broadcast against x[..., : head_dim // 2].

    out[i] = x[i] cos - x[i + h] sin,  out[i + h] = x[i + h] cos + x[i] sin,  h = head_dim / 2.
    Returns float32.
    """
    half = x.shape[-1] // 2
    x = x.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
