"""The grouped GEMM of the routed experts (pallas_kernels.matmul.grouped_matmul): in interpret
mode against its jax.lax.ragged_dot reference on fresh random inputs (interpret mode starts
every output as NaN, so an unwritten row shows), plain, int8 and fp8; the routed experts through
it equal the jax.lax path (empty experts, every row to one expert, a device's block of experts
under a mesh); the kernel routing; and the CUDA (Triton) lowering at the 26B-A4B shapes and of
the DiffusionGemma canvas loop, whose program then holds no ragged dot (the op XLA:GPU rewrites
into a dense product with every expert)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import GPU_AUTO, lower_for_cuda
from diffusion_gemma_small import small_config
from tolerances import assert_close

import dllm_jax.common.platform
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.diffusion_gemma_config import DiffusionGemmaConfig
from dllm_jax.models.experts import expert_mlp_with, grouped_expert_mlp, routed_sum
from dllm_jax.models.gemma_layers import gelu_tanh
from dllm_jax.models.quantization import quantize_experts
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.expert_sharding import sharded_expert_mlp
from dllm_jax.runtime.kernel_routing import Kernels, grouped_gemm, resolve_kernels
from dllm_jax.runtime.sharding import EXPERT_ROWS, parse_mesh
from dllm_jax.runtime.slots import zero_sampling
from pallas_kernels.common import gelu_tanh as kernel_gelu_tanh
from pallas_kernels.matmul.grouped_matmul import (
    GroupedMatmulBlockSizes,
    default_gated_block_sizes,
    default_grouped_block_sizes,
    grouped_matmul,
    grouped_matmul_gated,
    grouped_matmul_gated_reference,
    grouped_matmul_reference,
    tile_map,
)

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

TRITON = "__gpu$xla.gpu.triton"
FP8 = jnp.float8_e4m3fn


def group_sizes(rng, m: int, groups: int, routing: str) -> np.ndarray:
    """Rows per group: "spread" (random, two groups emptied, a few rows in no group), "one"
    (every row to one random group), "tail" (half the rows in no group)."""
    sizes = np.zeros(groups, np.int64)
    if routing == "one":
        sizes[rng.integers(groups)] = m
    else:
        used = m - (m // 2 if routing == "tail" else int(rng.integers(0, 4)))
        sizes = rng.multinomial(used, np.ones(groups) / groups)
        empty = rng.choice(groups, 2, replace=False)
        sizes[empty[1]] += sizes[empty[0]]
        sizes[empty[0]] = 0
    return sizes.astype(np.int32)


def random_case(rng, m, n, k, groups, kind, routing):
    """(x, w, group_sizes, w_scale, x_scale) of a weight kind: bf16 / f32 plain, int8 (bf16 rows), fp8."""
    x = rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1))
    sizes = jnp.asarray(group_sizes(rng, m, groups, routing))
    w_scale = jnp.asarray(rng.uniform(1e-3, 1e-1, (groups, n)), jnp.float32)
    if kind in ("bf16", "f32"):
        dtype = jnp.bfloat16 if kind == "bf16" else jnp.float32
        return (
            jnp.asarray(x, dtype),
            jnp.asarray(rng.standard_normal((groups, n, k)) / k**0.5, dtype),
            sizes,
            None,
            None,
        )
    if kind == "int8":
        w = jnp.asarray(rng.integers(-127, 128, (groups, n, k)), jnp.int8)
        return jnp.asarray(x, jnp.bfloat16), w, sizes, w_scale, None
    x_scale = jnp.asarray(np.abs(x).max(-1) / 448.0, jnp.float32)
    xq = jnp.asarray(x / np.asarray(x_scale)[:, None], jnp.float32).astype(FP8)
    w = jnp.asarray(rng.uniform(-448, 448, (groups, n, k)), jnp.float32).astype(FP8)
    return xq, w, sizes, w_scale, x_scale


@pytest.mark.parametrize(
    "m, n, k, groups, kind, routing, blocks",
    [
        (40, 32, 48, 4, "f32", "spread", GroupedMatmulBlockSizes(16, 16, 16)),  # tiles across group edges
        (100, 64, 64, 8, "bf16", "tail", None),  # default tiling, half the rows in no group
        (37, 32, 32, 4, "bf16", "one", GroupedMatmulBlockSizes(32, 32, 16)),  # all rows to one group
        (70, 32, 64, 5, "int8", "spread", GroupedMatmulBlockSizes(16, 32, 32)),
        (50, 48, 64, 4, "fp8", "spread", GroupedMatmulBlockSizes(16, 16, 32)),
        (9, 16, 16, 3, "f32", "spread", None),  # fewer rows than a tile (padded)
    ],
)
def test_kernel_equals_its_reference(m, n, k, groups, kind, routing, blocks):
    rng = np.random.default_rng()
    x, w, sizes, w_scale, x_scale = random_case(rng, m, n, k, groups, kind, routing)
    out_dtype = jnp.bfloat16 if kind == "bf16" else jnp.float32
    run = dict(out_dtype=out_dtype)
    got = grouped_matmul(x, w, sizes, w_scale, x_scale, interpret=True, block_sizes=blocks, **run)
    want = grouped_matmul_reference(x, w, sizes, w_scale, x_scale, **run)
    assert got.shape == (m, n) and got.dtype == out_dtype
    assert np.isfinite(np.asarray(got, np.float32)).all(), "a row was not written"
    assert_close(got, want, jnp.bfloat16 if kind in ("bf16", "int8") else jnp.float32, f"grouped GEMM {kind}")
    tail = int(jnp.sum(sizes))
    assert not np.asarray(got[tail:], np.float32).any(), "rows in no group are zeros"
    # and the reference against float64 per row
    groups_of = np.repeat(np.arange(groups), np.asarray(sizes))
    w64 = np.asarray(w, np.float64) * (1.0 if w_scale is None else np.asarray(w_scale)[:, :, None])
    x64 = np.asarray(x, np.float64) * (1.0 if x_scale is None else np.asarray(x_scale)[:, None])
    exact = np.stack([w64[g] @ x64[r] for r, g in enumerate(groups_of)]) if tail else np.zeros((0, n))
    assert_close(want[:tail], exact, out_dtype, "reference")


@pytest.mark.parametrize(
    "m, tokens, kind, blocks",
    [
        (60, 24, "bf16", GroupedMatmulBlockSizes(16, 32, 32)),  # each token row picked ~2.5 times
        (50, 80, "fp8", GroupedMatmulBlockSizes(16, 16, 32)),  # row scales per sorted row
        (9, 5, "f32", None),  # fewer sorted rows than a tile: the index is padded, not x
    ],
)
def test_gathered_rows_equal_the_kernel_on_their_copy(m, tokens, kind, blocks):
    rng = np.random.default_rng()
    x, w, sizes, w_scale, _ = random_case(rng, tokens, 32, 64, 4, kind, "spread")
    index = jnp.asarray(rng.integers(0, tokens, m), jnp.int32)
    sizes = jnp.asarray(group_sizes(rng, m, 4, "spread"))
    x_scale = jnp.asarray(rng.uniform(0.5, 2.0, m), jnp.float32) if kind == "fp8" else None
    run = dict(out_dtype=jnp.float32, interpret=True, block_sizes=blocks)
    got = grouped_matmul(x, w, sizes, w_scale, x_scale, row_index=index, **run)
    copied = grouped_matmul(x[index], w, sizes, w_scale, x_scale, **run)
    assert got.shape == (m, 32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(copied))  # the same tiles, the same sums
    want = grouped_matmul_reference(x, w, sizes, w_scale, x_scale, row_index=index)
    np.testing.assert_array_equal(
        np.asarray(want), np.asarray(grouped_matmul_reference(x[index], w, sizes, w_scale, x_scale))
    )
    assert_close(got, want, jnp.float32, f"gathered grouped GEMM {kind}")


def test_the_tail_is_left_unwritten_without_fill_tail():
    rng = np.random.default_rng()
    x, w, sizes, _, _ = random_case(rng, 48, 32, 32, 4, "f32", "tail")
    got = np.asarray(grouped_matmul(x, w, sizes, fill_tail=False, interpret=True))
    tail = int(jnp.sum(sizes))
    assert np.isnan(got[tail:]).all(), "interpret mode's NaN: no tile stored the tail"
    assert_close(got[:tail], grouped_matmul_reference(x, w, sizes)[:tail], jnp.float32, "grouped GEMM")


@pytest.mark.unit
def test_the_tile_map_cuts_each_group_from_its_first_row():
    tiles = np.asarray(tile_map(jnp.array([5, 0, 2]), 9, 4, fill_tail=True))
    # (group, first row, end row): group 0 in two tiles, group 1 none, group 2, the tail (3), unused (4)
    assert tiles.T.tolist() == [[0, 0, 5], [0, 4, 5], [2, 5, 7], [3, 7, 9], [4, 0, 0], [4, 0, 0]]
    assert np.asarray(tile_map(jnp.array([5, 0, 2]), 9, 4, fill_tail=False))[0].tolist() == [0, 0, 2, 4, 4, 4]


@pytest.mark.unit
@pytest.mark.parametrize(
    "slots, n, k, tile",
    [
        (1, 1408, 2816, (32, 128)),
        (8, 1408, 2816, (128, 128)),
        (32, 1408, 2816, (128, 128)),
        # the down projection: the tilings measured fastest on the H200 (BENCHMARKS.md)
        (1, 2816, 704, (16, 128)),
        (8, 2816, 704, (128, 256)),
        (32, 2816, 704, (128, 256)),
    ],
)
def test_default_tiling_divides_the_26b_a4b_experts(slots, n, k, tile):
    blocks = default_grouped_block_sizes(slots * 256 * 8, n, k, 128)
    assert (blocks.block_m, blocks.block_n) == tile and n % blocks.block_n == 0 and k % blocks.block_k == 0
    assert default_grouped_block_sizes(5, 32, 16, 4).block_m == 16


@pytest.mark.unit
def test_bad_arguments_are_named():
    x, w, sizes = jnp.zeros((8, 32)), jnp.zeros((2, 16, 32)), jnp.array([4, 4])
    with pytest.raises(ValueError, match="w_scale is needed"):
        grouped_matmul(x, w.astype(jnp.int8), sizes)
    with pytest.raises(ValueError, match="float8 rows"):
        grouped_matmul(x.astype(FP8), w.astype(FP8), sizes, jnp.ones((2, 16)))
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(jnp.zeros((8, 24)), jnp.zeros((2, 16, 24)), sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, jnp.array([8]))
    with pytest.raises(ValueError, match="row_index"):
        grouped_matmul(x, w, sizes, row_index=jnp.zeros((8,), jnp.float32))
    with pytest.raises(ValueError, match="x_scale"):  # one scale per sorted row, not per row of x
        grouped_matmul(x, w, sizes, x_scale=jnp.ones((8,)), row_index=jnp.zeros((6,), jnp.int32))


@pytest.mark.parametrize("kind, rows", [("bf16", 2048), ("int8", 65536), ("fp8", 16384)])
def test_lowers_for_cuda_at_26b_a4b_shapes(kind, rows):
    """gate/up (2816 -> 1408) and down (704 -> 2816) of 128 experts, at 1 / 32 / 8 slots' rows."""
    S = jax.ShapeDtypeStruct
    x_dtype = FP8 if kind == "fp8" else jnp.bfloat16
    w_dtype = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": FP8}[kind]
    for n, k in ((1408, 2816), (2816, 704)):
        args = [S((rows, k), x_dtype), S((128, n, k), w_dtype), S((128,), jnp.int32)]
        args += [S((128, n), jnp.float32)] * (kind != "bf16") + [S((rows,), jnp.float32)] * (kind == "fp8")
        text = lower_for_cuda(jax.jit(lambda *a: grouped_matmul(*a, out_dtype=jnp.bfloat16)), *args)
        assert text.count(TRITON) == 1 and "ragged_dot" not in text
    # gate/up as the experts run it: the token rows [rows / 8, K] gathered by the kernel
    tokens = S((rows // 8, 2816), x_dtype)
    args = [tokens, S((128, 1408, 2816), w_dtype), S((128,), jnp.int32)]
    args += [S((128, 1408), jnp.float32)] * (kind != "bf16") + [S((rows,), jnp.float32)] * (kind == "fp8")
    gathered = jax.jit(lambda *a: grouped_matmul(*a[:-1], out_dtype=jnp.bfloat16, row_index=a[-1]))
    text = lower_for_cuda(gathered, *args, S((rows,), jnp.int32))
    # no [rows, 2816] copy of the gathered rows outside the kernel
    assert text.count(TRITON) == 1 and f"tensor<{rows}x2816x" not in text


# ----- the gated kernel: gelu(gate) * up in the epilogue ------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_the_kernels_activation_is_the_models_gelu_tanh_bit_for_bit(dtype):
    """common.gelu_tanh on float32 registers holding dtype values equals the model's gelu_tanh
    (jax.nn.gelu on dtype arrays, jitted: XLA rounds every op): every finite bf16 / f16 value,
    random float32 ones."""
    if jnp.dtype(dtype).itemsize == 2:
        x = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(jnp.dtype(dtype)))
        x = x[jnp.isfinite(x)]
    else:
        x = jnp.asarray(np.random.default_rng().standard_normal(1 << 16) * 6, jnp.float32)
    want = np.asarray(jax.jit(gelu_tanh)(x), np.float32)
    got = np.asarray(jax.jit(lambda v: kernel_gelu_tanh(v.astype(jnp.float32), dtype).astype(dtype))(x), np.float32)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{np.sum(~same)} of {x.size} differ, e.g. x={np.asarray(x[~same][:4], np.float32)}"


def unfused(x, w, sizes, w_scale, x_scale, **run):
    """The gated product as the experts ran it before: the plain kernel's [M, 2F] rounded to
    out_dtype, then jax.nn.gelu(gate) * up in XLA (jitted)."""
    y = grouped_matmul(x, w, sizes, w_scale, x_scale, **run)
    f = w.shape[1] // 2
    return jax.jit(lambda y: gelu_tanh(y[:, :f]) * y[:, f:])(y)


@pytest.mark.parametrize(
    "m, f, k, groups, kind, routing, blocks",
    [
        (40, 32, 48, 4, "bf16", "spread", GroupedMatmulBlockSizes(16, 16, 16)),  # tiles across group edges
        (70, 48, 64, 5, "bf16", "tail", GroupedMatmulBlockSizes(16, 32, 32)),  # 32 columns of F = 48: a window
        (37, 32, 32, 4, "f32", "one", GroupedMatmulBlockSizes(32, 32, 16)),  # every row to one group
        (70, 32, 64, 5, "int8", "spread", GroupedMatmulBlockSizes(16, 16, 32)),
        (50, 48, 64, 4, "fp8", "tail", GroupedMatmulBlockSizes(16, 32, 32)),
        (9, 16, 16, 3, "bf16", "spread", None),  # default tiling, fewer rows than a tile (padded)
    ],
)
def test_the_gated_kernel_equals_the_plain_kernel_then_xlas_gelu_times_up(m, f, k, groups, kind, routing, blocks):
    """Fresh random inputs, interpret mode: bit for bit the plain kernel of the same tiling
    followed by XLA's gelu(gate) * up on its rounded product (the rounding points are the unfused
    path's; float32 to its last bits, as the products' summation order may differ), close to the ragged_dot reference; with fill_tail=False the rows past
    sum(group_sizes) stay interpret mode's NaN (no program stored them) and every other row is
    written; with fill_tail they are zeros."""
    rng = np.random.default_rng()
    x, w, sizes, w_scale, x_scale = random_case(rng, m, 2 * f, k, groups, kind, routing)
    out_dtype = jnp.float32 if kind == "f32" else jnp.bfloat16
    run = dict(out_dtype=out_dtype, interpret=True, block_sizes=blocks)
    got = np.asarray(grouped_matmul_gated(x, w, sizes, w_scale, x_scale, fill_tail=False, **run), np.float32)
    tail = int(jnp.sum(sizes))
    assert got.shape == (m, f)
    assert np.isfinite(got[:tail]).all(), "a row of a group was not written"
    assert np.isnan(got[tail:]).all(), "a row in no group was written"
    before = np.asarray(unfused(x, w, sizes, w_scale, x_scale, **run), np.float32)
    if kind == "f32":  # one [BM, 2 BN] product against two [BM, BN]: the dot's own summation order
        scale = float(np.abs(before[:tail]).max())
        np.testing.assert_allclose(got[:tail], before[:tail], rtol=1e-5, atol=2e-5 * scale)
    else:
        np.testing.assert_array_equal(got[:tail], before[:tail])
    want = grouped_matmul_gated_reference(x, w, sizes, w_scale, x_scale, out_dtype=out_dtype)
    assert_close(got[:tail], want[:tail], out_dtype, f"gated grouped GEMM {kind}")
    filled = grouped_matmul_gated(x, w, sizes, w_scale, x_scale, **run)
    np.testing.assert_array_equal(np.asarray(filled, np.float32), np.concatenate([got[:tail], np.zeros((m - tail, f))]))


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_the_gated_kernel_gathers_its_rows(kind):
    """Sorted rows picked from token rows by row_index (each ~2.5 times), 8-bit scales per
    sorted row: bit for bit the kernel on the copied rows, and close to the reference."""
    rng = np.random.default_rng()
    x, w, _, w_scale, _ = random_case(rng, 24, 64, 64, 4, kind, "spread")
    m = 60
    index = jnp.asarray(rng.integers(0, 24, m), jnp.int32)
    sizes = jnp.asarray(group_sizes(rng, m, 4, "tail"))
    x_scale = jnp.asarray(rng.uniform(0.5, 2.0, m), jnp.float32) if kind == "fp8" else None
    run = dict(out_dtype=jnp.bfloat16, interpret=True, block_sizes=GroupedMatmulBlockSizes(16, 32, 32))
    got = grouped_matmul_gated(x, w, sizes, w_scale, x_scale, row_index=index, **run)
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(grouped_matmul_gated(x[index], w, sizes, w_scale, x_scale, **run))
    )
    want = grouped_matmul_gated_reference(x, w, sizes, w_scale, x_scale, out_dtype=jnp.bfloat16, row_index=index)
    assert_close(got, want, jnp.bfloat16, f"gathered gated grouped GEMM {kind}")


