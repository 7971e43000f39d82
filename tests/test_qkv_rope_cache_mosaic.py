"""The Mosaic GPU fused projection (bf16 and FP8): Mosaic GPU's interpreter against the jnp
references on the CPU, and the lowering for sm_90 at LLaDA-8B shapes.

jax 0.10's Mosaic GPU interpreter runs the single-warpgroup pipeline only (a warp-specialized
pipeline leaks a tracer there, and transposed shared-memory tiles, which the FP8 B operand
is, have no rule); those cases run under jax 0.11 and are lowered on both.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from test_qkv_rope_cache import THETA, Case, f32, make_case
from tolerances import assert_close

from dllm_jax.models.quantization import quantize_kernel
from pallas_kernels.projection.qkv_rope_cache import qkv_rope_cache_reference
from pallas_kernels.projection.qkv_rope_cache_mosaic import (
    MosaicQKVBlockSizes,
    qkv_rope_cache_mosaic,
    qkv_rope_cache_mosaic_fp8,
    qkv_rope_cache_mosaic_fp8_reference,
)

pytestmark = pytest.mark.kernels

JAX_0_10 = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)
needs_jax_0_11 = pytest.mark.skipif(JAX_0_10, reason="jax 0.10's Mosaic GPU interpreter cannot run this variant")
SINGLE = MosaicQKVBlockSizes(block_rows=64, block_d=64, max_concurrent_steps=2, compute_wgs=1)
SPECIALIZED = MosaicQKVBlockSizes(block_rows=64, block_d=64, max_concurrent_steps=2, compute_wgs=2)
# 128 rows per warpgroup: the epilogue runs in two 64-row chunks; every wgmma awaited at once
TALL = MosaicQKVBlockSizes(block_rows=128, block_d=64, max_concurrent_steps=3, compute_wgs=1, wgmma_in_flight=0)
FP8_SINGLE = MosaicQKVBlockSizes(block_rows=64, block_d=128, max_concurrent_steps=2, compute_wgs=1)


def bf16_case(seed, **shape) -> Case:
    return make_case(seed, dtype="bfloat16", **shape)


def random_biases(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    widths = (case.wq.shape[2], case.wk.shape[2], case.wv.shape[2])
    return tuple(jnp.asarray(rng.standard_normal((case.wq.shape[0], w)), jnp.bfloat16) for w in widths)


def fp8_args(case: Case, layer: int, biases):
    """The case's rows quantized per row and its weights per output channel (the engine's fp8
    layout), as the FP8 kernel's arguments."""
    x = jnp.asarray(case.x, jnp.float32)
    x_scale = jnp.max(jnp.abs(x), axis=1) / 448.0
    xq = (x / x_scale[:, None]).astype(jnp.float8_e4m3fn)
    leaves = [quantize_kernel(jnp.asarray(w), "fp8") for w in (case.wq, case.wk, case.wv)]
    _, _, _, _, positions, rows, k_cache, v_cache, layer = case.args(layer)
    weights = tuple(leaf["qkernel"] for leaf in leaves)
    scales = tuple(leaf["scale"] for leaf in leaves)
    return (xq, x_scale, weights, scales, positions, rows, k_cache, v_cache, layer, biases)


def check_outputs(case: Case, layer: int, got, want) -> None:
    """q close to the reference; the named cache rows written and close; every other row of
    every layer as it was (the trash row aside)."""
    q, k_cache, v_cache = got
    q_ref, k_ref, v_ref = want
    assert q.shape == q_ref.shape and q.dtype == jnp.bfloat16
    assert_close(f32(q), f32(q_ref), jnp.bfloat16, "q")
    trash = case.cache.shape[1] - 1
    named = case.cache_rows[case.cache_rows != trash]
    before = f32(jnp.asarray(case.cache, jnp.bfloat16))
    touched = np.zeros(case.cache.shape[:2], bool)
    touched[layer, named] = True
    touched[layer, trash] = True
    for name, got_cache, want_cache in (("k_cache", f32(k_cache), f32(k_ref)), ("v_cache", f32(v_cache), f32(v_ref))):
        assert np.isfinite(got_cache[layer, named]).all(), f"{name}: a named row was not written"
        assert_close(got_cache[layer, named], want_cache[layer, named], jnp.bfloat16, name)
        assert np.array_equal(got_cache[~touched], before[~touched], equal_nan=True), f"{name}: a row not named changed"


