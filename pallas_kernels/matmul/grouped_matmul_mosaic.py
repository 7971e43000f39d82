"""Grouped GEMM for routed experts on Hopper (Pallas Mosaic GPU): rows sorted by group times
their group's weights [G, N, K], bfloat16 operands, float32 accumulation.

    y[r] = x[r] . w[g(r)].T        (x [M, K] sorted by group, w [G, N, K] torch's [out, in])

The Mosaic GPU version of ``pallas_kernels.matmul.grouped_matmul`` for its bf16 path (same
arguments less the 8-bit scales, same reference: ``grouped_matmul_reference``). The Triton
kernel reaches 15-30% of the H200's bf16 MMA rate at thousands of rows per group; this one
feeds wgmma from TMA-loaded, swizzled shared memory through a multi-stage pipeline over K.

Tiles. The rows are cut as the Triton kernel cuts them (``grouped_matmul.tile_map``: each
group's rows in tiles of ``tile_rows`` from the group's first row, the tail after them), and
the map is read as three scalars per tile from GMEM. A program owns one row tile and
``block_n`` output columns; the grid is (tiles, N / block_n) with the columns fastest, so the
programs of one row tile run side by side (its x from L2) and the tiles of one group follow
each other (its weights from L2). A program loads the ``tile_rows`` rows of a window that
stays inside x (min(first row, M - tile_rows)), so no TMA load leaves the array.

Warpgroups. With ``compute_wgs`` 2, a third (memory) warpgroup streams the x and w tiles
through the stages (plgpu.emit_pipeline_warp_specialized) and the two compute warpgroups
share each [block_n, block_k] weight tile, each taking ``block_m`` of the tile's rows; with 1,
one warpgroup issues the copies and the wgmmas (plgpu.emit_pipeline). The weights are read as
stored, [block_n, block_k] K-major tiles, and given to wgmma as a transposed view.

Stores. A tile's rows of its own group only are written: the rounded accumulator goes to a
plain (unswizzled) shared-memory tile, and its rows [first, first + count) leave in at most
log2(block_m) + 1 bulk copies of 2^i rows (the binary digits of count: a TMA box has a static
size), so rows of a neighbouring group, written by another program, are never touched. Full
tiles leave in one copy. Tail rows (past sum(group_sizes)) are written as zeros with
fill_tail=True, left unwritten with fill_tail=False (grouped_matmul's contract).

Requirements: an sm_90 GPU; x and w bfloat16; N a multiple of block_n and K of block_k
(multiples of 64; `supports`); M >= 1 (fewer rows than a tile are padded). CPU tests run
Mosaic GPU's interpreter (``interpret=True``, jax >= 0.11: jax 0.10's interpreter has no rule
for the transposed weight tile) and lower the kernel for sm_90 on both jax versions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv
from pallas_kernels.matmul.grouped_matmul import grouped_matmul_reference, tile_map
from pallas_kernels.projection.qkv_rope_cache_mosaic import _swizzled, _transposed, interpret_params

# a block's shared memory on Hopper (227 KiB) less the pipeline's barriers
SMEM_LIMIT = 227 * 1024 - 1024


@dataclasses.dataclass(frozen=True)
class MosaicGroupedBlockSizes:
    """Tiling of the Mosaic GPU grouped GEMM.

    Attributes:
      block_m: rows per compute warpgroup, 64 or 128 (wgmma's M); a row tile holds
        compute_wgs * block_m rows (`tile_rows`), all of one group.
      block_n: output columns per program, a multiple of 64 up to 256 (wgmma's N; a row of
        the output tile then spans whole 128-byte lines, so a bulk store may start at any row).
      block_k: reduction step per pipeline stage, a multiple of 64 (128-byte swizzled rows).
      max_concurrent_steps: shared-memory stages of the x and w tiles.
      compute_wgs: 1 = one warpgroup copies and multiplies (plgpu.emit_pipeline); 2 = two
        compute warpgroups share each weight tile, fed by a memory warpgroup.
      wgmma_in_flight: wgmma groups a step leaves running (0 or 1; with 1 a step's tiles are
        released one step later).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    compute_wgs: int = 2
    wgmma_in_flight: int = 1

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m={self.block_m!r}: expected 64 or 128")
        if not isinstance(self.block_n, int) or self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"block_n={self.block_n!r}: expected a multiple of 64 in [64, 256]")
        if not isinstance(self.block_k, int) or self.block_k <= 0 or self.block_k % 64:
            raise ValueError(f"block_k={self.block_k!r}: expected a positive multiple of 64")
        if not isinstance(self.max_concurrent_steps, int) or not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps!r}: expected an int in [2, 8]")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"compute_wgs={self.compute_wgs!r}: expected 1 or 2")
        if self.wgmma_in_flight not in (0, 1) or self.wgmma_in_flight >= self.max_concurrent_steps:
            raise ValueError(f"wgmma_in_flight={self.wgmma_in_flight!r}: expected 0 or 1")

    @property
    def tile_rows(self) -> int:
        """Rows of one row tile (one program)."""
        return self.compute_wgs * self.block_m

    @property
    def name(self) -> str:
        return (
            f"{self.compute_wgs}x{self.block_m}x{self.block_n}x{self.block_k} "
            f"s{self.max_concurrent_steps} f{self.wgmma_in_flight}"
        )

    def smem_bytes(self, out_dtype: Any = jnp.bfloat16) -> int:
        """Shared memory: the pipeline's bf16 x and w stages and one output tile per warpgroup."""
        stage = (self.tile_rows + self.block_n) * self.block_k * 2
        return self.max_concurrent_steps * stage + self.tile_rows * self.block_n * jnp.dtype(out_dtype).itemsize


