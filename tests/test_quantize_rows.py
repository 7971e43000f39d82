"""RMSNorm + quantize and SwiGLU + quantize (the FP8 producers): interpret mode against the jnp
references, the engine's quantization rule, and the CUDA (Triton) lowering at LLaDA-8B shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from dllm_jax.models.quantization import quantize_kernel, quantized_matmul
from pallas_kernels.projection.quantize_rows import (
    QuantizeBlockSizes,
    quantize_rows_reference,
    rms_norm_quantize,
    rms_norm_quantize_reference,
    swiglu_quantize,
    swiglu_quantize_reference,
)

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]
BLOCKS = QuantizeBlockSizes(block_rows=4, block_cols=64)  # several row blocks and column steps


def dequantized(q, scale) -> np.ndarray:
    return np.asarray(q.astype(jnp.float32)) * np.asarray(scale)[:, None]


def assert_same_quantization(got, want, what: str) -> None:
    """Equal scales up to float32 rounding and float8 rows that differ in at most a few
    elements by one float8 step (the kernels order their sums differently)."""
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32 and q.shape == q_ref.shape
    np.testing.assert_allclose(np.asarray(scale), np.asarray(scale_ref), rtol=1e-5, err_msg=f"{what} scales")
    differ = np.mean(np.asarray(q.astype(jnp.float32)) != np.asarray(q_ref.astype(jnp.float32)))
    assert differ < 0.01, f"{what}: {differ:.2%} of the float8 elements differ"
    d, d_ref = dequantized(q, scale), dequantized(q_ref, scale_ref)
    assert np.linalg.norm(d - d_ref) / np.linalg.norm(d_ref) < 1e-2, what


def rows(seed: int, n: int, width: int, scale: float = 3.0) -> jax.Array:
    """Random bf16 rows with one all-zero row (it must get scale 1, not a NaN)."""
    x = np.random.default_rng(seed).standard_normal((n, width)) * scale
    x[n // 2] = 0.0
    return jnp.asarray(x, jnp.bfloat16)


def test_rms_norm_quantize_matches_reference():
    x = rows(0, 37, 256)  # rows not a multiple of the row block, four column steps
    weight = jnp.asarray(1 + 0.1 * np.random.default_rng(1).standard_normal(256), jnp.bfloat16)
    got = rms_norm_quantize(x, weight, 1e-5, interpret=True, block_sizes=BLOCKS)
    want = rms_norm_quantize_reference(x, weight, 1e-5)
    assert_same_quantization(got, want, "rms_norm_quantize")
    assert float(got[1][37 // 2]) == 1.0  # the all-zero row


def test_swiglu_quantize_matches_reference():
    gate, up = rows(2, 21, 384), rows(3, 21, 384, scale=1.0)
    got = swiglu_quantize(gate, up, interpret=True, block_sizes=BLOCKS)
    want = swiglu_quantize_reference(gate, up)
    assert_same_quantization(got, want, "swiglu_quantize")
    assert float(got[1][21 // 2]) == 1.0


def test_swiglu_quantize_of_unscaled_products_matches_reference_and_the_scaled_inputs():
    """With scales, gate and up are FP8 GEMM products: scaled by row x column first, as
    quantized_matmul scales them (the same float32 product, rounded once to bf16)."""
    gate, up = rows(4, 21, 384, scale=40.0), rows(5, 21, 384, scale=40.0)
    rng = np.random.default_rng(6)
    scales = tuple(jnp.asarray(rng.uniform(1e-3, 3e-2, n), jnp.float32) for n in (21, 384, 384))
    got = swiglu_quantize(gate, up, scales, interpret=True, block_sizes=BLOCKS)
    want = swiglu_quantize_reference(gate, up, scales)
    assert_same_quantization(got, want, "swiglu_quantize with scales")
    row, gate_cols, up_cols = scales
    scaled = [
        (a.astype(jnp.float32) * (row[:, None] * c)).astype(a.dtype) for a, c in ((gate, gate_cols), (up, up_cols))
    ]
    for a, b in zip(want, swiglu_quantize_reference(*scaled)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_reference_rule_is_the_engines_fp8_matmul_rule():
    """quantize_rows_reference's rows and scales fed to an FP8 dot give quantized_matmul's result."""
    x = rows(4, 16, 128)
    qkernel = quantize_kernel(np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32), "fp8")
    xq, x_scale = quantize_rows_reference(x)
    dot = jax.lax.dot_general(xq, qkernel["qkernel"], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    want = quantized_matmul(x, qkernel["qkernel"], qkernel["scale"], jnp.float32)
    np.testing.assert_array_equal(np.asarray(dot * (x_scale[:, None] * qkernel["scale"])), np.asarray(want))


def test_invalid_arguments_raise_value_error_naming_them():
    x = rows(6, 8, 64)
    with pytest.raises(ValueError, match="weight.shape"):
        rms_norm_quantize(x, jnp.ones((32,), jnp.bfloat16), 1e-5, interpret=True)
    with pytest.raises(ValueError, match="up"):
        swiglu_quantize(x, x[:, :32], interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        QuantizeBlockSizes(block_rows=3)
    with pytest.raises(ValueError, match="F=24"):
        swiglu_quantize(x[:, :24], x[:, :24], interpret=True)
    ones = jnp.ones((64,), jnp.float32)
    with pytest.raises(ValueError, match=r"row scale \(64,\) float32: expected float32 \(8,\)"):
        swiglu_quantize(x, x, (ones, ones, ones), interpret=True)


@pytest.mark.parametrize("n_rows", [128, 4096])
def test_triton_lowering_at_llada_8b_shapes(n_rows):
    spec = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    text = lower_for_cuda(rms_norm_quantize, spec((n_rows, 4096), bf16), spec((4096,), bf16), 1e-5)
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "rms_norm_quantize"' in text
    text = lower_for_cuda(swiglu_quantize, spec((n_rows, 12288), bf16), spec((n_rows, 12288), bf16))
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "swiglu_quantize"' in text
    f32 = jnp.float32
    scales = (spec((n_rows,), f32), spec((12288,), f32), spec((12288,), f32))
    text = lower_for_cuda(swiglu_quantize, spec((n_rows, 12288), bf16), spec((n_rows, 12288), bf16), scales)
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "swiglu_quantize"' in text