@pytest.mark.unit
def test_the_gated_kernel_names_what_it_does_not_take():
    x, sizes = jnp.zeros((8, 32)), jnp.array([4, 4])
    with pytest.raises(ValueError, match="2F must be a multiple of 32"):
        grouped_matmul_gated(x, jnp.zeros((2, 48, 32)), sizes)  # F = 24
    with pytest.raises(ValueError, match="block_n=64 must be at most F=32"):
        grouped_matmul_gated(x, jnp.zeros((2, 64, 32)), sizes, block_sizes=GroupedMatmulBlockSizes(16, 64, 16))
    with pytest.raises(ValueError, match="w_scale is needed"):
        grouped_matmul_gated(x, jnp.zeros((2, 64, 32), jnp.int8), sizes)


@pytest.mark.unit
@pytest.mark.parametrize("slots, tile", [(1, (32, 64)), (8, (128, 64)), (32, (128, 128))])
def test_the_gated_default_tiling_is_the_plain_ones_with_half_the_columns(slots, tile):
    """26B-A4B's gate/up (F = 704, K = 2816): the plain kernel's 128 columns of the [M, 1408]
    product become 64 of the gate's and 64 of the up's; at 32 slots (512 rows per expert on
    average) 128 of each."""
    blocks = default_gated_block_sizes(slots * 256 * 8, 704, 2816, 128)
    plain = default_grouped_block_sizes(slots * 256 * 8, 1408, 2816, 128)
    assert (blocks.block_m, blocks.block_n) == tile
    assert blocks.block_n * 2 == plain.block_n * (2 if slots == 32 else 1)
    assert (blocks.block_k, blocks.num_warps, blocks.num_stages) == (plain.block_k, plain.num_warps, plain.num_stages)


