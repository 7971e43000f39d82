"""Building blocks of the Gemma family (DiffusionGemma's text model): Gemma's RMSNorm, with or
without a weight, and the GELU-gated MLP. (The shared Linear and embedding live in layers.py.)"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models.layers import Linear
from pallas_kernels.projection.rope import apply_rope


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh), in x's dtype."""
    return jax.nn.gelu(x, approximate=True)


def rms_normalize(
    x: jax.Array, eps: float, weight: jax.Array | None = None, rope: tuple[jax.Array, jax.Array] | None = None
) -> jax.Array:
    """Gemma's RMSNorm: x * (mean(x^2) + eps)^-1/2 (times weight, when given) in float32, then
    rounded once to x's dtype. x [..., D], weight [D].

    With rope (cos, sin, float32 broadcasting against x[..., : D // 2]): the normed rows
    rotated (pallas_kernels.projection.rope.apply_rope), returned in float32, unrounded. The
    rotation keeps each row's mean square, so this is rope(x * weight) times the rows'
    reciprocal RMS: XLA:GPU then reads x in two passes (the mean square, and the rotation with
    the scale) instead of writing the float32 normed rows for a separate rotation pass.
    """
    x32 = x.astype(jnp.float32)
    inverse_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if rope is not None:
        scaled = x32 if weight is None else x32 * weight.astype(jnp.float32)
        return apply_rope(scaled, *rope) * inverse_rms
    normed = x32 * inverse_rms
    if weight is not None:
        normed = normed * weight.astype(jnp.float32)
    return normed.astype(x.dtype)


class GemmaRMSNorm(nn.Module):
    """RMSNorm over the last axis (rms_normalize), with a learned ``weight`` when with_scale."""

    eps: float
    dtype: Any
    with_scale: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """x [..., D] -> normed in x's dtype; with rope (cos, sin), normed and rotated in float32
        (rms_normalize)."""
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype) if self.with_scale else None
        return rms_normalize(x, self.eps, weight, rope)


class GatedMLP(nn.Module):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)): [..., D] -> [..., features], in dtype
    (the three projections 8-bit with quantization "fp8" or "int8-weights")."""

    hidden: int
    features: int
    dtype: Any
    quantization: str = "none"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        q = self.quantization
        gate = Linear(self.hidden, self.dtype, q, name="gate_proj")(x)
        up = Linear(self.hidden, self.dtype, q, name="up_proj")(x)
        return Linear(self.features, self.dtype, q, name="down_proj")(gelu_tanh(gate) * up)
