"""Building blocks shared by the model families: the token embedding, a float32-accumulating
Linear, RMSNorm, SwiGLU, and the fp8 producers (RMSNorm and SwiGLU handing their projections
rows quantized once, in the producer's epilogue).

Attention lives in pallas_kernels.attention.reference (dense, masked) and
dllm_jax.runtime.cached_forward (over the flat cache); RoPE in pallas_kernels.projection.rope.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models.quantization import (
    QuantizedRows,
    UnscaledProduct,
    embedding_rows,
    quantized_matmul,
    unscaled_product,
    weight_dtype,
)
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
    instead of ``kernel``; the bias stays in the model dtype. An fp8 Linear also takes x as
    QuantizedRows (quantized by its producer: Fp8Producers) and, with unscaled=True (no bias),
    returns the GEMM's UnscaledProduct for a consumer that applies the scales itself.
    """

    features: int
    dtype: Any
    quantization: str = "none"
    use_bias: bool = False

    @nn.compact
    def __call__(
        self, x: jax.Array | QuantizedRows, out_dtype: Any = None, unscaled: bool = False
    ) -> jax.Array | UnscaledProduct:
        out_dtype = self.dtype if out_dtype is None else out_dtype
        if self.quantization != "none":
            shape = (self.features, x.shape[-1])
            qkernel = self.param("qkernel", nn.initializers.zeros, shape, weight_dtype(self.quantization))
            scale = self.param("scale", nn.initializers.ones, (self.features,), jnp.float32)
            if unscaled:
                if self.use_bias or not isinstance(x, QuantizedRows):
                    raise ValueError(f"{self.name}: an unscaled product takes QuantizedRows, without a bias")
                return unscaled_product(x, qkernel, scale, out_dtype)
            x = x if isinstance(x, QuantizedRows) else x.astype(self.dtype)
            y = quantized_matmul(x, qkernel, scale, out_dtype)
        else:
            kernel = self.param("kernel", INIT, (x.shape[-1], self.features), self.dtype)
            y = jnp.dot(x.astype(self.dtype), kernel, preferred_element_type=out_dtype)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
            y = y + bias.astype(y.dtype)
        return y


class RMSNorm(nn.Module):
    """weight * cast(x * rsqrt(mean(x^2) + eps)): statistics in float32, weight applied in x's
    dtype. With producers, the normed rows come quantized for the fp8 projections that read them."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, producers: Fp8Producers | None = None) -> jax.Array | QuantizedRows:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if producers is not None:
            return producers.rms_norm(x, weight, self.eps)
        return rms_norm(x, weight, self.eps)


def dot_inputs(x: jax.Array, n: int, max_merged_rows: int | None) -> tuple[jax.Array, ...]:
    """x for n dots that read it: x itself n times up to max_merged_rows rows (the product of
    x's leading axes), where XLA:GPU's DotMerger may merge the dots (it concatenates their
    weights, on every call unless XLA fuses the concatenation into a Triton GEMM); past it, the
    n outputs of one optimization barrier, which the merger cannot take for one input, so the
    dots stay apart. None: always x itself."""
    rows = math.prod(x.shape[:-1])
    if max_merged_rows is None or rows <= max_merged_rows:
        return (x,) * n
    return jax.lax.optimization_barrier((x,) * n)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up, in the inputs' dtype."""
    return nn.silu(gate) * up


@dataclasses.dataclass(frozen=True)
class Fp8Producers:
    """How an fp8 block hands its projections quantized rows: the model's RMSNorm and SwiGLU
    as Pallas kernels with the per-row quantization in their epilogue
    (pallas_kernels.projection.quantize_rows: Triton, NVIDIA GPUs; interpret=True runs them
    in interpret mode), so each activation is quantized once, by its producer, and no
    separate abs-max and convert pass runs before the GEMMs. Same rule as quantized_matmul's;
    the numbers agree to rounding. The kernel routing (dllm_jax.runtime.kernel_routing)
    decides whether a pass uses them."""

    interpret: bool = False

    def _blocks(self):
        """The kernels' tiling: their default; interpreted, 128-row programs (the interpreter
        copies a kernel's outputs at every program: 4-row ones made a tiny model's decode
        loop about 10x slower on a CPU)."""
        from pallas_kernels.projection.quantize_rows import QuantizeBlockSizes

        return QuantizeBlockSizes(block_rows=128) if self.interpret else None

    def rms_norm(self, x: jax.Array, weight: jax.Array, eps: float) -> QuantizedRows:
        """RMSNorm of x [..., D] with weight [D] -> QuantizedRows [..., D]."""
        from pallas_kernels.projection.quantize_rows import rms_norm_quantize

        rows, scale = rms_norm_quantize(
            x.reshape(-1, x.shape[-1]), weight, float(eps), interpret=self.interpret, block_sizes=self._blocks()
        )
        return QuantizedRows(rows.reshape(x.shape), scale.reshape(x.shape[:-1]))

    def swiglu(self, gate: UnscaledProduct, up: UnscaledProduct) -> QuantizedRows:
        """swiglu(gate, up) of the gate and up projections' products [..., F] (of the same
        QuantizedRows: one row scale) -> QuantizedRows [..., F]. The kernel scales the products
        as quantized_matmul would, so the scaled gate and up are never written out."""
        from pallas_kernels.projection.quantize_rows import swiglu_quantize

        shape = gate.product.shape
        scales = (gate.row_scale.reshape(-1), gate.col_scale, up.col_scale)
        rows, scale = swiglu_quantize(
            gate.product.reshape(-1, shape[-1]),
            up.product.reshape(-1, shape[-1]),
            scales,
            interpret=self.interpret,
            block_sizes=self._blocks(),
        )
        return QuantizedRows(rows.reshape(shape), scale.reshape(shape[:-1]))
