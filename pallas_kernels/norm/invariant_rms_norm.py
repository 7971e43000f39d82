"""A batch-invariant RMSNorm: row r's result does not depend on how many rows x has.

XLA:GPU picks the strategy of a row reduction (threads per row, vector width, fusion) from
the whole shape, so a row's float32 sum of squares can be ordered differently when the row
count M changes (measured on the H200: ff_norm differed in the last bf16 bit for a request
alone vs among 7 others). Here every program normalizes block_m rows with a fixed-order loop
over D in steps of block_d; the block sizes depend only on D, so a row's result is the same
whatever else is in the batch.

The math is dllm_jax.models.layers.RMSNorm's: weight * cast(x * rsqrt(mean(x^2) + eps)), statistics
in float32, the normalized rows cast to x.dtype before the weight (cast to x.dtype) multiplies.

``invariant_rms_norm`` is the Pallas (Triton) kernel; ``invariant_rms_norm_reference`` is the
pure-jnp version of the same signature, equally row-invariant on any backend: the model's math
on fixed-shape [block_m, D] row tiles, one tile after the other (``lax.map``). The two agree to
rounding (their sums over D are ordered differently), each is bit-stable in M.
"""

from __future__ import annotations

import dataclasses
import functools

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
from pallas_kernels.norm.rms_norm import rms_norm


@dataclasses.dataclass(frozen=True)
class RMSNormBlockSizes:
    """Tiling: block_m rows per program (a power of two), block_d columns per step of the D
    loops (a power of two >= 16; a call uses the largest power of two <= block_d that divides
    D), Triton launch parameters."""

    block_m: int = 16
    block_d: int = 512
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_power_of_two("block_m", self.block_m, 1)
        check_power_of_two("block_d", self.block_d, 16)
        check_launch(self.num_warps, self.num_stages)


def _check(x: jax.Array, weight: jax.Array) -> None:
    check_float("x", x)
    check_float("weight", weight)
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x {x.shape}, weight {weight.shape}: expected x [M, D] and weight [D]")


def _rms_norm_kernel(x_ref, w_ref, o_ref, *, bm, bd, n_d, d, eps):
    rows = pl.ds(pl.program_id(0) * bm, bm)

    def square_sum(t, acc):
        chunk = x_ref[rows, pl.ds(t * bd, bd)].astype(jnp.float32)
        return acc + jnp.sum(chunk * chunk, axis=1)

    total = lax.fori_loop(0, n_d, square_sum, jnp.zeros((bm,), jnp.float32))
    scale = lax.rsqrt(total / jnp.float32(d) + jnp.float32(eps))

    def write(t, carry):
        cols = pl.ds(t * bd, bd)
        normed = (x_ref[rows, cols].astype(jnp.float32) * scale[:, None]).astype(o_ref.dtype)
        o_ref[rows, cols] = normed * w_ref[cols].astype(o_ref.dtype)[None, :]
        return carry

    lax.fori_loop(0, n_d, write, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_sizes"))
def invariant_rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    interpret: bool = False,
    block_sizes: RMSNormBlockSizes | None = None,
) -> jax.Array:
    """RMSNorm of x [M, D] with weight [D] -> [M, D] in x.dtype, float32 statistics.

    D must be a multiple of 16; M is padded to whole row blocks (the padding rows are
    computed and dropped). Row r's result depends only on x[r], weight and eps.
    """
    _check(x, weight)
    blocks = block_sizes or RMSNormBlockSizes()
    m, d = x.shape
    bd = dividing_block("D", d, blocks.block_d, "the batch-invariant RMSNorm")
    xp = pad_rows(x, blocks.block_m)
    kernel = functools.partial(_rms_norm_kernel, bm=blocks.block_m, bd=bd, n_d=d // bd, d=d, eps=float(eps))
    out = pl.pallas_call(
        kernel,
        grid=(xp.shape[0] // blocks.block_m,),
        out_shape=jax.ShapeDtypeStruct(xp.shape, x.dtype),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="invariant_rms_norm",
    )(xp, weight)
    return out[:m]


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_sizes"))
def invariant_rms_norm_reference(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    interpret: bool = False,
    block_sizes: RMSNormBlockSizes | None = None,
) -> jax.Array:
    """Pure jnp: the model's RMSNorm on [block_m, D] row tiles in sequence (same signature and
    result contract as ``invariant_rms_norm``; ``interpret`` is ignored, only block_m is read)."""
    del interpret
    _check(x, weight)
    bm = (block_sizes or RMSNormBlockSizes()).block_m
    m, d = x.shape
    tiles = pad_rows(x, bm).reshape(-1, bm, d)
    out = lax.map(lambda tile: rms_norm(tile, weight, eps), tiles)
    return out.reshape(-1, d)[:m]
