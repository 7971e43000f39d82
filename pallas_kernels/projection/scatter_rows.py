"""Writes K and V rows into their rows of the layer-stacked flat cache, in place.

XLA's scatter of [N, kv_dim] rows into the flat cache ran at about 0.23 TB/s on the H200
(9 ms of a 114 ms step at 32 slots, LLaDA-8B shapes); this kernel is a plain row-scattered
copy: each program loads a [block_rows, block_cols] tile of K (or V) and stores it to the
tile's cache rows. Bytes: N * kv_dim * 2 read + the same written, for K and V.

With drop=True, rows named outside the cache ([0, M)) are not written, as XLA's scatter with
mode="drop" leaves them, and a program whose rows are all outside loads nothing: DiffusionGemma's canvas
passes name the cache's length for the rows they do not write (its denoising passes write
none), where XLA's scatter still spent 12-22 us per call, 1.2 ms per 32-slot 26B-A4B step, on
the H100 (2026-12-07).

Used by the XLA projection path (backend "auto" on NVIDIA GPUs) and DiffusionGemma's canvas
passes (Kernels.canvas_scatter); the fused projection kernel (qkv_rope_cache) writes the cache
itself.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import cdiv, check_float, check_launch, check_power_of_two, compiler_params, is_power_of_two


@dataclasses.dataclass(frozen=True)
class ScatterBlockSizes:
    """block_rows x block_cols tile per program (powers of two), Triton launch parameters."""

    block_rows: int = 32
    block_cols: int = 512
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_power_of_two("block_rows", self.block_rows, 1)
        check_power_of_two("block_cols", self.block_cols, 16)
        check_launch(self.num_warps, self.num_stages)


def default_scatter_block_sizes(kv_width: int) -> ScatterBlockSizes:
    return ScatterBlockSizes(block_cols=min(512, kv_width))


def supports(kv_width: int) -> bool:
    """Whether the default tiling takes rows of this width (its column blocks: a power of two
    >= 16 dividing it)."""
    block = min(512, kv_width)
    return is_power_of_two(block) and block >= 16 and kv_width % block == 0


def _scatter_kernel(
    layer_ref, rows_ref, k_vals_ref, v_vals_ref, _k_in, _v_in, k_ref, v_ref, *, blocks, n_col_blocks, drop
):
    br, bc = blocks.block_rows, blocks.block_cols
    row0 = pl.program_id(0) * br
    chunk = pl.program_id(1)
    layer = layer_ref[0]
    rows = rows_ref[pl.ds(row0, br)]
    if drop:
        m = k_ref.shape[1]
        written = (rows >= 0) & (rows < m)
        mask = jnp.broadcast_to(written[:, None], (br, bc))
        # dropped rows point past the cache (interpret mode's masked store gathers and scatters
        # every lane: a negative row would wrap onto the last one)
        rows = jnp.where(written, rows, m)
        some = jnp.max(written.astype(jnp.int32)) > 0
        when = lambda condition: pl.when(some & condition)  # noqa: E731
    else:
        mask, when = None, pl.when
    rows = rows[:, None]

    def copy(vals_ref, cache_ref, col0):
        cols = col0 + jnp.arange(bc, dtype=jnp.int32)[None, :]
        plgpu.store(cache_ref.at[layer, rows, cols], vals_ref[pl.ds(row0, br), pl.ds(col0, bc)], mask=mask)

    @when(chunk < n_col_blocks)
    def _k():
        copy(k_vals_ref, k_ref, chunk * bc)

    @when(chunk >= n_col_blocks)
    def _v():
        copy(v_vals_ref, v_ref, (chunk - n_col_blocks) * bc)


def _check(k_cache, v_cache, k_rows, v_rows, rows):
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k_rows", k_rows), ("v_rows", v_rows)):
        check_float(name, x)
    if k_cache.ndim != 3 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape}: expected equal [NL, M, kv_width] arrays")
    n, width = rows.shape[0], k_cache.shape[2]
    for name, x in (("k_rows", k_rows), ("v_rows", v_rows)):
        if x.shape != (n, width) or x.dtype != k_cache.dtype:
            raise ValueError(f"{name} {x.shape} {x.dtype}: expected ({n}, {width}) {k_cache.dtype}")
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"rows {rows.shape} {rows.dtype}: expected int [N]")


@functools.partial(jax.jit, static_argnames=("drop", "interpret", "block_sizes"), donate_argnums=(0, 1))
def scatter_kv_rows(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_rows: jax.Array,
    v_rows: jax.Array,
    rows: jax.Array,
    layer: jax.Array,
    *,
    drop: bool = False,
    interpret: bool = False,
    block_sizes: ScatterBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """k_cache[layer, rows[i]] = k_rows[i] and the same for v, in place.

    k_cache, v_cache: [NL, M, W]; k_rows, v_rows: [N, W] in the cache dtype; rows: int32 [N]
    cache rows (no two rows in [0, M) equal unless their values are equal, e.g. padding rows
    that all write one trash row); layer: int32 scalar. drop: rows outside [0, M) are dropped
    (not written), else every row must be inside (the kernel LLaDA's step was measured with:
    no masks). Returns the updated caches.
    """
    _check(k_cache, v_cache, k_rows, v_rows, rows)
    n, width = k_rows.shape
    blocks = block_sizes or default_scatter_block_sizes(width)
    if width % blocks.block_cols:
        raise ValueError(f"kv width {width} is not a multiple of block_cols={blocks.block_cols}")
    pad = cdiv(n, blocks.block_rows) * blocks.block_rows - n
    rows = rows.astype(jnp.int32)
    if pad and drop:
        rows = jnp.pad(rows, (0, pad), constant_values=-1)
        k_rows, v_rows = (jnp.pad(x, ((0, pad), (0, 0))) for x in (k_rows, v_rows))
    elif pad:
        # padding rows repeat the last row: the same value to the same place
        rows = jnp.concatenate([rows, jnp.broadcast_to(rows[-1:], (pad,))])
        k_rows = jnp.concatenate([k_rows, jnp.broadcast_to(k_rows[-1:], (pad, width))])
        v_rows = jnp.concatenate([v_rows, jnp.broadcast_to(v_rows[-1:], (pad, width))])
    n_col_blocks = width // blocks.block_cols
    kernel = functools.partial(_scatter_kernel, blocks=blocks, n_col_blocks=n_col_blocks, drop=drop)
    return pl.pallas_call(
        kernel,
        grid=((n + pad) // blocks.block_rows, 2 * n_col_blocks),
        out_shape=(
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ),
        input_output_aliases={4: 0, 5: 1},
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="scatter_kv_rows",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), rows, k_rows, v_rows, k_cache, v_cache)


@functools.partial(jax.jit, static_argnames=("drop", "interpret", "block_sizes"), donate_argnums=(0, 1))
def scatter_kv_rows_reference(
    k_cache, v_cache, k_rows, v_rows, rows, layer, *, drop=False, interpret=False, block_sizes=None
):
    """Pure jnp: the same update through XLA's scatter (drop: rows outside [0, M) dropped)."""
    del drop, interpret, block_sizes
    _check(k_cache, v_cache, k_rows, v_rows, rows)
    # negative rows would count from the end: moved past it, where mode="drop" drops them
    rows = jnp.where(rows < 0, k_cache.shape[1], rows)
    return k_cache.at[layer, rows].set(k_rows, mode="drop"), v_cache.at[layer, rows].set(v_rows, mode="drop")
