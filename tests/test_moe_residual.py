"""The MoE block's end in one kernel (the experts' gathered sum, the post-norms, the residual and
the layer scalar): interpret mode against the jnp reference on fresh random inputs (every row
and segment written: interpret mode starts outputs as NaN), its refusals, a DiffusionGemma layer
through it, the routing, and its Triton lowering at 26B-A4B's shape."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from pallas_kernels.common import RowBlockSizes
from pallas_kernels.norm.moe_residual import (
    default_block_sizes,
    moe_residual,
    moe_residual_reference,
    supports,
    weighted_sum,
)

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]
EPS = 1e-6


def inputs(seed: int, t: int, d: int, k: int, m: int, dtype):
    """Random rows, products (the last one NaN: a row no assignment names, as the grouped GEMM
    leaves rows of other devices' experts), positions (some -1: another device's expert; one
    row with none of its own), routing weights, post-norm weights and per-row layer scalars."""
    rng = np.random.default_rng(seed)
    products = rng.standard_normal((m, d))
    products[-1] = np.nan
    position = rng.integers(-1, m - 1, (t, k)).astype(np.int32)
    position[0] = -1
    as_dtype = functools.partial(jnp.asarray, dtype=dtype)
    return (
        as_dtype(rng.standard_normal((t, d)) * 2.0),
        as_dtype(rng.standard_normal((t, d)) * 5.0),
        as_dtype(products),
        jnp.asarray(position),
        jnp.asarray(rng.uniform(0.0, 1.0, (t, k)), jnp.float32),
        *(as_dtype(1.0 + 0.2 * rng.standard_normal(d)) for _ in range(3)),
        as_dtype(rng.uniform(0.5, 1.5, t)),
    )


def assert_close(got, want, dtype, what=""):
    """Within a few of the dtype's last places of the largest value: the kernel sums each
    norm's squares per column segment, XLA in an order of its own, so the norms' scales may
    differ in their last float32 bit and move a rounding."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), what
    tolerance = 4 * float(jnp.finfo(dtype).eps) * float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance, err_msg=what)


def op_by_op_reference(*args):
    """The reference with every op rounded to the model dtype, as the model's ops round one by
    one (and transformers' do): XLA compiling them together may skip intermediate bfloat16
    roundings (excess precision), which moves about 15% of the bfloat16 results by one step."""
    with jax.disable_jit():
        return moe_residual_reference(*args, eps=EPS)


@pytest.mark.parametrize(
    ("t", "d", "k", "dtype", "blocks"),
    [
        (8, 2816, 8, jnp.bfloat16, None),  # 26B-A4B's width: segments of 2048, 512 and 256
        (37, 48, 2, jnp.float32, RowBlockSizes(block_rows=4)),  # 37 rows: blocks of 1
        (24, 32, 3, jnp.bfloat16, RowBlockSizes(block_rows=8, num_warps=8)),
        (6, 16, 1, jnp.float32, None),  # 6 rows of one segment: blocks of 2
    ],
)
def test_matches_the_reference(t, d, k, dtype, blocks):
    args = inputs(t + d + k, t, d, k, 3 * t, dtype)
    got = moe_residual(*args, eps=EPS, interpret=True, block_sizes=blocks)
    assert got.dtype == dtype and got.shape == (t, d)
    want = op_by_op_reference(*args)
    assert_close(got, want, dtype, f"{t}x{d} k {k}")
    if dtype == jnp.bfloat16:  # the roundings are the model's: equal but where a scale's last bit moves one
        assert np.mean(np.asarray(got != want)) < 1e-3
    assert_close(got, moe_residual_reference(*args, eps=EPS), dtype, "against XLA's compiled reference")


def test_weighted_sum_masks_rows_of_no_assignment():
    """position -1 adds nothing, even where the row it would clamp to holds NaN."""
    products = jnp.asarray([[np.nan, np.nan], [1.0, 2.0], [3.0, 4.0]], jnp.float32)
    position = jnp.asarray([[1, 2], [-1, 2], [-1, -1]], jnp.int32)
    weights = jnp.asarray([[0.5, 0.25], [9.0, 2.0], [1.0, 1.0]], jnp.float32)
    got = np.asarray(weighted_sum(products, position, weights))
    np.testing.assert_array_equal(got, [[1.25, 2.0], [6.0, 8.0], [0.0, 0.0]])


def test_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        moe_residual(*inputs(0, 4, 24, 2, 6, jnp.float32), eps=EPS, interpret=True)
    args = list(inputs(0, 4, 32, 2, 6, jnp.float32))
    for i, name in ((1, "dense"), (5, "w_dense"), (8, "scale")):
        bad = list(args)
        bad[i] = bad[i][:3]
        with pytest.raises(ValueError, match=name):
            moe_residual(*bad, eps=EPS, interpret=True)
    bad = list(args)
    bad[3] = bad[3].astype(jnp.float32)
    with pytest.raises(ValueError, match="position"):
        moe_residual(*bad, eps=EPS, interpret=True)
    assert supports(2816) and supports(16) and not supports(24) and not supports(0)


def test_default_blocks_hold_a_bounded_number_of_elements():
    assert default_block_sizes(2816).block_rows == 1
    assert default_block_sizes(1024).block_rows == 4
    assert default_block_sizes(32).block_rows == 128


