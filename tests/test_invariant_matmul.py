"""The batch-invariant matmul: kernel (interpret mode) against its jnp reference, row results
bit-identical whatever M is, every output tile written, and the CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from jax.experimental import pallas as pl

from pallas_kernels.matmul.invariant_matmul import MatmulBlockSizes, invariant_matmul, invariant_matmul_reference

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

SMALL = MatmulBlockSizes(block_m=16, block_n=32, block_k=16)


def _inputs(seed, m, k, n, dtype):
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(m, k), dtype)
    w = jnp.asarray(rng.randn(k, n) / np.sqrt(k), dtype)
    return x, w


def test_interpret_outputs_start_as_nan():
    """The poison the tests below rely on: an output element no program writes stays NaN."""

    def writes_nothing(x_ref, o_ref):
        pass

    out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((4, 4), jnp.float32), interpret=True)(
        jnp.ones((4, 4))
    )
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize(
    "m,k,n,dtype,out_dtype",
    [
        (37, 48, 96, jnp.float32, None),
        (50, 64, 32, jnp.bfloat16, None),
        (16, 32, 64, jnp.bfloat16, jnp.float32),
    ],
)
@pytest.mark.parametrize("impl", [invariant_matmul, invariant_matmul_reference], ids=["kernel", "reference"])
def test_rows_do_not_depend_on_the_row_count(impl, m, k, n, dtype, out_dtype):
    x, w = _inputs(m, m, k, n, dtype)
    full = np.asarray(impl(x, w, out_dtype=out_dtype, interpret=True, block_sizes=SMALL).astype(jnp.float32))
    assert full.shape == (m, n) and np.isfinite(full).all(), "every output tile written"
    want = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
    tol = 1e-5 if dtype == jnp.float32 and out_dtype is None else 2e-2
    np.testing.assert_allclose(full, want, rtol=tol, atol=tol)
    for lo, hi in ((0, 1), (3, 11), (m - 5, m)):
        part = impl(x[lo:hi], w, out_dtype=out_dtype, interpret=True, block_sizes=SMALL).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(part), full[lo:hi])
    other = x.at[m // 2 :].set(jnp.asarray(np.random.RandomState(1).randn(m - m // 2, k), dtype))
    mixed = np.asarray(impl(other, w, out_dtype=out_dtype, interpret=True, block_sizes=SMALL).astype(jnp.float32))
    np.testing.assert_array_equal(mixed[: m // 2], full[: m // 2])


def test_kernel_matches_the_reference_on_fresh_inputs():
    for seed in range(3):
        x, w = _inputs(100 + seed, 24 + 9 * seed, 64, 48, jnp.float32)
        got = invariant_matmul(x, w, interpret=True, block_sizes=SMALL)
        want = invariant_matmul_reference(x, w, block_sizes=SMALL)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="x .* @ w"):
        invariant_matmul(jnp.zeros((4, 32)), jnp.zeros((16, 32)))
    with pytest.raises(ValueError, match="N=40"):
        invariant_matmul(jnp.zeros((4, 32)), jnp.zeros((32, 40)))
    with pytest.raises(ValueError, match="block_k"):
        MatmulBlockSizes(block_k=24)


@pytest.mark.parametrize("m,k,n", [(4096, 4096, 12288), (128, 12288, 4096), (512, 4096, 126464)])
def test_lowers_for_cuda_at_llada_8b_shapes(m, k, n):
    text = lower_for_cuda(
        invariant_matmul, jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    )
    assert "invariant_matmul" in text and "__gpu$xla.gpu.triton" in text


def test_gemm_bench_smoke_reports_time_and_row_identity(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_invariant_matmul.py"
    spec = importlib.util.spec_from_file_location("bench_invariant_matmul", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--smoke", "--slots", "1", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "invariant_matmul.json").read_text())
    assert {(r["impl"], r["m"]) for r in rows} == {(i, m) for i in ("xla_dot", "reference_tiles128") for m in (32, 128)}
    assert all(r["us"] > 0 for r in rows)
    assert all(r["rows_identical_to_alone"] for r in rows if r["impl"] == "reference_tiles128")
    assert "| small 256x512 | 4 | 128 | reference_tiles128 |" in (tmp_path / "invariant_matmul.md").read_text()
