"""FP8 activation quantization fused into its producer: RMSNorm + quantize, SwiGLU + quantize
(Pallas, Triton backend).

The fp8 engine quantizes every projection's input per row (x ~= xq * x_scale, x_scale =
max|x| / 448, dllm_jax.models.quantization.quantized_matmul); XLA runs that as separate passes after
the producer (a per-row abs-max reduction, then a scale-and-convert), about 9 of 63 ms of the
32-slot fp8 step on the H200 (BENCHMARKS.md), the largest over the SwiGLU output. These
kernels are the producers with the quantization in their epilogue: a program owns
``block_rows`` rows, computes them chunk by chunk over the width (block_cols columns at a time)
and writes only the float8 rows and their float32 scales:

  rms_norm_quantize(x, weight, eps)  the model's RMSNorm (float32 statistics, the normalized
                                     rows rounded to x.dtype, times the weight in x.dtype)
                                     of the q/k/v and gate/up inputs;
  swiglu_quantize(gate, up, scales)  silu(gate) * up in the inputs' dtype, the down
                                     projection's input; with scales, gate and up are the
                                     FP8 GEMMs' products before their per-row and
                                     per-column scales, applied here (as
                                     quantized_matmul's epilogue would), so the scaled
                                     gate and up never go through HBM.

Passes over a row block: the norm reads it three times (sum of squares, abs-max of the
normed rows, quantize), SwiGLU twice (abs-max, quantize); the re-reads of a block of a few
rows hit L2. HBM traffic: the inputs once and the float8 rows, against XLA's producer write
+ abs-max read + convert read + float8 write.

Each kernel sits beside its pure-jnp reference (the model's op followed by the engine's
quantization rule, ``quantize_rows_reference``); they agree to rounding (the kernels' sums
and products are ordered differently).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    cdiv,
    check_float,
    check_launch,
    check_power_of_two,
    compiler_params,
    dividing_block,
    pad_rows,
)
from pallas_kernels.norm.rms_norm import rms_norm

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


@dataclasses.dataclass(frozen=True)
class QuantizeBlockSizes:
    """block_rows rows per program (a power of two), block_cols columns per step of the loops
    over the width (a power of two >= 16; a call uses the largest power of two <= block_cols
    dividing the width), Triton launch parameters."""

    block_rows: int = 4
    block_cols: int = 1024
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_power_of_two("block_rows", self.block_rows, 1)
        check_power_of_two("block_cols", self.block_cols, 16)
        check_launch(self.num_warps, self.num_stages)


def quantize_rows_reference(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """y [N, W] -> (yq float8_e4m3fn [N, W], scale float32 [N]), y ~= yq * scale[:, None]: the
    engine's rule (max |row| maps to 448; an all-zero row gets scale 1)."""
    y32 = y.astype(jnp.float32)
    amax = jnp.max(jnp.abs(y32), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (y32 / scale[:, None]).astype(FP8), scale


def _scale_of(amax):
    # amax times the float32 reciprocal of 448: the form XLA rewrites the reference's (and
    # quantized_matmul's) division by a constant into; a division here need not round alike
    return jnp.where(amax > 0, amax * jnp.float32(1.0 / FP8_MAX), jnp.float32(1.0))


def _rms_norm_quantize_kernel(x_ref, w_ref, q_ref, s_ref, *, bm, bc, n_c, d, eps):
    rows = pl.ds(pl.program_id(0) * bm, bm)

    def square_sum(t, acc):
        chunk = x_ref[rows, pl.ds(t * bc, bc)].astype(jnp.float32)
        return acc + jnp.sum(chunk * chunk, axis=1)

    total = lax.fori_loop(0, n_c, square_sum, jnp.zeros((bm,), jnp.float32))
    inv_rms = lax.rsqrt(total / jnp.float32(d) + jnp.float32(eps))

    def normed(t):
        """The model's RMSNorm of columns [t*bc, (t+1)*bc), in x.dtype, as float32."""
        cols = pl.ds(t * bc, bc)
        y = (x_ref[rows, cols].astype(jnp.float32) * inv_rms[:, None]).astype(x_ref.dtype)
        return (y * w_ref[cols].astype(x_ref.dtype)[None, :]).astype(jnp.float32)

    amax = lax.fori_loop(
        0, n_c, lambda t, m: jnp.maximum(m, jnp.max(jnp.abs(normed(t)), axis=1)), jnp.zeros((bm,), jnp.float32)
    )
    scale = _scale_of(amax)

    def write(t, carry):
        q_ref[rows, pl.ds(t * bc, bc)] = (normed(t) / scale[:, None]).astype(q_ref.dtype)
        return carry

    lax.fori_loop(0, n_c, write, jnp.int32(0))
    s_ref[rows] = scale


def _swiglu_quantize_kernel(g_ref, u_ref, *refs, bm, bc, n_c, scaled):
    row_scale_ref, g_scale_ref, u_scale_ref, q_ref, s_ref = refs if scaled else (None, None, None, *refs)
    rows = pl.ds(pl.program_id(0) * bm, bm)
    row_scale = row_scale_ref[rows] if scaled else None

    def operand(ref, scale_ref, cols):
        """gate or up of columns cols in the inputs' dtype (scaled first when scaled)."""
        value = ref[rows, cols]
        if not scaled:
            return value
        return (value.astype(jnp.float32) * (row_scale[:, None] * scale_ref[cols][None, :])).astype(value.dtype)

    def swiglu(t):
        """silu(gate) * up of columns [t*bc, (t+1)*bc), in the inputs' dtype, as float32."""
        cols = pl.ds(t * bc, bc)
        g = operand(g_ref, g_scale_ref, cols)
        g32 = g.astype(jnp.float32)
        silu = (g32 * jax.nn.sigmoid(g32)).astype(g.dtype)
        return (silu * operand(u_ref, u_scale_ref, cols)).astype(jnp.float32)

    amax = lax.fori_loop(
        0, n_c, lambda t, m: jnp.maximum(m, jnp.max(jnp.abs(swiglu(t)), axis=1)), jnp.zeros((bm,), jnp.float32)
    )
    scale = _scale_of(amax)

    def write(t, carry):
        q_ref[rows, pl.ds(t * bc, bc)] = (swiglu(t) / scale[:, None]).astype(q_ref.dtype)
        return carry

    lax.fori_loop(0, n_c, write, jnp.int32(0))
    s_ref[rows] = scale


def _launch(kernel, inputs, n_rows, width, blocks, interpret, name):
    """Runs a row kernel over whole row blocks (padding rows computed and dropped)."""
    padded = cdiv(n_rows, blocks.block_rows) * blocks.block_rows
    q, scale = pl.pallas_call(
        kernel,
        grid=(padded // blocks.block_rows,),
        out_shape=(jax.ShapeDtypeStruct((padded, width), FP8), jax.ShapeDtypeStruct((padded,), jnp.float32)),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)
    return q[:n_rows], scale[:n_rows]


def _check_rows(name: str, x: jax.Array) -> None:
    check_float(name, x)
    if x.ndim != 2:
        raise ValueError(f"{name}.shape={x.shape}: expected [N, width]")


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_sizes"))
def rms_norm_quantize(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    interpret: bool = False,
    block_sizes: QuantizeBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """RMSNorm of x [N, D] with weight [D] (the model's: dllm_jax.models.layers.RMSNorm),
    quantized per row -> (xq float8_e4m3fn [N, D], x_scale float32 [N]). D must be a multiple
    of 16."""
    _check_rows("x", x)
    check_float("weight", weight)
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight.shape={weight.shape}: expected ({x.shape[1]},)")
    blocks = block_sizes or QuantizeBlockSizes()
    n, d = x.shape
    bc = dividing_block("D", d, blocks.block_cols, "rms_norm_quantize")
    kernel = functools.partial(_rms_norm_quantize_kernel, bm=blocks.block_rows, bc=bc, n_c=d // bc, d=d, eps=float(eps))
    return _launch(kernel, (pad_rows(x, blocks.block_rows), weight), n, d, blocks, interpret, "rms_norm_quantize")


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_sizes"))
def rms_norm_quantize_reference(x, weight, eps, *, interpret=False, block_sizes=None):
    """Pure jnp ``rms_norm_quantize``: the model's RMSNorm, then quantize_rows_reference."""
    del interpret, block_sizes
    return quantize_rows_reference(rms_norm(x, weight, eps))


Scales = tuple[jax.Array, jax.Array, jax.Array]


def _check_swiglu_args(gate, up, scales) -> None:
    _check_rows("gate", gate)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"up {up.shape} {up.dtype}: expected gate's {gate.shape} {gate.dtype}")
    if scales is None:
        return
    n, f = gate.shape
    for name, scale, size in zip(("row scale", "gate scale", "up scale"), scales, (n, f, f), strict=True):
        if scale.shape != (size,) or scale.dtype != jnp.float32:
            raise ValueError(f"scales: {name} {scale.shape} {scale.dtype}: expected float32 ({size},)")


@functools.partial(jax.jit, static_argnames=("interpret", "block_sizes"))
def swiglu_quantize(
    gate: jax.Array,
    up: jax.Array,
    scales: Scales | None = None,
    *,
    interpret: bool = False,
    block_sizes: QuantizeBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """silu(gate) * up of gate, up [N, F] (one dtype; silu rounded to it, then the product),
    quantized per row -> (hq float8_e4m3fn [N, F], h_scale float32 [N]). F must be a
    multiple of 16.

    scales: (row [N], gate columns [F], up columns [F]) float32, or None. Given, gate and up
    are FP8 GEMM products before their scales: each element is first multiplied by row x
    column scale in float32 and rounded to the inputs' dtype, as
    dllm_jax.models.quantization.quantized_matmul does.
    """
    _check_swiglu_args(gate, up, scales)
    blocks = block_sizes or QuantizeBlockSizes()
    n, f = gate.shape
    bc = dividing_block("F", f, blocks.block_cols, "swiglu_quantize")
    kernel = functools.partial(
        _swiglu_quantize_kernel, bm=blocks.block_rows, bc=bc, n_c=f // bc, scaled=scales is not None
    )
    inputs = (pad_rows(gate, blocks.block_rows), pad_rows(up, blocks.block_rows))
    if scales is not None:
        row, gate_cols, up_cols = scales
        inputs += (pad_rows(row[:, None], blocks.block_rows)[:, 0], gate_cols, up_cols)
    return _launch(kernel, inputs, n, f, blocks, interpret, "swiglu_quantize")


@functools.partial(jax.jit, static_argnames=("interpret", "block_sizes"))
def swiglu_quantize_reference(gate, up, scales=None, *, interpret=False, block_sizes=None):
    """Pure jnp ``swiglu_quantize``: gate and up scaled (with scales), silu (in float32,
    rounded to the inputs' dtype) times up, then quantize_rows_reference."""
    del interpret, block_sizes
    _check_swiglu_args(gate, up, scales)
    if scales is not None:
        row, gate_cols, up_cols = scales
        gate = (gate.astype(jnp.float32) * (row[:, None] * gate_cols)).astype(gate.dtype)
        up = (up.astype(jnp.float32) * (row[:, None] * up_cols)).astype(up.dtype)
    silu = (gate.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(gate.dtype)
    return quantize_rows_reference(silu * up)
