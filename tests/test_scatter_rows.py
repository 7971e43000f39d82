"""K/V row scatter kernel: interpret mode against XLA's scatter, and its CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from pallas_kernels.projection.scatter_rows import ScatterBlockSizes, scatter_kv_rows, scatter_kv_rows_reference

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]


@pytest.mark.parametrize(
    "n_rows,width,dtype,blocks",
    [
        (40, 64, jnp.float32, ScatterBlockSizes(block_rows=16, block_cols=32)),
        (64, 128, jnp.bfloat16, None),
        (7, 32, jnp.float32, ScatterBlockSizes(block_rows=4, block_cols=16)),
    ],
)
def test_scatter_writes_exactly_the_named_rows(n_rows, width, dtype, blocks):
    rng = np.random.RandomState(n_rows)
    n_layers, m = 3, 96
    cache = rng.randn(n_layers, m, width).astype(np.float32)
    cache[:, ::2] = np.nan  # rows nobody should touch stay NaN
    rows = rng.choice(m - 1, size=n_rows, replace=False).astype(np.int32)
    rows[-2:] = m - 1  # two padding rows, same trash row, same values
    k = rng.randn(n_rows, width).astype(np.float32)
    v = rng.randn(n_rows, width).astype(np.float32)
    k[-2], v[-2] = k[-1], v[-1]
    as_dev = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    args = lambda: (as_dev(cache), as_dev(cache), as_dev(k), as_dev(v), jnp.asarray(rows), jnp.int32(1))  # noqa: E731
    got_k, got_v = scatter_kv_rows(*args(), interpret=True, block_sizes=blocks)
    want_k, want_v = scatter_kv_rows_reference(*args())
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
    assert np.isnan(np.asarray(got_k[0], np.float32)[::2]).all(), "other layers untouched"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_outside_the_cache_are_dropped(dtype):
    """With drop=True, as XLA's scatter with mode="drop": rows past the cache (DiffusionGemma's canvas passes name
    its length) or negative are not written, nor do they disturb the written rows; a block of
    dropped rows only (the first 16 here) writes nothing."""
    rng = np.random.RandomState(0)
    n_layers, m, width, n = 2, 64, 32, 40
    cache = rng.randn(n_layers, m, width).astype(np.float32)
    rows = rng.choice(m, size=n, replace=False).astype(np.int32)
    rows[:16] = m
    rows[20], rows[31], rows[n - 1] = -1, m + 7, m - 1  # the last cache row: kept
    k, v = (rng.randn(n, width).astype(np.float32) for _ in range(2))
    as_dev = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    args = lambda: (as_dev(cache), as_dev(cache), as_dev(k), as_dev(v), jnp.asarray(rows), jnp.int32(1))  # noqa: E731
    blocks = ScatterBlockSizes(block_rows=16, block_cols=16)
    got_k, got_v = scatter_kv_rows(*args(), drop=True, interpret=True, block_sizes=blocks)
    want_k, want_v = scatter_kv_rows_reference(*args(), drop=True)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
    kept = (rows >= 0) & (rows < m)
    expected = np.array(as_dev(cache), np.float32)
    expected[1, rows[kept]] = np.asarray(as_dev(k), np.float32)[kept]
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), expected)


def test_bad_shapes_are_named():
    cache = jnp.zeros((2, 8, 32))
    with pytest.raises(ValueError, match="k_rows"):
        scatter_kv_rows(cache, cache, jnp.zeros((4, 16)), jnp.zeros((4, 32)), jnp.zeros(4, jnp.int32), jnp.int32(0))
    with pytest.raises(ValueError, match="block_cols"):
        ScatterBlockSizes(block_cols=24)


def test_lowers_for_cuda_at_llada_8b_shapes():
    cache = jax.ShapeDtypeStruct((32, 32 * 640, 4096), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    text = lower_for_cuda(
        scatter_kv_rows,
        cache,
        cache,
        rows,
        rows,
        jax.ShapeDtypeStruct((4096,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    assert "scatter_kv_rows" in text and "__gpu$xla.gpu.triton" in text


def test_diffusion_gemma_writes_through_the_kernel_where_asked(monkeypatch):
    import dllm_jax.common.platform
    from dllm_jax.runtime.canvas_forward import cache_write_fn
    from dllm_jax.runtime.kernel_routing import Kernels, cache_write, resolve_kernels
    from pallas_kernels.projection import scatter_rows

    assert cache_write(resolve_kernels("pallas", interpret=True)) == "interpret"
    assert cache_write(Kernels(canvas_scatter=True)) == "pallas"
    monkeypatch.setattr(dllm_jax.common.platform, "on_nvidia_gpu", lambda: True)
    assert cache_write(resolve_kernels("auto")) == "xla"  # not measured in the step yet
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    assert cache_write(resolve_kernels("pallas"), mesh) == "pallas"  # a tensor axis of one device
    with pytest.raises(ValueError, match="implementation"):
        cache_write_fn("triton")
    # the XLA function drops the same rows the kernel drops
    rows = jnp.asarray([8, 3, 8, 0], jnp.int32)
    values = jnp.arange(64.0).reshape(4, 16)
    assert scatter_rows.supports(2048) and scatter_rows.supports(64) and not scatter_rows.supports(96)
    expected = np.zeros((2, 8, 16), np.float32)
    expected[1, 3], expected[1, 0] = values[1], values[3]
    for implementation in ("xla", "interpret"):
        k, v = cache_write_fn(implementation)(jnp.zeros((2, 8, 16)), jnp.zeros((2, 8, 16)), values, -values, rows, 1)
        np.testing.assert_array_equal(np.asarray(k), expected, err_msg=implementation)
        np.testing.assert_array_equal(np.asarray(v), -expected, err_msg=implementation)
    # a width the kernel does not tile (96) is written by XLA's scatter
    k, _ = cache_write_fn("interpret")(
        jnp.zeros((1, 8, 96)),
        jnp.zeros((1, 8, 96)),
        jnp.ones((2, 96)),
        jnp.ones((2, 96)),
        jnp.asarray([8, 2], jnp.int32),
        0,
    )
    assert float(k.sum()) == 96.0 and float(k[0, 2].sum()) == 96.0
