"""The Mosaic GPU grouped GEMM (pallas_kernels.matmul.grouped_matmul_mosaic): Mosaic GPU's
interpreter against the ragged_dot reference on fresh random inputs (the interpreter starts
every output as NaN, so an unwritten row shows: the tail rows with fill_tail=False must stay
NaN), its tiling rules, and its lowering for sm_90 at DiffusionGemma 26B-A4B's shapes.

jax 0.10's Mosaic GPU interpreter has no rule for the transposed weight tile (the wgmma's B
operand), so the interpreted cases run under jax 0.11 only; the lowering runs on both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from tolerances import assert_close

from pallas_kernels.matmul.grouped_matmul_mosaic import (
    SMEM_LIMIT,
    MosaicGroupedBlockSizes,
    default_mosaic_grouped_block_sizes,
    grouped_matmul_mosaic,
    grouped_matmul_mosaic_reference,
    supports,
)

pytestmark = pytest.mark.kernels

JAX_0_10 = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)
needs_jax_0_11 = pytest.mark.skipif(JAX_0_10, reason="jax 0.10's Mosaic GPU interpreter has no transposed-tile rule")

ONE_WG = MosaicGroupedBlockSizes(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, compute_wgs=1)
TWO_WGS = MosaicGroupedBlockSizes(block_m=64, block_n=128, block_k=64, max_concurrent_steps=3, compute_wgs=2)
# 128 rows per warpgroup, every wgmma awaited at once
TALL = MosaicGroupedBlockSizes(block_m=128, block_n=64, block_k=128, max_concurrent_steps=2, wgmma_in_flight=0)


def ragged_sizes(rng, tile_rows: int) -> tuple[np.ndarray, int]:
    """Group sizes and M: a group smaller than a tile, an empty group, a group of several
    tiles ending mid-tile, another empty group, a small last group, then 1..tile_rows tail
    rows in no group (the sizes random within those bounds)."""
    sizes = np.array(
        [
            rng.integers(1, tile_rows // 2),
            0,
            rng.integers(2 * tile_rows + 1, 3 * tile_rows - 1),
            0,
            rng.integers(1, tile_rows),
        ],
        np.int32,
    )
    return sizes, int(sizes.sum() + rng.integers(1, tile_rows))


def random_operands(rng, m: int, n: int, k: int, groups: int):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((groups, n, k)) / np.sqrt(k), jnp.bfloat16)
    return x, w


def check(got, want, sizes, fill_tail: bool, dtype) -> None:
    """Grouped rows close to the reference; tail rows zeros (fill_tail) or unwritten (NaN)."""
    used = int(np.sum(sizes))
    got = np.asarray(got, np.float32)
    assert np.isfinite(got[:used]).all(), "a grouped row was not written"
    assert_close(got[:used], np.asarray(want, np.float32)[:used], dtype, "grouped rows")
    if fill_tail:
        assert (got[used:] == 0).all(), "tail rows are not zeros"
    else:
        assert np.isnan(got[used:]).all(), "a tail row was written"


@needs_jax_0_11
@pytest.mark.parametrize("blocks", [ONE_WG, TWO_WGS, TALL], ids=["1wg", "2wg", "1wg-128rows"])
@pytest.mark.parametrize("fill_tail, out_dtype", [(True, jnp.bfloat16), (False, jnp.float32)])
def test_matches_reference_on_ragged_groups_and_writes_only_their_rows(blocks, fill_tail, out_dtype):
    rng = np.random.default_rng()
    sizes, m = ragged_sizes(rng, blocks.tile_rows)
    x, w = random_operands(rng, m, 2 * blocks.block_n, 2 * blocks.block_k, len(sizes))
    args = (x, w, jnp.asarray(sizes))
    got = grouped_matmul_mosaic(*args, out_dtype=out_dtype, fill_tail=fill_tail, interpret=True, block_sizes=blocks)
    want = grouped_matmul_mosaic_reference(*args, out_dtype=out_dtype)
    assert got.shape == (m, w.shape[1]) and got.dtype == out_dtype
    check(got, want, sizes, fill_tail, out_dtype)


@needs_jax_0_11
@pytest.mark.parametrize("routing", ["one", "fewer rows than a tile"])
def test_one_group_and_fewer_rows_than_a_tile(routing):
    """Every row to one random group (its last tile's window clamped to x's end); or M below
    one tile (x padded), its rows split over two groups and a tail."""
    rng = np.random.default_rng()
    blocks = TWO_WGS
    if routing == "one":
        m = int(rng.integers(2 * blocks.tile_rows + 1, 3 * blocks.tile_rows))
        sizes = np.zeros(3, np.int32)
        sizes[rng.integers(3)] = m
    else:
        m = int(rng.integers(12, blocks.tile_rows - 8))
        sizes = np.array([rng.integers(1, m // 3), 0, rng.integers(1, m // 3)], np.int32)
    x, w = random_operands(rng, m, 128, 192, len(sizes))
    args = (x, w, jnp.asarray(sizes))
    got = grouped_matmul_mosaic(*args, out_dtype=jnp.float32, fill_tail=False, interpret=True, block_sizes=blocks)
    check(got, grouped_matmul_mosaic_reference(*args), sizes, False, jnp.float32)


@pytest.mark.parametrize("slots", [1, 8, 32])
@pytest.mark.parametrize("n, k", [(1408, 2816), (2816, 704)], ids=["gate_up", "down"])
def test_default_tiling_takes_the_26b_a4b_shapes(slots, n, k):
    m = slots * 256 * 8
    blocks = default_mosaic_grouped_block_sizes(m, n, k, 128)
    assert supports(m, n, k, blocks)
    assert blocks.smem_bytes() <= SMEM_LIMIT
    # one warpgroup for 16 rows per group, two for more; tiles no taller than twice the mean group
    assert blocks.compute_wgs == (1 if slots == 1 else 2)
    assert blocks.tile_rows <= max(64, 2 * m // 128)


def test_invalid_arguments_raise_value_error_naming_them():
    x, w, sizes = jnp.zeros((64, 128), jnp.bfloat16), jnp.zeros((2, 128, 128), jnp.bfloat16), jnp.array([10, 20])
    with pytest.raises(ValueError, match="block_m"):
        MosaicGroupedBlockSizes(block_m=32)
    with pytest.raises(ValueError, match="block_n"):
        MosaicGroupedBlockSizes(block_n=96)
    with pytest.raises(ValueError, match="compute_wgs"):
        MosaicGroupedBlockSizes(compute_wgs=3)
    with pytest.raises(ValueError, match="bfloat16 operands"):
        grouped_matmul_mosaic(x.astype(jnp.float32), w, sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul_mosaic(x, w, sizes[:1])
    with pytest.raises(ValueError, match="N % 256"):
        grouped_matmul_mosaic(x, w, sizes, block_sizes=MosaicGroupedBlockSizes(block_n=256))
    deep = MosaicGroupedBlockSizes(block_m=128, block_n=256, max_concurrent_steps=8)
    with pytest.raises(ValueError, match="shared memory"):
        grouped_matmul_mosaic(x, jnp.zeros((2, 256, 128), jnp.bfloat16), sizes, block_sizes=deep)


@pytest.mark.parametrize(
    "blocks", [None, ONE_WG, MosaicGroupedBlockSizes(128, 128, 64, 3, 2)], ids=["default", "1wg", "2wg-128rows"]
)
@pytest.mark.parametrize("n, k", [(1408, 2816), (2816, 704)], ids=["gate_up", "down"])
def test_lowers_for_sm90_at_the_26b_a4b_shapes(blocks, n, k):
    """One Mosaic GPU kernel, named, at 8 slots' 16384 rows of 128 experts; no ragged dot
    (XLA:GPU's dense rewrite) is left in the program."""
    spec = jax.ShapeDtypeStruct
    x, w, sizes = spec((16384, k), jnp.bfloat16), spec((128, n, k), jnp.bfloat16), spec((128,), jnp.int32)
    text = lower_for_cuda(grouped_matmul_mosaic, x, w, sizes, out_dtype=jnp.bfloat16, block_sizes=blocks)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "grouped_matmul_mosaic" in text
    assert "ragged_dot" not in text
