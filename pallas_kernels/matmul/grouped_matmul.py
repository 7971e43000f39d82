"""Grouped GEMM for routed experts: rows sorted by group times their group's weights, [G, N, K].

    y[r] = (x[r] . w[g(r)].T) * x_scale[r] * w_scale[g(r)]        (float32 accumulation)

x [M, K] holds the rows sorted by group (group_sizes int32 [G] rows each, in order; rows past
their sum belong to no group and come out as zeros, as jax.lax.ragged_dot leaves them); w
[G, N, K] is one [out, in] matrix per group (torch's Linear layout, the layout of the
experts' weights, so the weights are read as stored: no transpose). This is
jax.lax.ragged_dot_general with the weights' last axis contracted, which XLA:GPU (jax 0.11.2)
rewrites into a dense product of every row with every group (E times the FLOPs and a
[M, G, N] float32 temporary).

Scheme (vLLM fused_moe's "align block size", without moving any row): each group's rows are
cut into row tiles of BM rows starting at the group's first row, so a tile holds the rows of
one group only; a small XLA computation makes the tile -> (group, first row, end row) map
(at most cdiv(M, BM) + G tiles), and the grid runs (N / BN output tiles, tiles) with the
output tiles fastest, so the programs that read one tile of x run side by side (x from L2)
and the tiles of one group follow each other (its weights from L2). Tiles past the used ones
exit at once. A program reads its rows through a window of BM rows that stays inside x
(min(first row, M - BM)), and stores only its own rows (masked), so no load or store leaves
the arrays and no row is written twice.

Weights: the model dtype (x's), or 8-bit with per-(group, output channel) float32 scales
w_scale [G, N] (dllm_jax.models.quantization.quantize_experts): int8 weights are converted to
x's dtype in registers (weight-only), float8_e4m3fn weights go into an fp8 x fp8 MMA with x
already quantized per row (x_scale [M], W8A8). Each weight byte crosses HBM once per row tile
of its group.

Gathered rows: with row_index [M], sorted row r is x[row_index[r]] (x any [T, K]): each program
loads its window's rows through the index (a Triton gather load), so the caller's [M, K] copy
of the rows in group order is never written (DiffusionGemma's token rows, each routed to k
experts: k copies of 5.6 KB per token per layer at 26B-A4B).

Tail rows (past sum(group_sizes)): written as zeros with fill_tail=True (ragged_dot's result);
with fill_tail=False left unwritten, for callers that mask them anyway (an expert-parallel
device's rows for other devices' experts: they then cost nothing).

Gated (grouped_matmul_gated, for a gated MLP's gate_up weights [G, 2F, K]): each program
computes one [BM, 2 BN] product of its rows with a weight tile gathered from the gate's rows [c,
c + BN) and the up's [F + c, F + c + BN) (so each MMA step reads the rows' tile once for both,
at twice the MMA width), splits it into gate and up, and writes gelu_tanh(gate) * up [M, F]
with the products rounded where the plain kernel stores them: the [M, 2F] product and the
separate XLA pass over it are never written.

Shapes: N a multiple of 16, K of 16 (block_n and block_k divide them; `supports`); M >= 1
(fewer rows than BM are padded). Pallas Triton: lowers on a CPU for CUDA and runs in interpret
mode; grouped_matmul_reference is the same function through jax.lax.ragged_dot_general,
grouped_matmul_gated_reference the gated one through it and jax.nn.gelu.
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

from pallas_kernels.common import cdiv, compiler_params, dot_t, gelu_tanh, next_power_of_two
from pallas_kernels.matmul.invariant_matmul import MatmulBlockSizes

FP8 = jnp.float8_e4m3fn
WEIGHT_DTYPES = (jnp.int8, FP8)
# rows [M, K] (ragged along M) times weights [G, N, K]: contract K with K
_RAGGED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulBlockSizes(MatmulBlockSizes):
    """Tiling (powers of two >= 16) and Triton launch parameters, checked as MatmulBlockSizes.

    block_m: rows per tile (a tile holds one group's rows); block_n: output channels per
    program (divides N); block_k: reduction step (divides K); num_warps, num_stages: Triton's.
    """

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


def _dividing(size: int, most: int) -> int:
    """The largest power of two <= most that divides size (16 at least: callers check size % 16)."""
    block = most
    while block > 16 and size % block:
        block //= 2
    return block


def default_grouped_block_sizes(m: int, n: int, k: int, groups: int) -> GroupedMatmulBlockSizes:
    """A heuristic until measured better on the H200 (scripts/gpu/grouped_gemm.py sweeps it).

    block_m: the power of two above 1.25 x the mean rows per group (16..128): one tile for
    most groups at one slot (16 rows per expert: 32), whole 128-row tiles when groups are
    large; never more than M. block_n 128, block_k 64 (2816 and 704 are multiples of 64).
    Where N >= 2K, as measured: 256 columns with 128-row tiles, half the rows with small ones.
    """
    mean = m / max(groups, 1)
    block_m = min(128, max(16, next_power_of_two(max(1, int(1.25 * mean)))))
    block_m = max(16, min(block_m, 1 << (max(m, 16).bit_length() - 1)))
    block_n = _dividing(n, 128)
    block_k = _dividing(k, 64)
    if n >= 2 * k:
        # an output twice as wide as the reduction (the experts' down projection, 2816 x 704),
        # measured on the H200 (BENCHMARKS.md, 2026-12-03): with 128-row tiles 256 columns
        # per program (0.344 / 0.751 ms against 0.461 / 0.826 at 8 / 32 slots' rows), with
        # small tiles half the rows (16: 0.258 ms against 0.370 at one slot's)
        if block_m == 128 and n % 256 == 0:
            block_n = 256
        elif block_m <= 32:
            block_m = max(16, block_m // 2)
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return GroupedMatmulBlockSizes(block_m, block_n, block_k, num_warps=num_warps, num_stages=4 if block_m <= 64 else 3)


def default_gated_block_sizes(m: int, f: int, k: int, groups: int) -> GroupedMatmulBlockSizes:
    """The gated kernel's tiling: the plain kernel's for the [M, 2F] product with block_n halved
    (at 256 rows per group and more on average, 128 columns of each half: measured faster).

    A program then holds as many accumulator columns (block_n of the gate's, block_n of the
    up's) and reads as many weight bytes per step as the plain kernel's, so its registers,
    shared memory and grid are the same (26B-A4B's F = 704: 64 columns, 11 programs per row
    tile). scripts/gpu/grouped_gemm.py --impls gated times it against other tilings.
    """
    plain = default_grouped_block_sizes(m, 2 * f, k, groups)
    if plain.block_m == 128 and m >= 256 * groups and f >= 128:
        # groups of 256 rows and more on average (26B-A4B at 32 slots): 128 columns of each half,
        # a [128, 256] product per program, measured on the H100 (BENCHMARKS.md, 2026-12-07):
        # 1.195 against 1.245 ms per layer with 64 (F = 704: the last program overlaps)
        return dataclasses.replace(plain, block_n=128)
    return dataclasses.replace(plain, block_n=max(16, plain.block_n // 2))


def supports(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes these shapes (its tiles must divide N and K)."""
    return m >= 1 and n % 16 == 0 and k % 16 == 0


def supports_gated(m: int, two_f: int, k: int) -> bool:
    """Whether the gated kernel takes these shapes (w [G, 2F, K]: F and K multiples of 16)."""
    return supports(m, two_f, k) and two_f % 32 == 0


def _check(x, w, group_sizes, w_scale, x_scale, row_index=None):
    if x.ndim != 2 or w.ndim != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"x {x.shape} and w {w.shape}: expected [M, K] and [G, N, K]")
    if row_index is not None and (row_index.ndim != 1 or row_index.dtype != jnp.int32):
        raise ValueError(f"row_index {row_index.shape} {row_index.dtype}: expected int32 [M]")
    m = x.shape[0] if row_index is None else row_index.shape[0]
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes {group_sizes.shape} {group_sizes.dtype}: expected int32 [{w.shape[0]}]")
    quantized = w.dtype in WEIGHT_DTYPES
    if quantized != (w_scale is not None):
        raise ValueError(f"w {w.dtype}: w_scale is needed with 8-bit weights and only with them")
    if w_scale is not None and (w_scale.shape != w.shape[:2] or w_scale.dtype != jnp.float32):
        raise ValueError(f"w_scale {w_scale.shape} {w_scale.dtype}: expected float32 {w.shape[:2]}")
    if (x.dtype == FP8) != (w.dtype == FP8):
        raise ValueError(f"x {x.dtype}, w {w.dtype}: float8 weights take float8 rows (W8A8) and only they")
    if w.dtype == FP8 and x_scale is None:
        raise ValueError("float8 rows need their scales (x_scale [M])")
    if x_scale is not None and (x_scale.shape != (m,) or x_scale.dtype != jnp.float32):
        raise ValueError(f"x_scale {x_scale.shape} {x_scale.dtype}: expected float32 [{m}]")
    if not quantized and w.dtype != x.dtype:
        raise ValueError(f"x {x.dtype}, w {w.dtype}: unquantized weights must have x's dtype")


def tile_map(group_sizes: jax.Array, m: int, block_m: int, fill_tail: bool) -> jax.Array:
    """int32 [3, cdiv(m, block_m) + G]: per row tile its group (G: the tail, rows in no group;
    G + 1: unused tile, or the tail when not filled), its first row and its group's end row.

    Group g's rows [start_g, end_g) are cut into tiles of block_m rows from start_g, in group
    order, then the tail [sum, m). Example (block_m 4, sizes [5, 0, 2], m 9): tiles
    (0, 0, 5), (0, 4, 5), (2, 5, 7), (3, 7, 9), then unused ones.
    """
    G = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    tail = jnp.maximum(m - jnp.sum(sizes), 0)
    sizes = jnp.concatenate([sizes, tail[None]])  # [G + 1]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    counts = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(counts)
    tile_begin = tile_end - counts
    t = jnp.arange(cdiv(m, block_m) + G, dtype=jnp.int32)
    group = jnp.sum(t[:, None] >= tile_end[None, :], axis=1).astype(jnp.int32)  # [T] in [0, G + 1]
    known = jnp.minimum(group, G)
    start = starts[known] + (t - tile_begin[known]) * block_m
    used = group <= G if fill_tail else group < G
    group = jnp.where(used, group, G + 1)
    return jnp.stack([group, jnp.where(used, start, 0), jnp.where(used, ends[known], 0)])


def _kernel(
    tiles_ref,
    x_ref,
    w_ref,
    *refs,
    n_groups: int,
    blocks: GroupedMatmulBlockSizes,
    scaled: tuple[bool, bool],
    gathered: bool,
    gated: bool,
):
    *in_refs, o_ref = refs
    index_ref = in_refs.pop(0) if gathered else None
    xs_ref = in_refs.pop(0) if scaled[0] else None
    ws_ref = in_refs.pop(0) if scaled[1] else None
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    (m, n), k = o_ref.shape, x_ref.shape[1]
    first = pl.program_id(0) * bn
    t = pl.program_id(1)
    group, start, end = tiles_ref[0, t], tiles_ref[1, t], tiles_ref[2, t]
    # BM rows inside x that hold the tile's rows [start, min(start + BM, end))
    window = jnp.minimum(start, m - bm)
    rows = window + jnp.arange(bm, dtype=jnp.int32)
    mask = ((rows >= start) & (rows < end))[:, None]
    if n % bn:
        # (gated only) BN columns inside the output that hold the program's [first, first + BN),
        # the last program's shifted left onto its neighbour's, which it does not store
        col0 = pl.multiple_of(jnp.minimum(first, n - bn), 16)
        mask = mask & (col0 + jnp.arange(bn, dtype=jnp.int32) >= first)[None, :]
    else:
        col0 = pl.multiple_of(first, bn)
    mask = jnp.broadcast_to(mask, (bm, bn))
    target = o_ref.at[pl.ds(window, bm), pl.ds(col0, bn)]
    if gated:
        # one [BM, 2 BN] product over the gate's rows [c, c + BN) and the up's [F + c, F + c + BN),
        # loaded as one [2 BN, BK] weight tile: each MMA step reads the rows' tile once for both
        # (2.4% faster than a product each at 32 slots' rows on the H100, BENCHMARKS.md 2026-12-07)
        j = jnp.arange(2 * bn, dtype=jnp.int32)
        rows_of_w = jnp.where(j < bn, col0 + j, n + col0 + j - bn)
    else:
        rows_of_w = pl.ds(col0, bn)

    @pl.when(group < n_groups)
    def _():
        # the window's rows of x: themselves, or (gathered) the rows row_index names
        source = pl.ds(window, bm) if index_ref is None else index_ref[pl.ds(window, bm)]

        def step(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            x = x_ref[source, pl.ds(k0, bk)]
            w = w_ref[group, rows_of_w, pl.ds(k0, bk)]
            if w.dtype != x.dtype:  # int8 weights: exact in bf16 / f16 / f32 for |q| <= 127
                w = w.astype(x.dtype)
            return acc + dot_t(x, w)

        acc = lax.fori_loop(0, k // bk, step, jnp.zeros((bm, 2 * bn if gated else bn), jnp.float32))
        if xs_ref is not None:
            acc = acc * xs_ref[pl.ds(window, bm)][:, None]
        if ws_ref is not None:
            acc = acc * ws_ref[group, rows_of_w][None, :]
        if gated:
            products = jnp.split(acc, 2, axis=1)
            # gate and up rounded as the plain kernel stores them, then gelu(gate) * up as XLA
            # computes it on those values (each op rounded to the output dtype; gelu_tanh)
            gate, up = (y.astype(o_ref.dtype).astype(jnp.float32) for y in products)
            out = gelu_tanh(gate, o_ref.dtype) * up
        else:
            out = acc
        plgpu.store(target, out.astype(o_ref.dtype), mask=mask)

    @pl.when(group == n_groups)
    def _():
        plgpu.store(target, jnp.zeros((bm, bn), o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("out_dtype", "fill_tail", "interpret", "block_sizes"))
def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    w_scale: jax.Array | None = None,
    x_scale: jax.Array | None = None,
    *,
    out_dtype: Any = jnp.float32,
    fill_tail: bool = True,
    interpret: bool = False,
    block_sizes: GroupedMatmulBlockSizes | None = None,
    row_index: jax.Array | None = None,
) -> jax.Array:
    """x [M, K] (sorted by group) times w [G, N, K] per group -> [M, N] in out_dtype.

    Args:
      x: rows, bf16 / f16 / f32, or float8_e4m3fn with x_scale (W8A8); with row_index, any
        [T, K] rows that row_index picks from.
      w: [G, N, K] in x's dtype, or int8 / float8_e4m3fn with w_scale float32 [G, N].
      group_sizes: int32 [G], rows of each group in order (sum <= M).
      x_scale: float32 [M], each (sorted) row's scale (float8 rows; allowed with any rows).
      fill_tail: write the rows past sum(group_sizes) as zeros (else leave them unwritten).
      row_index: int32 [M] in [0, T): sorted row r is x[row_index[r]], loaded by the kernel
        itself (no [M, K] copy of the gathered rows is written).
    ValueError for dtypes or shapes the kernel does not take (`supports`).
    """
    _check(x, w, group_sizes, w_scale, x_scale, row_index)
    (k, (G, n, _)), m = (x.shape[1], w.shape), (x.shape[0] if row_index is None else row_index.shape[0])
    if not supports(m, n, k):
        raise ValueError(f"x {x.shape} @ w {w.shape}: N and K must be multiples of 16")
    blocks = block_sizes or default_grouped_block_sizes(m, n, k, G)
    if n % blocks.block_n or k % blocks.block_k:
        raise ValueError(
            f"w {w.shape}: N must be a multiple of block_n={blocks.block_n} and K of block_k={blocks.block_k}"
        )
    return _grouped_call(x, w, group_sizes, w_scale, x_scale, row_index, out_dtype, fill_tail, interpret, blocks)


@functools.partial(jax.jit, static_argnames=("out_dtype", "fill_tail", "interpret", "block_sizes"))
def grouped_matmul_gated(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    w_scale: jax.Array | None = None,
    x_scale: jax.Array | None = None,
    *,
    out_dtype: Any = jnp.float32,
    fill_tail: bool = True,
    interpret: bool = False,
    block_sizes: GroupedMatmulBlockSizes | None = None,
    row_index: jax.Array | None = None,
) -> jax.Array:
    """The gated grouped GEMM: y = grouped_matmul(x, w, ...) [M, 2F] -> gelu(y[:, :F]) * y[:, F:] [M, F].

    w [G, 2F, K] is a gated MLP's gate_up weights (rows [0, F) the gate, [F, 2F) the up
    projection); a program computes gate columns [c, c + block_n) and the same up columns
    [F + c, F + c + block_n) from one load of its rows (one [block_m, 2 block_n] float32
    accumulator, so block_n is half the columns it reads), rounds both to out_dtype as grouped_matmul stores them, and
    writes gelu_tanh(gate) * up, computed as XLA computes it on out_dtype values (each op
    rounded; common.gelu_tanh). So it equals grouped_matmul followed by jax.nn.gelu(gate,
    approximate=True) * up in out_dtype but for tanh's last bit (Triton's libdevice tanhf where
    XLA emits its own) and the MMA's summation order. block_n need not divide F (the last
    program's columns overlap its neighbour's); F a multiple of 16, block_n <= F.

    Args: as grouped_matmul's (w_scale float32 [G, 2F]); ValueError for shapes it does not take.
    Returns: [M, F] in out_dtype; rows past sum(group_sizes): zeros, or unwritten without fill_tail.
    """
    _check(x, w, group_sizes, w_scale, x_scale, row_index)
    (k, (G, two_f, _)), m = (x.shape[1], w.shape), (x.shape[0] if row_index is None else row_index.shape[0])
    if not supports_gated(m, two_f, k):
        raise ValueError(f"x {x.shape} @ w {w.shape}: 2F must be a multiple of 32 and K of 16")
    blocks = block_sizes or default_gated_block_sizes(m, two_f // 2, k, G)
    if blocks.block_n > two_f // 2 or k % blocks.block_k:
        raise ValueError(
            f"w {w.shape}: block_n={blocks.block_n} must be at most F={two_f // 2} and divide K by block_k={blocks.block_k}"
        )
    return _grouped_call(
        x, w, group_sizes, w_scale, x_scale, row_index, out_dtype, fill_tail, interpret, blocks, gated=True
    )


def _grouped_call(
    x, w, group_sizes, w_scale, x_scale, row_index, out_dtype, fill_tail, interpret, blocks, gated=False
) -> jax.Array:
    """The pallas_call of both kernels (arguments checked): [M, N], or gated [M, N / 2]."""
    m = x.shape[0] if row_index is None else row_index.shape[0]
    G, n = w.shape[0], (w.shape[1] // 2 if gated else w.shape[1])
    rows = max(m, blocks.block_m)  # fewer rows than a tile: padded (rows in no group)
    if rows > m:
        if row_index is None:
            x = jnp.pad(x, ((0, rows - m), (0, 0)))
        else:
            row_index = jnp.pad(row_index, (0, rows - m))
        x_scale = None if x_scale is None else jnp.pad(x_scale, (0, rows - m), constant_values=1.0)
    tiles = tile_map(group_sizes, rows, blocks.block_m, fill_tail)
    extra = [a for a in (row_index, x_scale, w_scale) if a is not None]
    kernel = functools.partial(
        _kernel,
        n_groups=G,
        blocks=blocks,
        scaled=(x_scale is not None, w_scale is not None),
        gathered=row_index is not None,
        gated=gated,
    )
    out = pl.pallas_call(
        kernel,
        grid=(cdiv(n, blocks.block_n), tiles.shape[1]),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.dtype(out_dtype)),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="grouped_matmul_gated" if gated else "grouped_matmul",
    )(tiles, x, w, *extra)
    return out[:m] if rows > m else out


@functools.partial(jax.jit, static_argnames=("out_dtype", "fill_tail", "interpret", "block_sizes"))
def grouped_matmul_reference(
    x,
    w,
    group_sizes,
    w_scale=None,
    x_scale=None,
    *,
    out_dtype=jnp.float32,
    fill_tail=True,
    interpret=False,
    block_sizes=None,
    row_index=None,
):
    """Pure jnp, the same signature: jax.lax.ragged_dot_general (float32 accumulation; int8
    weights converted to x's dtype) of x's rows (or x[row_index]), times the rows' and their
    groups' scales. Rows past sum(group_sizes) are zeros whatever fill_tail says."""
    del fill_tail, interpret, block_sizes
    _check(x, w, group_sizes, w_scale, x_scale, row_index)
    if row_index is not None:
        x = x[row_index]
    if w.dtype == jnp.int8:
        w = w.astype(x.dtype)
    y = lax.ragged_dot_general(x, w, group_sizes.astype(jnp.int32), _RAGGED, preferred_element_type=jnp.float32)
    if x_scale is not None:
        y = y * x_scale[:, None]
    if w_scale is not None:
        # each row's group (G for rows in no group: their scale row is clamped, their y is 0)
        row_group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right")
        y = y * w_scale[jnp.minimum(row_group, w.shape[0] - 1)]
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "fill_tail", "interpret", "block_sizes"))
def grouped_matmul_gated_reference(
    x,
    w,
    group_sizes,
    w_scale=None,
    x_scale=None,
    *,
    out_dtype=jnp.float32,
    fill_tail=True,
    interpret=False,
    block_sizes=None,
    row_index=None,
):
    """Pure jnp, the same signature: grouped_matmul_reference's [M, 2F] product in out_dtype,
    then jax.nn.gelu(gate, approximate=True) * up on those out_dtype values (as
    dllm_jax.models.experts runs them after the plain GEMM). Rows past sum(group_sizes) are
    zeros whatever fill_tail says."""
    del interpret, block_sizes
    y = grouped_matmul_reference(
        x, w, group_sizes, w_scale, x_scale, out_dtype=out_dtype, fill_tail=fill_tail, row_index=row_index
    )
    f = w.shape[1] // 2
    return jax.nn.gelu(y[:, :f], approximate=True) * y[:, f:]