@pytest.mark.parametrize(
    "blocks", [SINGLE, TALL, pytest.param(SPECIALIZED, marks=needs_jax_0_11)], ids=["1wg", "1wg-128rows", "2wg"]
)
@pytest.mark.parametrize(
    "n_heads, n_kv_heads, head_dim, d_model, n_rows, biased",
    [
        (2, 1, 64, 128, 40, False),  # grouped-query heads, fewer rows than one tile, two reduction steps
        (2, 2, 128, 192, 72, True),  # biases, rows past one tile (padding), three reduction steps
    ],
)
def test_bf16_kernel_matches_reference_and_writes_only_named_rows(
    blocks, n_heads, n_kv_heads, head_dim, d_model, n_rows, biased
):
    case = bf16_case(0, n_rows=n_rows, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
    biases = random_biases(case, 1) if biased else None
    layer = 1
    got = qkv_rope_cache_mosaic(*case.args(layer), biases, **case.kwargs, interpret=True, block_sizes=blocks)
    want = qkv_rope_cache_reference(*case.args(layer), biases, **case.kwargs)
    check_outputs(case, layer, got, want)


def test_inside_a_layer_scan_each_layer_writes_its_own_rows():
    """The engine's stacked use: lax.scan over layers, an int32 layer index, in-place caches."""
    case = bf16_case(2, n_rows=24, d_model=128, n_heads=2, n_kv_heads=1, head_dim=64, n_padding=1)

    def run(fn, extra):
        x, wq, wk, wv, positions, rows, k_cache, v_cache, _ = case.args(0)

        def layer_step(caches, layer):
            # a different input per layer, so a wrong layer index shows in the written rows
            q, k, v = fn(
                (x * (layer + 1.0)).astype(x.dtype), wq, wk, wv, positions, rows, *caches, layer, **case.kwargs, **extra
            )
            return (k, v), q

        return jax.jit(lambda c: jax.lax.scan(layer_step, c, jnp.arange(2, dtype=jnp.int32)))((k_cache, v_cache))

    (k, v), qs = run(qkv_rope_cache_mosaic, dict(interpret=True, block_sizes=SINGLE))
    (k_ref, v_ref), qs_ref = run(qkv_rope_cache_reference, {})
    named = case.cache_rows[case.cache_rows != case.cache.shape[1] - 1]
    assert_close(f32(qs), f32(qs_ref), jnp.bfloat16, "q")
    for layer in range(2):
        assert_close(f32(k)[layer, named], f32(k_ref)[layer, named], jnp.bfloat16, f"k layer {layer}")
        assert_close(f32(v)[layer, named], f32(v_ref)[layer, named], jnp.bfloat16, f"v layer {layer}")


@needs_jax_0_11
@pytest.mark.parametrize("blocks", [FP8_SINGLE, MosaicQKVBlockSizes(128, 128, 2, 2, 0)], ids=["1wg", "2wg-128rows"])
def test_fp8_kernel_matches_its_reference(blocks):
    case = bf16_case(3, n_rows=72, d_model=256, n_heads=2, n_kv_heads=1, head_dim=128)
    layer = 1
    biases = random_biases(case, 4)
    got = qkv_rope_cache_mosaic_fp8(*fp8_args(case, layer, biases), **case.kwargs, interpret=True, block_sizes=blocks)
    want = qkv_rope_cache_mosaic_fp8_reference(*fp8_args(case, layer, biases), **case.kwargs)
    check_outputs(case, layer, got, want)


def one_layer(fp8, layer: int):
    """The FP8 arguments with the weights, scales and biases of `layer` alone ([1, ...]: the
    engine's per-layer weights), the caches still of every layer."""
    xq, x_scale, weights, scales, *tail, biases = fp8
    pick = lambda arrays: tuple(a[layer : layer + 1] for a in arrays)  # noqa: E731
    return (xq, x_scale, pick(weights), pick(scales), *tail, None if biases is None else pick(biases))


@pytest.mark.parametrize(
    "fn", [qkv_rope_cache_mosaic_fp8_reference, pytest.param(qkv_rope_cache_mosaic_fp8, marks=needs_jax_0_11)]
)
def test_fp8_one_layers_weights_write_the_layer_the_index_names(fn):
    """Per-layer weights ([1, ...]) read whatever the layer index, which still picks the cache
    layer written: the same result as the stacked weights at that index."""
    case = bf16_case(8, n_rows=40, d_model=256, n_heads=2, n_kv_heads=1, head_dim=64)
    layer = 1
    biases = random_biases(case, 9)
    extra = dict(interpret=True, block_sizes=FP8_SINGLE) if fn is qkv_rope_cache_mosaic_fp8 else {}
    got = fn(*one_layer(fp8_args(case, layer, biases), layer), **case.kwargs, **extra)
    want = qkv_rope_cache_mosaic_fp8_reference(*fp8_args(case, layer, biases), **case.kwargs)
    check_outputs(case, layer, got, want)


def test_fp8_reference_is_the_bf16_projection_up_to_fp8_rounding():
    """The FP8 reference computes the same function as the bf16 one (scales applied right)."""
    case = bf16_case(5, n_rows=32, d_model=256, n_heads=2, n_kv_heads=2, head_dim=64)
    layer = 0
    biases = random_biases(case, 6)
    q8, k8, _ = qkv_rope_cache_mosaic_fp8_reference(*fp8_args(case, layer, biases), **case.kwargs)
    q, k, _ = qkv_rope_cache_reference(*case.args(layer), biases, **case.kwargs)
    named = case.cache_rows[case.cache_rows != case.cache.shape[1] - 1]
    err = np.linalg.norm(f32(q8) - f32(q)) / np.linalg.norm(f32(q))
    assert 1e-3 < err < 6e-2, f"fp8 vs bf16 q: relative L2 error {err:.3g}"
    err = np.linalg.norm(f32(k8)[layer, named] - f32(k)[layer, named]) / np.linalg.norm(f32(k)[layer, named])
    assert 1e-3 < err < 6e-2, f"fp8 vs bf16 k: relative L2 error {err:.3g}"


def test_invalid_arguments_raise_value_error_naming_them():
    case = bf16_case(7, n_rows=16, d_model=128, n_heads=2, n_kv_heads=1, head_dim=64)
    args = case.args(0)
    with pytest.raises(ValueError, match="block_rows"):
        MosaicQKVBlockSizes(block_rows=32)
    with pytest.raises(ValueError, match="compute_wgs"):
        MosaicQKVBlockSizes(compute_wgs=3)
    with pytest.raises(ValueError, match="block_d=384 must divide"):
        qkv_rope_cache_mosaic(*args, **case.kwargs, interpret=True, block_sizes=MosaicQKVBlockSizes(block_d=128 * 3))
    with pytest.raises(ValueError, match="x.dtype=float32"):
        f32_case = make_case(7, n_rows=16, d_model=128, n_heads=2, n_kv_heads=1, head_dim=64, dtype="float32")
        qkv_rope_cache_mosaic(*f32_case.args(0), **case.kwargs, interpret=True)
    with pytest.raises(ValueError, match="head_dim=32"):
        small = bf16_case(7, n_rows=16, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32)
        qkv_rope_cache_mosaic(*small.args(0), **small.kwargs, interpret=True)
    fp8 = fp8_args(case, 0, None)
    with pytest.raises(ValueError, match="x_scale"):
        qkv_rope_cache_mosaic_fp8(fp8[0], fp8[1][:-1], *fp8[2:], **case.kwargs, interpret=True)
    with pytest.raises(ValueError, match=r"wk.shape=\(2, 128, 64\)"):
        transposed = tuple(jnp.swapaxes(w, 1, 2) for w in fp8[2])
        qkv_rope_cache_mosaic_fp8(*fp8[:2], transposed, *fp8[3:], **case.kwargs, interpret=True)


LLADA = dict(n_layers=32, d_model=4096, heads=32, head_dim=128, cache_rows=32 * 2048 + 1)


def _lowered(fp8: bool, n_rows: int, blocks) -> str:
    n_layers, d_model, heads, head_dim, n_cache = (
        LLADA[k] for k in ("n_layers", "d_model", "heads", "head_dim", "cache_rows")
    )
    spec = jax.ShapeDtypeStruct
    i32, width = jnp.int32, heads * head_dim
    cache = spec((n_layers, n_cache, width), jnp.bfloat16)
    tail = (spec((n_rows,), i32), spec((n_rows,), i32), cache, cache, spec((), i32))
    kw = dict(n_heads=heads, n_kv_heads=heads, rope_theta=THETA, block_sizes=blocks)
    if fp8:
        w = spec((n_layers, width, d_model), jnp.float8_e4m3fn)
        s = spec((n_layers, width), jnp.float32)
        x = (spec((n_rows, d_model), jnp.float8_e4m3fn), spec((n_rows,), jnp.float32))
        return lower_for_cuda(qkv_rope_cache_mosaic_fp8, *x, (w, w, w), (s, s, s), *tail, **kw)
    w = spec((n_layers, d_model, width), jnp.bfloat16)
    return lower_for_cuda(qkv_rope_cache_mosaic, spec((n_rows, d_model), jnp.bfloat16), w, w, w, *tail, **kw)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n_rows, rows_per_wg, wgs", [(128, 64, 1), (4096, 64, 2), (4096, 128, 2)])
def test_lowers_for_sm90_at_llada_8b_shapes_with_the_caches_in_place(fp8, n_rows, rows_per_wg, wgs):
    blocks = MosaicQKVBlockSizes(rows_per_wg, 128 if fp8 else 64, 3, wgs)
    text = _lowered(fp8, n_rows, blocks)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    # the caches are donated into the jit and aliased through the kernel: no copy of them
    assert sorted(re.findall(r"tf.aliasing_output = (\d+)", text)) == ["1", "2"]
    assert "output_operand_aliases" in text
