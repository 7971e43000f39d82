"""The per-head RMSNorm + RoPE kernel: interpret mode against the jnp reference (every row and
half written: interpret mode starts outputs as NaN), its refusals, DiffusionGemma's q/k/v through
it, and its Triton lowering at 26B-A4B's shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from pallas_kernels.common import RowBlockSizes
from pallas_kernels.norm.head_norm_rope import (
    default_block_sizes,
    head_norm_rope,
    head_norm_rope_reference,
    supports,
)

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]
EPS = 1e-6


def inputs(seed: int, n: int, heads: int, head_dim: int, dtype, rotated_pairs: int | None = None):
    """Random rows (one all-zero head: eps keeps it finite), a weight, and the cos/sin of random
    positions with the pairs past rotated_pairs left unrotated (cos 1, sin 0), as a partial RoPE."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, heads, head_dim)) * 3.0
    x[n // 2, 0] = 0.0
    weight = 1 + 0.2 * rng.standard_normal(head_dim)
    half = head_dim // 2
    inv = 1.0 / (10000.0 ** (np.arange(half) * 2 / head_dim))
    inv[rotated_pairs if rotated_pairs is not None else half :] = 0.0
    angles = rng.integers(0, 4096, n)[:, None] * inv[None, :]
    f32 = jnp.float32
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(weight, dtype),
        jnp.asarray(np.cos(angles), f32),
        jnp.asarray(np.sin(angles), f32),
    )


@pytest.mark.parametrize(
    ("n", "heads", "head_dim", "dtype", "rotated_pairs", "blocks"),
    [
        (37, 4, 64, jnp.bfloat16, None, RowBlockSizes(block_rows=4)),  # 37 rows: blocks of 1
        (24, 8, 32, jnp.float32, None, RowBlockSizes(block_rows=8)),  # blocks of 8
        (16, 2, 128, jnp.bfloat16, 16, None),  # a quarter of the pairs rotated (full layers)
        (6, 16, 32, jnp.float32, 4, RowBlockSizes(block_rows=2, num_warps=8)),
    ],
)
def test_matches_the_reference(n, heads, head_dim, dtype, rotated_pairs, blocks):
    x, weight, cos, sin = inputs(n + heads, n, heads, head_dim, dtype, rotated_pairs)
    got = head_norm_rope(x, weight, cos, sin, eps=EPS, interpret=True, block_sizes=blocks)
    want = head_norm_rope_reference(x, weight, cos, sin, eps=EPS)
    assert got.dtype == dtype and got.shape == x.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    else:  # the same rounding points; the sums' order may move a normed value by one bf16 step
        assert np.mean(got != want) < 0.01
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("scaled", "rotated"), [(False, False), (True, False), (False, True)])
def test_without_weight_or_rotation(scaled, rotated):
    x, weight, cos, sin = inputs(3, 12, 4, 32, jnp.float32)
    args = (weight if scaled else None, cos if rotated else None, sin if rotated else None)
    got = head_norm_rope(x, *args, eps=EPS, interpret=True)
    want = head_norm_rope_reference(x, *args, eps=EPS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    if not scaled and not rotated:  # a plain per-head RMSNorm: unit mean square per head
        ms = np.mean(np.asarray(got) ** 2, axis=-1)
        assert np.allclose(np.delete(ms.reshape(-1), 6 * 4), 1.0, atol=1e-4)


def test_refuses_what_it_does_not_take():
    x, weight, cos, sin = inputs(0, 8, 4, 32, jnp.float32)
    with pytest.raises(ValueError, match="powers of two"):
        head_norm_rope(x[:, :3], weight, cos, sin, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="weight.shape"):
        head_norm_rope(x, weight[:16], cos, sin, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="both"):
        head_norm_rope(x, weight, cos, None, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="cos"):
        head_norm_rope(x, weight, cos[:4], sin[:4], eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        RowBlockSizes(block_rows=3)
    assert supports(16, 512) and supports(2, 256) and not supports(6, 256) and not supports(4, 48)


def test_default_blocks_hold_a_bounded_number_of_elements():
    assert default_block_sizes(16, 512).block_rows == 1 == default_block_sizes(16, 256).block_rows
    assert default_block_sizes(8, 256).block_rows == 2
    assert default_block_sizes(2, 512).block_rows == 4


def test_diffusion_gemma_q_k_v_through_the_kernel_equal_xla():
    """A sliding and a full layer of a small DiffusionGemma (float32): project_qkv with the
    kernel (interpret mode) gives XLA's q, k and v."""
    from dllm_jax.models import diffusion_gemma as dg
    from dllm_jax.models.diffusion_gemma_config import AttentionKind
    from tests.diffusion_gemma_small import small_config

    config = small_config()
    kernel = functools.partial(head_norm_rope, interpret=True)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 8, config.d_model)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)
    for kind in (AttentionKind.SLIDING, AttentionKind.FULL):
        xla = dg.DiffusionGemmaLayer(config, kind)
        params = xla.init(jax.random.key(1), h, positions)
        params = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(jax.random.key(2), w.shape, w.dtype), params)
        want = xla.apply(params, h, positions, method=dg.DiffusionGemmaLayer.project_qkv)
        got = dg.DiffusionGemmaLayer(config, kind, head_norm=kernel).apply(
            params, h, positions, method=dg.DiffusionGemmaLayer.project_qkv
        )
        for name, a, b in zip("qkv", got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=f"{kind} {name}")


@pytest.mark.parametrize(("heads", "head_dim"), [(16, 256), (8, 256), (16, 512), (2, 512)])
def test_triton_lowering_at_26b_a4b_shapes(heads, head_dim):
    spec = jax.ShapeDtypeStruct
    f32, bf16 = jnp.float32, jnp.bfloat16
    n = 32 * 256
    half = spec((n, head_dim // 2), f32)
    text = lower_for_cuda(
        head_norm_rope, spec((n, heads, head_dim), bf16), spec((head_dim,), bf16), half, half, eps=EPS
    )
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "head_norm_rope"' in text
    text = lower_for_cuda(head_norm_rope, spec((n, heads, head_dim), bf16), None, None, None, eps=EPS)
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_the_routing_runs_the_kernel_where_asked_outside_a_tensor_axis(monkeypatch):
    import dllm_jax.common.platform
    from dllm_jax.runtime.canvas_forward import head_norm_fn
    from dllm_jax.runtime.kernel_routing import Kernels, head_norm, resolve_kernels

    assert head_norm(resolve_kernels("auto")) == "xla" == head_norm(resolve_kernels("xla"))  # this CPU
    assert head_norm(Kernels(head_norm=True, interpret=True)) == "interpret"
    monkeypatch.setattr(dllm_jax.common.platform, "on_nvidia_gpu", lambda: True)
    assert head_norm(resolve_kernels("pallas")) == "pallas" == head_norm(resolve_kernels("auto"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    assert head_norm(resolve_kernels("pallas"), mesh) == "pallas"  # a tensor axis of one device
    assert head_norm_fn("xla") is None
    with pytest.raises(ValueError, match="implementation"):
        head_norm_fn("triton")
    # shapes the kernel does not take go through XLA's function
    x, weight, cos, sin = inputs(1, 4, 3, 32, jnp.float32)
    got = head_norm_fn("interpret")(x, weight, cos, sin, eps=EPS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(head_norm_rope_reference(x, weight, cos, sin, eps=EPS)))