def default_mosaic_grouped_block_sizes(
    m: int, n: int, k: int, groups: int, out_dtype: Any = jnp.bfloat16
) -> MosaicGroupedBlockSizes:
    """A first guess until measured on the H200 (scripts/gpu/grouped_gemm.py times a few).

    Row tiles near the mean rows per group: one 64-row warpgroup up to 64 rows per group (one
    slot of DiffusionGemma: 16), two warpgroups of 64 up to 256 (8 slots: 128), two of 128
    above (32 slots: 512). 128 output columns (they divide both products' N, 1408 and 2816),
    64-wide reduction steps (704 = 11 x 64), the deepest pipeline (<= 4) that fits.
    """
    del k
    mean = m / max(groups, 1)
    if mean <= 64:
        wgs, block_m = 1, 64
    elif mean <= 256:
        wgs, block_m = 2, 64
    else:
        wgs, block_m = 2, 128
    blocks = MosaicGroupedBlockSizes(
        block_m=block_m, block_n=128 if n % 128 == 0 else 64, block_k=64, max_concurrent_steps=4, compute_wgs=wgs
    )
    while blocks.smem_bytes(out_dtype) > SMEM_LIMIT and blocks.max_concurrent_steps > 2:
        blocks = dataclasses.replace(blocks, max_concurrent_steps=blocks.max_concurrent_steps - 1)
    return blocks


def supports(m: int, n: int, k: int, blocks: MosaicGroupedBlockSizes, out_dtype: Any = jnp.bfloat16) -> bool:
    """Whether the kernel takes these shapes with this tiling (tiles divide N and K, shared
    memory fits)."""
    return m >= 1 and n % blocks.block_n == 0 and k % blocks.block_k == 0 and blocks.smem_bytes(out_dtype) <= SMEM_LIMIT


def _check(x, w, group_sizes, out_dtype):
    if x.ndim != 2 or w.ndim != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"x {x.shape} and w {w.shape}: expected [M, K] and [G, N, K]")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"x {x.dtype}, w {w.dtype}: the Mosaic GPU grouped GEMM takes bfloat16 operands")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes {group_sizes.shape} {group_sizes.dtype}: expected int32 [{w.shape[0]}]")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype={out_dtype}: expected bfloat16 or float32")


