"""Building blocks shared by the model families: the token embedding, a float32-accumulating
Linear, RMSNorm, SwiGLU.

Attention lives in pallas_kernels.attention.reference (dense, masked) and
dllm_jax.runtime.cached_forward (over the flat cache); RoPE in pallas_kernels.projection.rope.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models.quantization import embedding_rows, quantized_matmul, weight_dtype
from pallas_kernels.norm.rms_norm import rms_norm

INIT = nn.initializers.normal(stddev=0.02)


class Embedding(nn.Module):
    """The token embedding table [V, D]: int tokens [...] -> rows [..., D] in dtype.

    Plain: ``embedding`` [V, D] in dtype (flax's nn.Embed: the same param, the same numbers).
    Quantized (dllm_jax.models.quantization): ``qembedding`` int8 [V, D] and ``scale`` float32 [V],
    and only the gathered rows are dequantized.
    """

    num_embeddings: int
    features: int
    dtype: Any
    quantized: bool = False

    def setup(self):
        shape = (self.num_embeddings, self.features)
        if self.quantized:
            self.qembedding = self.param("qembedding", nn.initializers.zeros, shape, jnp.int8)
            self.scale = self.param("scale", nn.initializers.ones, shape[:1], jnp.float32)
        else:
            self.embedding = self.param("embedding", INIT, shape, self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.quantized:
            return embedding_rows(self.qembedding, self.scale, tokens, self.dtype)
        return jnp.take(self.embedding, tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """x [..., D] @ the table's transpose -> [..., V] in dtype: a tied LM head (whose table
        is never quantized)."""
        return jnp.dot(x.astype(self.dtype), self.embedding.T)


class Linear(nn.Module):
    """y = x @ kernel (+ bias), accumulated in float32, returned in out_dtype (default: the
    weights' dtype).

    bf16 x bf16 -> bf16 dots accumulate in float32 on GPU (cuBLAS) and CPU; asking for a
    float32 result only where it is used (q and k before RoPE) keeps the large MLP
    activations in bf16 in device memory. The bias is added to the float32 product when
    out_dtype is float32 (before rounding), else in the output dtype. With quantization
    (dllm_jax.models.quantization) the params are ``qkernel`` [out, in] (8-bit) and ``scale`` [out]
    instead of ``kernel``; the bias stays in the model dtype.
    """

    features: int
    dtype: Any
    quantization: str = "none"
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, out_dtype: Any = None) -> jax.Array:
        out_dtype = self.dtype if out_dtype is None else out_dtype
        if self.quantization != "none":
            shape = (self.features, x.shape[-1])
            qkernel = self.param("qkernel", nn.initializers.zeros, shape, weight_dtype(self.quantization))
            scale = self.param("scale", nn.initializers.ones, (self.features,), jnp.float32)
            y = quantized_matmul(x.astype(self.dtype), qkernel, scale, out_dtype)
        else:
            kernel = self.param("kernel", INIT, (x.shape[-1], self.features), self.dtype)
            y = jnp.dot(x.astype(self.dtype), kernel, preferred_element_type=out_dtype)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
            y = y + bias.astype(y.dtype)
        return y


class RMSNorm(nn.Module):
    """weight * cast(x * rsqrt(mean(x^2) + eps)): statistics in float32, weight applied in x's dtype."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return rms_norm(x, weight, self.eps)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up, in the inputs' dtype."""
    return nn.silu(gate) * up
