"""Building blocks of the Gemma family (DiffusionGemma's text model): Gemma's RMSNorm, with or
without a weight, and the GELU-gated MLP. (The shared Linear and embedding live in layers.py.)"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models.layers import Linear


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh), in x's dtype."""
    return jax.nn.gelu(x, approximate=True)


def rms_normalize(x: jax.Array, eps: float, weight: jax.Array | None = None) -> jax.Array:
    """Gemma's RMSNorm: x * (mean(x^2) + eps)^-1/2 (times weight, when given) in float32, then
    rounded once to x's dtype. x [..., D], weight [D]."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        normed = normed * weight.astype(jnp.float32)
    return normed.astype(x.dtype)


class GemmaRMSNorm(nn.Module):
    """RMSNorm over the last axis (rms_normalize), with a learned ``weight`` when with_scale."""

    eps: float
    dtype: Any
    with_scale: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype) if self.with_scale else None
        return rms_normalize(x, self.eps, weight)


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