def _kernel(tiles_ref, x_ref, w_ref, o_ref, o_smem, *, n_groups: int, blocks: MosaicGroupedBlockSizes):
    """One (row tile, column tile) program.

    tiles_ref int32 [3, T] (GMEM): per tile its group (n_groups: the tail, more: unused), first
    row and its group's end row; x_ref [rows, K], w_ref [G, N, K] bf16; o_ref [rows, N];
    o_smem [compute_wgs, block_m, block_n] (out dtype): each warpgroup's rounded tile.
    """
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    specialized = blocks.compute_wgs > 1
    rows, k = x_ref.shape
    t = lax.axis_index("tiles")
    cols = pl.ds(lax.axis_index("cols") * bn, bn)
    group, start, end = tiles_ref[0, t], tiles_ref[1, t], tiles_ref[2, t]
    window = jnp.minimum(start, rows - blocks.tile_rows)  # the tile's rows lie in [window, window + tile_rows)
    first = start - window
    count = jnp.minimum(end, start + blocks.tile_rows) - start  # <= 0 for an unused tile
    in_flight = blocks.wgmma_in_flight

    def store(wg, value):
        """value [bm, bn] (warpgroup wg's rows of the window) through its shared-memory tile;
        only the rows in [first, first + count) leave, in power-of-two runs."""
        tile = o_smem.at[wg]
        tile[...] = value.astype(o_smem.dtype)
        plgpu.commit_smem()
        lo = jnp.clip(first - wg * bm, 0, bm)
        size = jnp.clip(first + count - wg * bm, 0, bm) - lo
        offset = lo
        run = 1 << (bm.bit_length() - 1)
        while run:

            @pl.when((size & run) != 0)
            def _(run=run, offset=offset):
                row = window + wg * bm + offset
                plgpu.copy_smem_to_gmem(tile.at[pl.ds(offset, run)], o_ref.at[pl.ds(row, run), cols])

            offset = offset + (size & run)
            run //= 2

    x_tiles = x_ref.at[pl.ds(window, blocks.tile_rows)]
    w_tiles = w_ref.at[jnp.minimum(group, n_groups - 1), cols]
    in_specs = [
        plgpu.BlockSpec(
            (blocks.tile_rows, bk), lambda i: (0, i), transforms=_swizzled(bk, x_ref.dtype), delay_release=in_flight
        ),
        plgpu.BlockSpec((bn, bk), lambda i: (0, i), transforms=_swizzled(bk, w_ref.dtype), delay_release=in_flight),
    ]

    def multiply_single():
        def accumulate(acc_ref):
            def step(_, x_tile, w_tile):
                plgpu.wgmma(acc_ref, x_tile, _transposed(w_tile))
                plgpu.wgmma_wait(in_flight)  # the tiles released by this step are no longer read

            plgpu.emit_pipeline(
                step, grid=(k // bk,), in_specs=in_specs, max_concurrent_steps=blocks.max_concurrent_steps
            )(x_tiles, w_tiles)
            return acc_ref[...]

        store(0, pl.run_scoped(accumulate, plgpu.ACC((bm, bn), jnp.float32)))

    def multiply_specialized():
        def step(_, x_tile, w_tile, acc_ref):
            plgpu.wgmma(acc_ref, x_tile.at[pl.ds(lax.axis_index("wg") * bm, bm)], _transposed(w_tile))
            plgpu.wgmma_wait(in_flight)
            return acc_ref

        def compute_context(run_pipeline):
            def accumulate(acc_ref):
                run_pipeline(acc_ref)
                return acc_ref[...]

            store(lax.axis_index("wg"), pl.run_scoped(accumulate, plgpu.ACC((bm, bn), jnp.float32)))

        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k // bk,),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=blocks.compute_wgs,
            max_concurrent_steps=blocks.max_concurrent_steps,
            compute_context=compute_context,
        )(x_tiles, w_tiles)

    pl.when(group < n_groups)(multiply_specialized if specialized else multiply_single)

    @pl.when(group == n_groups)
    def _tail():
        if specialized:
            wg = lax.axis_index("wg")
            pl.when(wg < blocks.compute_wgs)(lambda: store(wg, jnp.zeros((bm, bn), jnp.float32)))
        else:
            store(0, jnp.zeros((bm, bn), jnp.float32))

    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("out_dtype", "fill_tail", "interpret", "block_sizes"))
