"""Weight-only int8 GEMM: y = x @ (qkernel * scale).T, the int8 weights dequantized in registers.

x [M, K] (bf16 / f16 / f32) against int8 weights qkernel [N, K] (one row per output channel,
the layout of dllm_jax.models.quantization) and their float32 scales [N]; float32 accumulation,
the per-channel scale applied once to the accumulator, the result rounded to out_dtype.

Why a kernel. XLA lowers the int8 -> bf16 convert + dot either into its own Triton GEMM
fusion (0.7-0.9x cuBLAS's bf16 rate on the H200) or, at large M, into a full-size bf16 copy
of the weights followed by cuBLAS, so 8-bit weights ran slower than bf16 ones. Here each
weight byte crosses HBM once per call: one program owns a [BM, BN] output tile and streams
its [BN, K] weight rows in BK chunks; the M tiles that share a weight tile are the fastest
launch axis (grid axis 0), so they run in the same wave and the weight tile comes from L2
for all but the first.

Where the time goes (LLaDA-8B shapes, H200 ~4.3 TB/s, ~800 TFLOP/s bf16 MMA): the kernel
does 2 M FLOPs per weight byte; the bf16 tensor cores' ridge is ~186 FLOP/byte, so from
M ~ 96 rows up it is bound by the MMA rate of the dequantized tiles, below that by the weight
stream. At M = 128 (one slot) gate/up has a 12 us weight-stream floor and a 16 us MMA floor,
against ~54 us for cuBLAS's bf16 GEMM (~240 TFLOP/s, BENCHMARKS.md): the room is cuBLAS's
low efficiency at 128 rows, not the halved bytes alone. Each program also re-reads its
[BM, K] x rows from L2 (2 BM bytes per k against BN weight bytes), which is why the tiles
are not made narrow to fill the SMs.

swap_ab computes the tile as (w_tile @ x_tile.T).T: the dequantized weights become the MMA's
left operand, which Hopper's wgmma may take from registers (the converted tile then need not
be written back to shared memory; as the right operand, Triton may fall back to the older
mma.sync path), and a small M becomes the MMA's N side (8..256) rather than its M side (64
minimum). It is the default; which tiling is fastest is measured by
scripts/bench_gemm.py --sweep (not yet run on the H200 when this was written).

Ragged M (not a multiple of BM) is handled by masked loads and stores of the last row tile;
N must be a multiple of BN and K of BK * split_k (the callers fall back to XLA otherwise).
split_k > 1 splits the reduction over that many programs per output tile, which write float32
partial products (already scaled) that XLA sums: at one slot a [128, 4096] product has only
32-64 tiles for 132 SMs, and its partial products (2 MB each) stay in the 50 MB L2.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    NUM_SMS,
    cdiv,
    check_float,
    check_launch,
    check_power_of_two,
    compiler_params,
    next_power_of_two,
)


@dataclasses.dataclass(frozen=True)
class Int8MatmulBlockSizes:
    """Tiling (powers of two >= 16) and Triton launch parameters of the int8 weight GEMM.

    Attributes:
      block_m: rows of x per program (BM).
      block_n: output channels per program (BN); must divide N.
      block_k: reduction tile (BK); must divide K.
      swap_ab: compute each tile as (w @ x.T).T (see the module docstring).
      split_k: programs sharing one output tile, each over K / split_k (a power of two); they
        write float32 partial products that XLA sums (more programs for a narrow N at few rows).
      num_warps, num_stages: Triton launch parameters (stages = software-pipeline depth).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    swap_ab: bool = False
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def __post_init__(self):
        check_power_of_two("block_m", self.block_m, 16)
        check_power_of_two("block_n", self.block_n, 16)
        check_power_of_two("block_k", self.block_k, 16)
        if not isinstance(self.swap_ab, bool):
            raise ValueError(f"swap_ab={self.swap_ab!r}: expected a bool")
        check_launch(self.num_warps, self.num_stages)
        check_power_of_two("split_k", self.split_k, 1)

    @property
    def name(self) -> str:
        swap = " swap" if self.swap_ab else ""
        split = f" k/{self.split_k}" if self.split_k > 1 else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k}{swap}{split} w{self.num_warps} s{self.num_stages}"


