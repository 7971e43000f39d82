"""Weight-only int8 GEMM kernel: interpret mode against its jnp reference on fresh random inputs
(ragged rows; interpret mode starts every output as NaN, so an unwritten tile shows), the
routing of quantized_matmul, and the CUDA (Triton) lowering at LLaDA-8B shapes on the CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from cuda_lowering import lower_for_cuda
from tolerances import assert_close

import dllm_jax.common.platform
import dllm_jax.models.layers
from dllm_jax.models.quantization import INT8_KERNEL_MAX_ROWS, quantize_kernel, quantize_params, quantized_matmul
from dllm_jax.models.transformer import forward, init_params
from pallas_kernels.matmul.int8_matmul import (
    Int8MatmulBlockSizes,
    default_int8_block_sizes,
    int8_weight_matmul,
    int8_weight_matmul_reference,
)

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

TRITON = "__gpu$xla.gpu.triton"


def random_case(rng, m, n, k, dtype):
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1)), dtype)
    qkernel = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-4, 1e-1, n), jnp.float32)
    return x, qkernel, scale


@pytest.mark.parametrize(
    "m, n, k, dtype, out_dtype, blocks",
    [
        (40, 64, 96, jnp.float32, jnp.float32, Int8MatmulBlockSizes(16, 32, 32)),  # ragged last row tile
        (64, 64, 64, jnp.float32, jnp.float32, Int8MatmulBlockSizes(32, 16, 16, swap_ab=True)),
        (33, 128, 64, jnp.bfloat16, jnp.bfloat16, None),  # one ragged tile, default blocks
        (48, 32, 128, jnp.bfloat16, jnp.float32, Int8MatmulBlockSizes(32, 32, 64, swap_ab=True)),  # ragged + swap
        (40, 32, 128, jnp.float32, jnp.float32, Int8MatmulBlockSizes(32, 16, 16, split_k=4)),  # ragged + split K
        (32, 64, 64, jnp.bfloat16, jnp.bfloat16, Int8MatmulBlockSizes(16, 32, 16, swap_ab=True, split_k=2)),
    ],
)
def test_kernel_equals_its_reference(m, n, k, dtype, out_dtype, blocks):
    rng = np.random.default_rng()
    x, qkernel, scale = random_case(rng, m, n, k, dtype)
    got = int8_weight_matmul(x, qkernel, scale, out_dtype=out_dtype, interpret=True, block_sizes=blocks)
    want = int8_weight_matmul_reference(x, qkernel, scale, out_dtype=out_dtype)
    assert got.shape == (m, n) and got.dtype == out_dtype
    assert np.isfinite(np.asarray(got, np.float32)).all(), "an output tile was not written"
    assert_close(got, want, dtype, "int8 weight GEMM")
    # and both against float64 on the dequantized weights
    exact = np.asarray(x, np.float64) @ (np.asarray(qkernel, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    assert_close(got, exact, dtype, "int8 weight GEMM vs float64")


def test_bad_arguments_are_named():
    x, q, s = jnp.zeros((8, 64)), jnp.zeros((32, 64), jnp.int8), jnp.ones(32)
    with pytest.raises(ValueError, match="qkernel"):
        int8_weight_matmul(x, q.astype(jnp.float32), s, interpret=True)
    with pytest.raises(ValueError, match="scale"):
        int8_weight_matmul(x, q, jnp.ones(16), interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        int8_weight_matmul(x, q, s, interpret=True, block_sizes=Int8MatmulBlockSizes(16, 64, 16))
    with pytest.raises(ValueError, match="block_k"):
        Int8MatmulBlockSizes(block_k=24)
    with pytest.raises(ValueError, match="split_k"):
        int8_weight_matmul(x, q, s, interpret=True, block_sizes=Int8MatmulBlockSizes(16, 16, 16, split_k=8))
    with pytest.raises(ValueError, match="int8_gemm"):
        quantized_matmul(x, q, s, jnp.float32, int8_gemm="cuda")


def test_quantized_matmul_through_the_kernel_equals_the_xla_path():
    rng = np.random.default_rng()
    w = rng.standard_normal((64, 48)).astype(np.float32)
    q = quantize_kernel(w, "int8-weights")
    x = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)  # 10 rows: ragged
    via_kernel = quantized_matmul(x, q["qkernel"], q["scale"], jnp.float32, int8_gemm="interpret")
    via_xla = quantized_matmul(x, q["qkernel"], q["scale"], jnp.float32, int8_gemm="xla")
    assert via_kernel.shape == (2, 5, 48)
    assert_close(via_kernel, via_xla, jnp.float32, "quantized_matmul kernel vs xla")


def _lowered(fn, rows, d_in, d_out):
    args = (
        jax.ShapeDtypeStruct((rows, d_in), jnp.bfloat16),
        jax.ShapeDtypeStruct((d_out, d_in), jnp.int8),
        jax.ShapeDtypeStruct((d_out,), jnp.float32),
    )
    return lower_for_cuda(jax.jit(lambda *a: fn(*a)), *args)  # a fresh function: no cached trace


@pytest.mark.parametrize("swap_ab, split_k", [(False, 1), (True, 1), (True, 4)])
@pytest.mark.parametrize("rows, d_in, d_out", [(128, 4096, 12288), (1024, 12288, 4096), (100, 4096, 4096)])
def test_lowers_for_cuda_at_llada_8b_shapes(rows, d_in, d_out, swap_ab, split_k):
    blocks = dataclasses.replace(default_int8_block_sizes(rows, d_out, d_in), swap_ab=swap_ab, split_k=split_k)
    text = _lowered(lambda x, q, s: int8_weight_matmul(x, q, s, block_sizes=blocks), rows, d_in, d_out)
    assert "int8_weight_matmul" in text and TRITON in text


def test_auto_routes_to_the_kernel_only_below_its_row_limit(monkeypatch):
    def matmul(x, q, s):
        return quantized_matmul(x, q, s, jnp.bfloat16)

    monkeypatch.setattr(dllm_jax.common.platform, "on_nvidia_gpu", lambda: True)
    # the measured default: the kernel lost to XLA's int8 fusion at every row count on the H200
    assert INT8_KERNEL_MAX_ROWS == 0 and TRITON not in _lowered(matmul, 128, 4096, 4096)
    assert TRITON in _lowered(
        lambda x, q, s: quantized_matmul(x, q, s, jnp.bfloat16, int8_gemm="pallas"), 128, 4096, 4096
    )
    monkeypatch.setattr(dllm_jax.models.quantization, "INT8_KERNEL_MAX_ROWS", 1024)
    assert TRITON in _lowered(matmul, 128, 4096, 4096)
    assert TRITON in _lowered(matmul, 1024, 4096, 12288)
    assert TRITON not in _lowered(matmul, 4096, 4096, 4096)  # past the limit: XLA's GEMM
    assert TRITON not in _lowered(matmul, 128, 4096, 4104)  # a width the kernel does not tile
    monkeypatch.setattr(dllm_jax.common.platform, "on_nvidia_gpu", lambda: False)
    assert TRITON not in _lowered(matmul, 128, 4096, 4096)  # not an NVIDIA GPU: XLA


def test_int8_model_lowers_for_cuda_with_the_kernel(monkeypatch):
    monkeypatch.setattr(dllm_jax.common.platform, "on_nvidia_gpu", lambda: True)
    monkeypatch.setattr(dllm_jax.models.quantization, "INT8_KERNEL_MAX_ROWS", 1024)
    config = tiny_config(dtype="bfloat16", quantization="int8-weights")
    plain = dataclasses.replace(config, quantization="none")
    params = quantize_params(init_params(plain, jax.random.key(0)), "int8-weights")
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    text = lower_for_cuda(jax.jit(lambda p, t: forward(config, p, t)), params, tokens)
    assert text.count("int8_weight_matmul") >= 7, "every block projection runs the kernel"


@pytest.mark.engine
@pytest.mark.integration  # full tier: the interpreted kernels inside the decode loop
def test_engine_decodes_the_same_through_the_kernel(monkeypatch):
    """flash_cache on int8 weights, the block projections through the kernel (interpret mode)
    against XLA's path: the same tokens."""
    from dllm_jax import DecodeConfig, Engine

    config = tiny_config(quantization="int8-weights")
    params = quantize_params(init_params(tiny_config(), jax.random.key(1)), "int8-weights")
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    decode = DecodeConfig(gen_length=16, batch_size=2)
    expected = [r.token_ids for r in Engine(config, params).generate(prompts, decode).results]
    traced = []

    def through_the_kernel(*args, **kwargs):
        traced.append(args[1].shape)
        return quantized_matmul(*args, **kwargs, int8_gemm="interpret")

    monkeypatch.setattr(dllm_jax.models.layers, "quantized_matmul", through_the_kernel)
    got = [r.token_ids for r in Engine(config, params).generate(prompts, decode).results]
    assert len(traced) >= 7, "the decode loop was traced anew, through the kernel"
    assert got == expected