def grouped_matmul_mosaic(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: Any = jnp.float32,
    fill_tail: bool = True,
    interpret: bool = False,
    block_sizes: MosaicGroupedBlockSizes | None = None,
) -> jax.Array:
    """x [M, K] (sorted by group) times w [G, N, K] per group -> [M, N] in out_dtype, Mosaic GPU.

    Args:
      x: bfloat16 [M, K], the rows of group 0, then group 1, ...; rows past sum(group_sizes)
        belong to no group.
      w: bfloat16 [G, N, K], one [out, in] matrix per group.
      group_sizes: int32 [G], rows of each group in order (sum <= M).
      out_dtype: bfloat16 or float32 (rounded once from the float32 accumulator).
      fill_tail: write the rows past sum(group_sizes) as zeros (else leave them unwritten).
      interpret: run Mosaic GPU's interpreter (CPU; jax >= 0.11).
      block_sizes: the tiling; default_mosaic_grouped_block_sizes when None.
    Returns:
      [M, N] in out_dtype. ValueError for dtypes, shapes or a tiling the kernel does not take.
    """
    _check(x, w, group_sizes, out_dtype)
    (m, k), (G, n, _) = x.shape, w.shape
    blocks = block_sizes or default_mosaic_grouped_block_sizes(m, n, k, G, out_dtype)
    if not supports(m, n, k, blocks, out_dtype):
        raise ValueError(
            f"x {x.shape} @ w {w.shape}: tiling {blocks.name} needs N % {blocks.block_n} == 0, "
            f"K % {blocks.block_k} == 0 and {blocks.smem_bytes(out_dtype)} bytes of shared memory <= {SMEM_LIMIT}"
        )
    # rows in no group appended up to a whole tile and a multiple of 8 (TMA's row tiling; the
    # engine's M, slots x 256 x 8, needs none)
    rows = max(cdiv(m, 8) * 8, blocks.tile_rows)
    if rows > m:
        x = jnp.pad(x, ((0, rows - m), (0, 0)))
    tiles = tile_map(group_sizes, rows, blocks.tile_rows, fill_tail)
    wgs = blocks.compute_wgs

    def entry(tiles_ref, x_ref, w_ref, o_ref):
        pl.run_scoped(
            lambda o_smem: _kernel(tiles_ref, x_ref, w_ref, o_ref, o_smem, n_groups=G, blocks=blocks),
            plgpu.SMEM((wgs, blocks.block_m, blocks.block_n), jnp.dtype(out_dtype)),
            **(dict(collective_axes="wg") if wgs > 1 else {}),
        )

    threads = dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}
    out = pl.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((rows, n), jnp.dtype(out_dtype)),
        mesh=plgpu.Mesh(grid=(tiles.shape[1], n // blocks.block_n), grid_names=("tiles", "cols"), **threads),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params() if interpret else False,
        name="grouped_matmul_mosaic",
    )(tiles, x, w)
    return out[:m] if rows > m else out


def grouped_matmul_mosaic_reference(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: Any = jnp.float32,
    fill_tail: bool = True,
    interpret: bool = False,
    block_sizes: MosaicGroupedBlockSizes | None = None,
) -> jax.Array:
    """Pure jnp, the same signature: grouped_matmul_reference (jax.lax.ragged_dot_general,
    float32 accumulation; rows past sum(group_sizes) are zeros whatever fill_tail says)."""
    del interpret, block_sizes
    _check(x, w, group_sizes, out_dtype)
    return grouped_matmul_reference(x, w, group_sizes, out_dtype=out_dtype, fill_tail=fill_tail)