def default_int8_block_sizes(m: int, n: int, k: int) -> Int8MatmulBlockSizes:
    """A heuristic until the H200 sweep (scripts/bench_gemm.py --sweep) says better.

    Up to 128 rows per tile; 128 output channels, or 64 where that leaves fewer than half as
    many programs as SMs (1 slot, N = 4096: 32 programs at BN = 128). A narrower tile re-reads
    the x tile (2 * BM bytes per k, from L2) for fewer weight columns (BN bytes per k), so it
    is not narrowed further. swap_ab, so that the dequantized weights are the MMA's register
    operand. BK = 64 at 4 stages keeps the pipeline's shared memory (x and w tiles) plus the
    epilogue's transpose of the [BN, BM] accumulator under Hopper's 227 KiB.
    """
    block_m = min(128, max(16, next_power_of_two(m)))
    block_n = 128 if n % 128 == 0 else 64 if n % 64 == 0 else 32 if n % 32 == 0 else 16
    if block_n > 64 and cdiv(m, block_m) * (n // block_n) < NUM_SMS // 2:
        block_n = 64
    block_k = next((b for b in ((128, 64, 32, 16) if block_n <= 64 else (64, 32, 16)) if k % b == 0), 16)
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return Int8MatmulBlockSizes(block_m, block_n, block_k, swap_ab=True, num_warps=num_warps, num_stages=4)


def supports(m: int, n: int, k: int, blocks: Int8MatmulBlockSizes | None = None) -> bool:
    """Whether the kernel takes these shapes (N a multiple of BN, K of BK * split_k)."""
    if m < 1 or n % 16 or k % 16:
        return False
    blocks = blocks or default_int8_block_sizes(m, n, k)
    return n % blocks.block_n == 0 and k % (blocks.block_k * blocks.split_k) == 0


def _check(x, qkernel, scale, out_dtype):
    check_float("x", x)
    if x.ndim != 2:
        raise ValueError(f"x.shape={x.shape}: expected [M, K]")
    if qkernel.dtype != jnp.int8 or qkernel.ndim != 2 or qkernel.shape[1] != x.shape[1]:
        raise ValueError(f"qkernel {qkernel.shape} {qkernel.dtype}: expected int8 [N, {x.shape[1]}]")
    if scale.shape != (qkernel.shape[0],) or scale.dtype != jnp.float32:
        raise ValueError(f"scale {scale.shape} {scale.dtype}: expected float32 [{qkernel.shape[0]}]")
    if not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
        raise ValueError(f"out_dtype={out_dtype}: expected a floating dtype")


def _int8_matmul_kernel(x_ref, w_ref, scale_ref, o_ref, *, m: int, blocks: Int8MatmulBlockSizes):
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    row0 = pl.program_id(0) * bm
    col0 = pl.program_id(1) * bn
    k_part = x_ref.shape[1] // blocks.split_k
    k_start = pl.program_id(2) * k_part
    ragged = m % bm != 0
    row_ok = (row0 + jnp.arange(bm, dtype=jnp.int32)) < m

    def step(t, acc):
        k0 = pl.multiple_of(k_start + t * bk, bk)
        if ragged:
            x = plgpu.load(
                x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=jnp.broadcast_to(row_ok[:, None], (bm, bk)), other=0
            )
        else:
            x = x_ref[pl.ds(row0, bm), pl.ds(k0, bk)]
        w = w_ref[pl.ds(col0, bn), pl.ds(k0, bk)].astype(x.dtype)  # int8 -> x's dtype, exact for |q| <= 127
        if blocks.swap_ab:
            return acc + lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc_shape = (bn, bm) if blocks.swap_ab else (bm, bn)
    acc = lax.fori_loop(0, k_part // bk, step, jnp.zeros(acc_shape, jnp.float32))
    if blocks.swap_ab:
        acc = acc.T
    out = (acc * scale_ref[pl.ds(col0, bn)][None, :]).astype(o_ref.dtype)
    # split_k > 1: this program's float32 partial product, in its own [M, N] plane
    target = (
        o_ref.at[pl.program_id(2), pl.ds(row0, bm), pl.ds(col0, bn)]
        if blocks.split_k > 1
        else o_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)]
    )
    if ragged:
        plgpu.store(target, out, mask=jnp.broadcast_to(row_ok[:, None], (bm, bn)))
    else:
        target[...] = out


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_sizes"))
def int8_weight_matmul(
    x: jax.Array,
    qkernel: jax.Array,
    scale: jax.Array,
    *,
    out_dtype: Any = jnp.bfloat16,
    interpret: bool = False,
    block_sizes: Int8MatmulBlockSizes | None = None,
) -> jax.Array:
    """x [M, K] @ (qkernel [N, K] int8 * scale [N] float32).T -> [M, N] in out_dtype.

    Accumulates x * q in float32 and multiplies the accumulator by the channel's scale.
    ValueError for shapes or dtypes that do not fit (N % BN, K % (BK * split_k) included).
    """
    _check(x, qkernel, scale, out_dtype)
    (m, k), n = x.shape, qkernel.shape[0]
    blocks = block_sizes or default_int8_block_sizes(m, n, k)
    if n % blocks.block_n or k % (blocks.block_k * blocks.split_k):
        raise ValueError(
            f"qkernel {qkernel.shape}: N must be a multiple of block_n={blocks.block_n} and K of "
            f"block_k * split_k={blocks.block_k * blocks.split_k}"
        )
    split = blocks.split_k
    kernel = functools.partial(_int8_matmul_kernel, m=m, blocks=blocks)
    out = pl.pallas_call(
        kernel,
        grid=(cdiv(m, blocks.block_m), n // blocks.block_n, split),
        out_shape=jax.ShapeDtypeStruct((split, m, n), jnp.float32)
        if split > 1
        else jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="int8_weight_matmul",
    )(x, qkernel, scale)
    return out.sum(0).astype(out_dtype) if split > 1 else out


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_sizes"))
def int8_weight_matmul_reference(x, qkernel, scale, *, out_dtype=jnp.bfloat16, interpret=False, block_sizes=None):
    """Pure jnp: the same product through XLA (int8 converted to x's dtype, float32 accumulation)."""
    del interpret, block_sizes
    _check(x, qkernel, scale, out_dtype)
    y = lax.dot_general(x, qkernel.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype)