@pytest.mark.parametrize(
    "kind, rows, blocks",
    [
        ("bf16", 2048, None),
        ("int8", 65536, None),
        ("fp8", 16384, None),
        ("bf16", 65536, GroupedMatmulBlockSizes(128, 128, 64, 8, 3)),  # 704 = 5.5 x 128: the column window
    ],
)
def test_the_gated_kernel_lowers_for_cuda_at_26b_a4b_shapes(kind, rows, blocks):
    """gate/up of 128 experts (2816 -> 2 x 704) as the experts run it: the token rows gathered,
    one Triton call writing [rows, 704], and no [rows, 1408] product anywhere."""
    S = jax.ShapeDtypeStruct
    x_dtype = FP8 if kind == "fp8" else jnp.bfloat16
    w_dtype = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": FP8}[kind]
    args = [S((rows // 8, 2816), x_dtype), S((128, 1408, 2816), w_dtype), S((128,), jnp.int32)]
    args += [S((128, 1408), jnp.float32)] * (kind != "bf16") + [S((rows,), jnp.float32)] * (kind == "fp8")
    gated = jax.jit(
        lambda *a: grouped_matmul_gated(
            *a[:-1], out_dtype=jnp.bfloat16, fill_tail=False, block_sizes=blocks, row_index=a[-1]
        )
    )
    text = lower_for_cuda(gated, *args, S((rows,), jnp.int32))
    assert text.count(TRITON) == 1 and f"tensor<{rows}x704xbf16>" in text
    assert f"tensor<{rows}x1408x" not in text and f"tensor<{rows}x2816x" not in text


# ----- the routed experts through the kernel ----------------------------------------------------


def routed_case(seed, routing: str, T=24, K=2, E=4, D=32, F=16, dtype=jnp.float32):
    """Rows, top-K routing ("spread": random, expert 3 empty; "one": every row's first choice
    expert 1) and expert weights [E, 2F, D], [E, D, F]."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, D)) * rng.uniform(0.1, 10, (T, 1)), dtype)
    if routing == "one":
        experts = np.stack([np.ones(T, int), rng.choice([0, 2, 3], T)], axis=1)
    else:
        experts = np.stack([rng.permutation(3)[:K] for _ in range(T)])
    weights = jnp.asarray(rng.uniform(size=(T, K)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(E, 2 * F, D)) / D**0.5, dtype)
    down = jnp.asarray(rng.normal(size=(E, D, F)) / F**0.5, dtype)
    return x, weights, jnp.asarray(experts, jnp.int32), gate_up, down


@pytest.mark.parametrize(
    "mode, routing, dtype",
    [
        ("none", "spread", jnp.float32),
        ("none", "one", jnp.bfloat16),
        ("int8-weights", "spread", jnp.bfloat16),
        ("fp8", "one", jnp.bfloat16),
    ],
)
def test_the_routed_experts_through_the_kernel_equal_the_ragged_dot_path(mode, routing, dtype):
    x, weights, experts, gate_up, down = routed_case(np.random.default_rng().integers(1 << 30), routing, dtype=dtype)
    if mode != "none":
        gate_up, down = (quantize_experts(w, mode) for w in (gate_up, down))
    want = jax.jit(grouped_expert_mlp)(x, weights, experts, gate_up, down)
    got = jax.jit(expert_mlp_with("interpret"))(x, weights, experts, gate_up, down)
    assert got.dtype == dtype
    # fp8: the hidden activation is re-quantized per row for the down projection. The kernel
    # stores it in bf16 first; XLA fuses gelu * up into that quantization and, allowed excess
    # precision (its default), skips the bf16 rounding, so elements near an e4m3 step land on
    # either side (0 of 60 seeds differ with --xla_allow_excess_precision=false; with it, up to
    # 0.032 over 300 seeds): fp8's threshold
    assert_close(got, want, FP8 if mode == "fp8" else dtype, f"routed experts {mode}")


def test_a_block_of_the_experts_adds_only_its_own_rows():
    """routed_sum over experts [2, 4) (a device's share): the kernel skips the other rows, and the
    two blocks add up to all experts, as through jax.lax."""
    x, weights, experts, gate_up, down = routed_case(np.random.default_rng().integers(1 << 30), "spread")
    blocks = []
    for first in (0, 2):
        own = (gate_up[first : first + 2], down[first : first + 2])
        got = jax.jit(routed_sum, static_argnames="grouped_gemm")(
            x, weights, experts, *own, first, grouped_gemm="interpret"
        )
        assert_close(got, routed_sum(x, weights, experts, *own, first), jnp.float32, f"experts from {first}")
        blocks.append(got)
    assert_close(blocks[0] + blocks[1], grouped_expert_mlp(x, weights, experts, gate_up, down), jnp.float32, "sum")


def test_the_routed_experts_over_an_expert_mesh_run_the_kernel_per_device():
    mesh = parse_mesh("expert=4", jax.devices()[:4])
    x, weights, experts, gate_up, down = routed_case(np.random.default_rng().integers(1 << 30), "spread")
    placed = [jax.device_put(w, jax.sharding.NamedSharding(mesh, EXPERT_ROWS)) for w in (gate_up, down)]
    got = jax.jit(sharded_expert_mlp(mesh, "interpret"))(x, weights, experts, *placed)
    assert_close(got, grouped_expert_mlp(x, weights, experts, gate_up, down), jnp.float32, "sharded experts")


@pytest.mark.unit
def test_auto_routes_the_experts_to_the_kernel_on_nvidia_gpus_only(monkeypatch):
    assert grouped_gemm(resolve_kernels("auto")) == "xla"  # this CPU
    assert grouped_gemm(resolve_kernels("xla")) == "xla"
    assert grouped_gemm(Kernels(experts=True, interpret=True)) == "interpret"
    monkeypatch.setattr(dllm_jax.common.platform, "on_nvidia_gpu", lambda: True)
    assert resolve_kernels("auto") == GPU_AUTO and grouped_gemm(resolve_kernels("auto")) == "pallas"
    with pytest.raises(ValueError, match="grouped_gemm"):
        expert_mlp_with("cuda")


def _canvas_config() -> DiffusionGemmaConfig:
    """The shared small config with 2 heads and widths the kernel tiles (multiples of 16), bf16."""
    return small_config(
        n_heads=2,
        sliding_head_dim=16,
        sliding_kv_heads=1,
        mlp_hidden_size=32,
        vocab_size=64,
        canvas_length=16,
        max_sequence_length=128,
        dtype="bfloat16",
    )


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_the_canvas_loop_lowers_for_cuda_with_the_kernel_and_no_ragged_dot(quantization):
    """backend="auto" on a GPU: every pass's experts (the prompt's encoding, the canvas) are two
    grouped GEMM kernels per layer, and no jax.lax.ragged_dot is left for XLA:GPU to densify."""
    from dllm_jax.engine.engine import Engine

    config = dataclasses.replace(_canvas_config(), quantization=quantization)
    params = jax.eval_shape(dg.unstack_layers, dg.abstract_params(config))
    engine = Engine(config, params, backend=GPU_AUTO, full_pass_lanes=())
    loop = engine.decode_loop(DecodeConfig(method="diffusion_gemma", gen_length=32, batch_size=2), 16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    sampling = jax.eval_shape(lambda: zero_sampling((4,)))
    state = jax.eval_shape(loop.init_state, i32(4, 16), i32(4), sampling, i32())
    run = jax.jit(loop.run, donate_argnums=1)
    text = lower_for_cuda(run, engine.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_))
    assert "ragged_dot" not in text
    # (the jitted kernel function is lowered once per shape and called per layer)
    assert text.count("func.call @grouped_matmul") == 2 * config.n_layers and TRITON in text
    # and the attention over [cache; own rows] is the Triton cache-attention kernel
    assert 'name = "cache_attention"' in text
    # the XLA path keeps its ragged dots (the CPU's and TPU's program)
    xla = Engine(config, params, backend="xla", full_pass_lanes=())
    loop = xla.decode_loop(DecodeConfig(method="diffusion_gemma", gen_length=32, batch_size=2), 16)
    text = lower_for_cuda(
        jax.jit(loop.run, donate_argnums=1), xla.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_)
    )
    dots = [line for line in text.splitlines() if "chlo.ragged_dot" in line]
    assert len(dots) == 2 * config.n_layers and "grouped_matmul" not in text and "cache_attention" not in text


def test_the_26b_a4b_canvas_loop_lowers_for_cuda_with_the_kernel_at_its_shapes():
    """The published shape (30 layers, 128 experts of 2816 -> 2 x 704), 8 slots: each layer's
    two grouped GEMMs over the 8 x 256 x 8 assignment rows, no ragged dot, and no copy of the
    token rows in expert order (gate/up gathers the 8 x 256 token rows itself; about 10 s)."""
    from dllm_jax.engine.engine import Engine
    from dllm_jax.models.diffusion_gemma_config import diffusion_gemma_26b_a4b_config

    config = diffusion_gemma_26b_a4b_config("bfloat16")
    engine = Engine(config, jax.eval_shape(dg.unstack_layers, dg.abstract_params(config)), backend=GPU_AUTO)
    loop = engine.decode_loop(DecodeConfig(method="diffusion_gemma", gen_length=256, batch_size=8), 256)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    sampling = jax.eval_shape(lambda: zero_sampling((16,)))
    state = jax.eval_shape(loop.init_state, i32(16, 256), i32(16), sampling, i32())
    run = jax.jit(loop.run, donate_argnums=1)
    text = lower_for_cuda(run, engine.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_))
    assert "ragged_dot" not in text and text.count("func.call @grouped_matmul") == 2 * config.n_layers
    # gate/up is the gated kernel (gelu(gate) * up in its epilogue), down the plain one
    assert text.count("func.call @grouped_matmul_gated") == config.n_layers
    for operands in (
        "tensor<2048x2816xbf16>, tensor<128x1408x2816xbf16>",
        "tensor<16384x704xbf16>, tensor<128x2816x704xbf16>",
    ):
        assert operands in text
    lines = text.splitlines()
    assert not any("stablehlo.gather" in line and "(tensor<2048x2816xbf16>" in line for line in lines)
    # the [16384, 1408] gate/up product is never an array of the program
    assert "tensor<16384x1408x" not in text
