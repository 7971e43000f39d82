"""The batch-invariant RMSNorm: kernel (interpret mode) against its jnp reference and the model's
RMSNorm, row results bit-identical whatever M is, every output row written, the CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from dllm_jax.models.layers import RMSNorm
from pallas_kernels.norm.invariant_rms_norm import RMSNormBlockSizes, invariant_rms_norm, invariant_rms_norm_reference

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

EPS = 1e-5
# Several D steps and several row blocks at the test sizes.
SMALL = RMSNormBlockSizes(block_m=16, block_d=64)


def _inputs(seed, m, d, dtype):
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(m, d) * 3, dtype)
    weight = jnp.asarray(1 + 0.5 * rng.randn(d), dtype)
    return x, weight


def _model_norm(x, weight):
    return RMSNorm(EPS, weight.dtype).apply({"params": {"weight": weight}}, x)


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,d", [(1, 256), (100, 256), (257, 256), (100, 4096)])
def test_kernel_and_reference_match_the_model_norm(m, d, dtype):
    x, weight = _inputs(m * 7 + d, m, d, dtype)
    want = _f32(_model_norm(x, weight))
    tol = 1e-5 if dtype == jnp.float32 else 1.6e-2  # bf16: one last-bit flip of a value < 4
    for impl in (invariant_rms_norm, invariant_rms_norm_reference):
        got = impl(x, weight, EPS, interpret=True, block_sizes=SMALL)
        assert got.shape == (m, d) and got.dtype == dtype
        got = _f32(got)
        assert np.isfinite(got).all(), f"{impl.__name__}: every output row written"
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_reference_is_the_model_math_bit_for_bit_on_a_whole_tile():
    """One [block_m, D] tile: the reference is the model's RMSNorm on the same shape."""
    x, weight = _inputs(3, 16, 256, jnp.bfloat16)
    np.testing.assert_array_equal(
        _f32(invariant_rms_norm_reference(x, weight, EPS, block_sizes=SMALL)), _f32(_model_norm(x, weight))
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", [invariant_rms_norm, invariant_rms_norm_reference], ids=["kernel", "reference"])
def test_rows_do_not_depend_on_the_row_count(impl, dtype):
    m, d = 257, 256
    x, weight = _inputs(11, m, d, dtype)
    full = _f32(impl(x, weight, EPS, interpret=True, block_sizes=SMALL))
    for lo, hi in ((0, 1), (0, 100), (3, 20), (m - 5, m)):
        part = impl(x[lo:hi], weight, EPS, interpret=True, block_sizes=SMALL)
        np.testing.assert_array_equal(_f32(part), full[lo:hi])
    other = x.at[m // 2 :].set(jnp.asarray(np.random.RandomState(1).randn(m - m // 2, d) * 100, dtype))
    mixed = _f32(impl(other, weight, EPS, interpret=True, block_sizes=SMALL))
    np.testing.assert_array_equal(mixed[: m // 2], full[: m // 2])


def test_interpret_outputs_start_as_nan_and_every_row_is_written():
    """The poison: an output no program writes stays NaN in interpret mode (a kernel writing
    only every other D step is caught), so a finite output means every row and chunk was written."""
    from jax.experimental import pallas as pl

    def writes_half(x_ref, o_ref):
        o_ref[:, :8] = x_ref[:, :8]

    out = pl.pallas_call(writes_half, out_shape=jax.ShapeDtypeStruct((4, 16), jnp.float32), interpret=True)(
        jnp.ones((4, 16))
    )
    assert np.isnan(np.asarray(out[:, 8:])).all() and not np.isnan(np.asarray(out[:, :8])).any()
    x, weight = _inputs(5, 33, 128, jnp.float32)
    assert np.isfinite(np.asarray(invariant_rms_norm(x, weight, EPS, interpret=True, block_sizes=SMALL))).all()


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="expected x \\[M, D\\] and weight \\[D\\]"):
        invariant_rms_norm(jnp.zeros((4, 32)), jnp.zeros((16,)), EPS)
    with pytest.raises(ValueError, match="D=40"):
        invariant_rms_norm(jnp.zeros((4, 40)), jnp.zeros((40,)), EPS)
    with pytest.raises(ValueError, match="x.dtype=int32"):
        invariant_rms_norm(jnp.zeros((4, 32), jnp.int32), jnp.zeros((32,)), EPS)
    with pytest.raises(ValueError, match="block_d"):
        RMSNormBlockSizes(block_d=24)


@pytest.mark.parametrize("m", [128, 4096])
def test_lowers_for_cuda_at_llada_8b_width(m):
    text = lower_for_cuda(
        invariant_rms_norm,
        jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((4096,), jnp.bfloat16),
        EPS,
    )
    assert "invariant_rms_norm" in text and "__gpu$xla.gpu.triton" in text
