"""Building blocks of the Gemma family (DiffusionGemma's text model): Gemma's RMSNorm, with or
without a weight, its per-head form followed by RoPE, and the GELU-gated MLP. (The shared
Linear and embedding live in layers.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models.layers import Linear, dot_inputs
from pallas_kernels.norm.head_norm_rope import head_norm_rope_reference
from pallas_kernels.norm.rms_norm import rms_normalize

# head_norm_rope's signature: (x [N, H, Dh], weight [Dh] | None, cos, sin [N, Dh / 2] | None, *, eps) -> [N, H, Dh]
HeadNormRope = Callable[..., jax.Array]


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh), in x's dtype."""
    return jax.nn.gelu(x, approximate=True)


class GemmaRMSNorm(nn.Module):
    """RMSNorm over the last axis (rms_normalize), with a learned ``weight`` when with_scale."""

    eps: float
    dtype: Any
    with_scale: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype) if self.with_scale else None
        return rms_normalize(x, self.eps, weight)


class HeadRMSNorm(nn.Module):
    """Gemma's RMSNorm of each head of x [..., H, Dh] (``weight`` [Dh] when with_scale), then
    rotate-half RoPE by cos, sin [..., Dh / 2] (x's leading axes) when given, in one function:
    ``kernel``, head_norm_rope's signature (None: pallas_kernels.norm.head_norm_rope's reference,
    XLA; the model's runtime passes the Pallas kernel where it runs)."""

    eps: float
    dtype: Any
    with_scale: bool = True
    kernel: HeadNormRope | None = None

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array | None = None, sin: jax.Array | None = None) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype) if self.with_scale else None
        *lead, heads, head_dim = x.shape
        rows = x.reshape(-1, heads, head_dim)
        if cos is not None:
            cos, sin = (jnp.broadcast_to(t, (*lead, head_dim // 2)).reshape(-1, head_dim // 2) for t in (cos, sin))
        return (self.kernel or head_norm_rope_reference)(rows, weight, cos, sin, eps=self.eps).reshape(x.shape)


class GatedMLP(nn.Module):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)): [..., D] -> [..., features], in dtype
    (the three projections 8-bit with quantization "fp8" or "int8-weights"); gate and up read x
    apart past max_merged_rows rows (layers.dot_inputs; None: never)."""

    hidden: int
    features: int
    dtype: Any
    quantization: str = "none"
    max_merged_rows: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        q = self.quantization
        x_gate, x_up = dot_inputs(x, 2, self.max_merged_rows)
        gate = Linear(self.hidden, self.dtype, q, name="gate_proj")(x_gate)
        up = Linear(self.hidden, self.dtype, q, name="up_proj")(x_up)
        return Linear(self.features, self.dtype, q, name="down_proj")(gelu_tanh(gate) * up)
