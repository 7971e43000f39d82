"""A batch-invariant matmul: row r of x @ w does not depend on how many rows x has.

cuBLAS (and XLA's own GEMM fusions) choose the algorithm, the tile and the split-K factor
from the whole problem shape, so one row's float32 sum over K is ordered differently when
the row count M changes, and its bf16 result can differ in the last bit. Here every
program computes one [block_m, block_n] output tile with a fixed-order loop over K in steps
of block_k, no split-K, and the block sizes depend only on K and N: a row's result is the
same whatever else is in the batch (and from run to run: nothing is atomic).

``invariant_matmul`` is the Pallas (Triton) kernel; ``invariant_matmul_reference`` is the
pure-jnp version of the same signature, equally row-invariant on any backend: XLA's dot on
fixed-shape [block_m, K] row tiles, one tile after the other (``lax.map``), so every row
goes through a GEMM of the same shape whatever M is. The two agree to rounding (their sums
over K are ordered differently), each is bit-stable in M.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    check_float,
    check_launch,
    check_power_of_two,
    compiler_params,
    dividing_block,
    pad_rows,
)


@dataclasses.dataclass(frozen=True)
class MatmulBlockSizes:
    """Tiling: block_m x block_n output tile per program, block_k keys of the K loop (powers
    of two >= 16; a call uses the largest power of two <= block_n (block_k) that divides N (K)),
    Triton launch parameters."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_power_of_two("block_m", self.block_m, 16)
        check_power_of_two("block_n", self.block_n, 16)
        check_power_of_two("block_k", self.block_k, 16)
        check_launch(self.num_warps, self.num_stages)


def _check(x: jax.Array, w: jax.Array) -> None:
    check_float("x", x)
    check_float("w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x {x.shape} @ w {w.shape}: expected x [M, K] and w [K, N]")
    if x.dtype != w.dtype:
        raise ValueError(f"x.dtype={x.dtype}, w.dtype={w.dtype}: expected equal dtypes")


def _matmul_kernel(x_ref, w_ref, o_ref, *, bm, bn, bk, n_k):
    rows = pl.ds(pl.program_id(0) * bm, bm)
    cols = pl.ds(pl.program_id(1) * bn, bn)

    def step(t, acc):
        ks = pl.ds(t * bk, bk)
        return acc + jnp.dot(x_ref[rows, ks], w_ref[ks, cols], preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_k, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[rows, cols] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_sizes"))
def invariant_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype: Any = None,
    interpret: bool = False,
    block_sizes: MatmulBlockSizes | None = None,
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x.dtype), float32 accumulation.

    K and N must be multiples of 16; M is padded to whole row tiles (the padding rows are
    computed and dropped). Row r's result depends only on x[r] and w.
    """
    _check(x, w)
    blocks = block_sizes or MatmulBlockSizes()
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m, k = x.shape
    n = w.shape[1]
    bn = dividing_block("N", n, blocks.block_n, "the batch-invariant matmul")
    bk = dividing_block("K", k, blocks.block_k, "the batch-invariant matmul")
    xp = pad_rows(x, blocks.block_m)
    kernel = functools.partial(_matmul_kernel, bm=blocks.block_m, bn=bn, bk=bk, n_k=k // bk)
    out = pl.pallas_call(
        kernel,
        grid=(xp.shape[0] // blocks.block_m, n // bn),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), out_dtype),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="invariant_matmul",
    )(xp, w)
    return out[:m]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_sizes"))
def invariant_matmul_reference(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype: Any = None,
    interpret: bool = False,
    block_sizes: MatmulBlockSizes | None = None,
) -> jax.Array:
    """Pure jnp: XLA's dot on [block_m, K] row tiles in sequence (same signature and result
    contract as ``invariant_matmul``; ``interpret`` is ignored, only block_m is read)."""
    del interpret
    _check(x, w)
    bm = (block_sizes or MatmulBlockSizes()).block_m
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m, k = x.shape
    tiles = pad_rows(x, bm).reshape(-1, bm, k)
    out = lax.map(lambda tile: jnp.dot(tile, w, preferred_element_type=out_dtype), tiles)
    return out.reshape(-1, w.shape[1])[:m]