def test_diffusion_gemma_layer_through_the_kernel_equals_xla():
    """A sliding and a full layer of a small DiffusionGemma (float32): output_and_mlp with the
    experts and the block's end through the kernel (interpret mode) gives XLA's rows, for an
    encoder and for per-group layer scalars."""
    from dllm_jax.models import diffusion_gemma as dg
    from dllm_jax.models.diffusion_gemma_config import AttentionKind
    from dllm_jax.runtime.canvas_forward import moe_output_fn
    from tests.diffusion_gemma_small import small_config

    config = small_config()
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 8, config.d_model)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)
    groups_encoder = jnp.asarray([True, False])[:, None, None]
    for kind in (AttentionKind.SLIDING, AttentionKind.FULL):
        xla = dg.DiffusionGemmaLayer(config, kind)
        params = xla.init(jax.random.key(1), h, positions)
        params = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(jax.random.key(2), w.shape, w.dtype), params)
        attn = jnp.asarray(rng.standard_normal((2, 8, config.n_heads * config.head_dim(kind))), jnp.float32)
        fused = dg.DiffusionGemmaLayer(config, kind, moe_output=moe_output_fn("interpret", "interpret"))
        for encoder in (True, groups_encoder):
            want = xla.apply(params, h, attn, encoder, method=dg.DiffusionGemmaLayer.output_and_mlp)
            got = fused.apply(params, h, attn, encoder, method=dg.DiffusionGemmaLayer.output_and_mlp)
            assert_close(got, want, jnp.float32, f"{kind} encoder {encoder is True}")


@pytest.mark.parametrize("mode", ["int8-weights", "fp8"])
def test_diffusion_gemma_layer_on_8_bit_experts_through_the_kernel_equals_xla(mode):
    """The kernel takes the products of 8-bit experts as it takes bf16 ones: the first layer of
    a quantized small DiffusionGemma (float32 activations) through it gives XLA's rows."""
    import dataclasses

    from dllm_jax.models import diffusion_gemma as dg
    from dllm_jax.models.quantization import quantize_params
    from dllm_jax.runtime.canvas_forward import moe_output_fn
    from tests.diffusion_gemma_small import small_config

    config = small_config()
    weights = jax.tree.map(np.asarray, jax.jit(dg.init_params, static_argnums=0)(config, jax.random.key(0)))
    config = dataclasses.replace(config, quantization=mode)
    params = {"params": dg.layer_params(config, quantize_params(weights, mode), 0)}
    kind = config.layer_types[0]
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((2, 8, config.d_model)), jnp.float32)
    attn = jnp.asarray(rng.standard_normal((2, 8, config.n_heads * config.head_dim(kind))), jnp.float32)
    want = dg.DiffusionGemmaLayer(config, kind).apply(
        params, h, attn, False, method=dg.DiffusionGemmaLayer.output_and_mlp
    )
    fused = dg.DiffusionGemmaLayer(config, kind, moe_output=moe_output_fn("interpret", "xla"))
    got = fused.apply(params, h, attn, False, method=dg.DiffusionGemmaLayer.output_and_mlp)
    assert_close(got, want, jnp.float32, mode)


@pytest.mark.parametrize("t", [256, 8192])  # 1 and 32 slots' canvas rows
def test_triton_lowering_at_26b_a4b_shape(t):
    spec = jax.ShapeDtypeStruct
    bf16, d = jnp.bfloat16, 2816
    text = lower_for_cuda(
        moe_residual,
        spec((t, d), bf16),
        spec((t, d), bf16),
        spec((8 * t, d), bf16),
        spec((t, 8), jnp.int32),
        spec((t, 8), jnp.float32),
        *(spec((d,), bf16),) * 3,
        spec((t,), bf16),
        eps=EPS,
    )
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "moe_residual"' in text


def test_the_routing_runs_the_kernel_where_asked(monkeypatch):
    import dllm_jax.common.platform
    from dllm_jax.runtime.canvas_forward import moe_output_fn
    from dllm_jax.runtime.kernel_routing import Kernels, moe_output, resolve_kernels

    assert moe_output(resolve_kernels("auto")) == "xla" == moe_output(resolve_kernels("xla"))  # this CPU
    assert moe_output(resolve_kernels("pallas", interpret=True)) == "interpret"
    assert moe_output(Kernels(moe_output=True)) == "pallas"
    monkeypatch.setattr(dllm_jax.common.platform, "on_nvidia_gpu", lambda: True)
    assert moe_output(resolve_kernels("auto")) == "xla"  # not measured in the step yet
    assert moe_output_fn("xla", "pallas") is None
    with pytest.raises(ValueError, match="implementation"):
        moe_output_fn("triton", "pallas")


def test_the_gpu_script_runs_its_cpu_smoke(tmp_path):
    import json

    from scripts.gpu.moe_residual import main

    assert main(["--tiny", "--slots", "1", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "moe_residual.json").read_text())["rows"]
    assert rows[0]["variant"] == "xla" and rows[0]["differ"] == 0.0
    assert len(rows) > 2 and all(row["variant"].startswith("kernel") for row in rows[1:])
    assert all(row["differ_op_by_op"] < 1e-3 for row in rows[1:])  # bf16: the kernel rounds as the ops do
    assert (tmp_path / "moe_residual.md").read_text().count("| 1 |") == len(rows)
