"""The Mosaic GPU weight-only int8 GEMM on the CPU: its jnp reference against float64 on fresh
random inputs, its tiling rules, its CUDA lowering at LLaDA-8B shapes (jax >= 0.11: jax 0.10's
Mosaic GPU layout inference rejects its epilogue), and quantized_matmul's routing, which must
never pick it where the running JAX cannot build it.

No interpret-mode test: Pallas' Mosaic GPU interpreter takes a wgmma's left operand from
shared memory only, and this kernel feeds it from registers (the dequantized weights). The
kernel's results are checked against the reference on the GPU by scripts/gpu/one_request.py.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from tolerances import assert_close

import dllm_jax.models.quantization
from dllm_jax.models.quantization import WEIGHT_ONLY_MAX_ROWS, quantize_kernel, quantized_matmul
from pallas_kernels.matmul import weight_only_matmul as wo

pytestmark = pytest.mark.kernels

MOSAIC = "mosaic_gpu"
needs_jax_011 = pytest.mark.skipif(
    not wo.available(), reason=f"jax {jax.__version__} cannot build the Mosaic GPU kernel"
)


def random_case(rng, m, n, k):
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1)), jnp.bfloat16)
    qkernel = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-4, 1e-1, n), jnp.float32)
    return x, qkernel, scale


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_reference_equals_float64_on_the_dequantized_weights(out_dtype):
    rng = np.random.default_rng()
    x, qkernel, scale = random_case(rng, 24, 40, 72)
    got = wo.weight_only_matmul_reference(x, qkernel, scale, out_dtype=out_dtype)
    exact = np.asarray(x, np.float64) @ (np.asarray(qkernel, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    assert got.shape == (24, 40) and got.dtype == out_dtype
    assert_close(
        got, exact, jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32, "weight-only reference vs float64"
    )


def test_bad_arguments_are_named():
    x, q, s = jnp.zeros((128, 256), jnp.bfloat16), jnp.zeros((128, 256), jnp.int8), jnp.ones(128)
    with pytest.raises(ValueError, match="x"):
        wo.weight_only_matmul_reference(x.astype(jnp.float32), q, s)
    with pytest.raises(ValueError, match="qkernel"):
        wo.weight_only_matmul_reference(x, q.astype(jnp.bfloat16), s)
    with pytest.raises(ValueError, match="scale"):
        wo.weight_only_matmul_reference(x, q, jnp.ones(64))
    with pytest.raises(ValueError, match="tile_n"):
        wo.WeightOnlyConfig(tile_n=96)
    with pytest.raises(ValueError, match="split_k"):
        wo.WeightOnlyConfig(split_k=3)
    with pytest.raises(ValueError, match="K % 512"):  # K = 256 cannot be split in 4 steps of 128
        wo.weight_only_matmul(x, q, s, config=wo.WeightOnlyConfig(split_k=4))


@pytest.mark.parametrize(
    "m, n, k",
    [
        (128, 4096, 4096),
        (128, 12288, 4096),
        (128, 4096, 12288),
        (640, 4096, 4096),
        (1024, 12288, 4096),
        (16, 126464, 4096),
    ],
)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_default_tiling_fits_llada_8b_shapes_and_fills_the_sms(m, n, k, out_dtype):
    config = wo.default_config(m, n, k, out_dtype)
    assert wo.supports(m, n, k, config, out_dtype)
    assert config.smem_bytes(out_dtype) <= wo._SMEM_LIMIT
    units = (m // config.tile_m) * (n // (2 * config.tile_n)) * config.split_k
    assert units >= wo.NUM_SMS // 2, f"{config.name}: {units} work units for {wo.NUM_SMS} SMs"
    # 32-bit results are written transposed (no 32-bit transposing shared-memory store)
    assert config.writes_transposed(out_dtype) or (config.split_k == 1 and jnp.dtype(out_dtype).itemsize == 2)


def test_supports_rejects_what_it_cannot_tile():
    assert not wo.supports(100, 4096, 4096)  # rows not a multiple of 8
    assert not wo.supports(128, 4104, 4096)  # channels not a multiple of 128
    assert not wo.supports(
        128, 4096, 4096, wo.WeightOnlyConfig(tile_m=128, tile_k=128, max_concurrent_steps=8)
    )  # shared memory


@needs_jax_011
@pytest.mark.parametrize(
    "m, n, k, out_dtype, config",
    [
        (128, 4096, 4096, jnp.bfloat16, None),  # split K, float32 partial products
        (128, 4096, 4096, jnp.float32, None),
        (128, 12288, 4096, jnp.bfloat16, None),  # y stored through the transposed shared-memory view
        (128, 12288, 4096, jnp.float32, None),  # float32 y, written transposed
        (1024, 12288, 4096, jnp.bfloat16, None),  # 256-row tiles
        (16, 126464, 4096, jnp.bfloat16, None),  # the LM head's window rows
        (
            128,
            4096,
            4096,
            jnp.bfloat16,
            wo.WeightOnlyConfig(tile_m=128, tile_n=64, tile_k=128, max_concurrent_steps=4, transposed_out=True),
        ),
        (
            128,
            4096,
            4096,
            jnp.bfloat16,
            wo.WeightOnlyConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, split_k=2),
        ),
    ],
)
def test_lowers_for_cuda_at_llada_8b_shapes(m, n, k, out_dtype, config):
    assert wo.supports(m, n, k, config, out_dtype)
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k), jnp.int8),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    text = lower_for_cuda(
        jax.jit(lambda x, q, s: wo.weight_only_matmul(x, q, s, out_dtype=out_dtype, config=config)), *args
    )
    assert MOSAIC in text


def _lowered_matmul(rows, d_in, d_out, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16):
    args = (
        jax.ShapeDtypeStruct((rows, d_in), dtype),
        jax.ShapeDtypeStruct((d_out, d_in), jnp.int8),
        jax.ShapeDtypeStruct((d_out,), jnp.float32),
    )
    return lower_for_cuda(jax.jit(lambda x, q, s: quantized_matmul(x, q, s, out_dtype)), *args)


def test_auto_routes_to_the_kernel_only_where_it_measured_faster_and_builds(monkeypatch):
    monkeypatch.setattr(wo, "on_hopper_gpu", lambda: True)
    assert WEIGHT_ONLY_MAX_ROWS == 128  # the measured limit (dllm_jax.models.quantization)
    routed = (
        MOSAIC in _lowered_matmul(128, 4096, 12288),
        MOSAIC in _lowered_matmul(128, 4096, 4096, out_dtype=jnp.float32),
    )
    # the version check is not patched: jax 0.10 must never route to a kernel it cannot build
    assert routed == ((True, True) if wo.available() else (False, False))
    assert MOSAIC not in _lowered_matmul(640, 4096, 4096)  # past the limit: XLA
    assert MOSAIC not in _lowered_matmul(128, 4096, 4104)  # a width it does not tile
    assert MOSAIC not in _lowered_matmul(128, 4096, 4096, dtype=jnp.float32)  # float32 activations
    monkeypatch.setattr(wo, "on_hopper_gpu", lambda: False)
    assert MOSAIC not in _lowered_matmul(128, 4096, 4096)


def test_forcing_the_kernel_names_the_jax_that_cannot_build_it():
    rng = np.random.default_rng()
    q = quantize_kernel(rng.standard_normal((256, 256)).astype(np.float32), "int8-weights")
    x = jnp.zeros((128, 256), jnp.bfloat16)
    if wo.available():
        args = (
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((256, 256), jnp.int8),
            jax.ShapeDtypeStruct((256,), jnp.float32),
        )
        text = lower_for_cuda(
            jax.jit(lambda x, q, s: quantized_matmul(x, q, s, jnp.bfloat16, int8_gemm="mosaic")), *args
        )
        assert MOSAIC in text
    else:
        with pytest.raises(ValueError, match=jax.__version__):
            quantized_matmul(x, q["qkernel"], q["scale"], jnp.bfloat16, int8_gemm="mosaic")


@needs_jax_011
def test_int8_decode_loop_lowers_for_cuda_with_the_kernel_on_one_slot(monkeypatch):
    """The 1-slot flash_cache loop at LLaDA-8B shape: the sparse step's 7 projections per layer
    run the kernel, the 640-row full pass stays with XLA."""
    from cuda_lowering import GPU_AUTO

    from dllm_jax.engine.engine import Engine
    from dllm_jax.models.config import llada_8b_config
    from dllm_jax.models.transformer import abstract_params, unstack_layers
    from dllm_jax.runtime.decode_config import DecodeConfig
    from dllm_jax.runtime.slots import zero_sampling

    monkeypatch.setattr(wo, "on_hopper_gpu", lambda: True)
    config = dataclasses.replace(llada_8b_config(), n_layers=2, quantization="int8-weights")
    engine = Engine(
        config, jax.eval_shape(unstack_layers, abstract_params(config)), backend=GPU_AUTO, full_pass_lanes=()
    )
    loop = engine.decode_loop(DecodeConfig(method="flash_cache", gen_length=256, batch_size=1), 256)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    state = jax.eval_shape(loop.init_state, i32(16, 256), i32(16), jax.eval_shape(lambda: zero_sampling((16,))), i32())
    text = lower_for_cuda(
        jax.jit(loop.run, donate_argnums=1), engine.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_)
    )
    # each call of the jitted kernel function is a call of its lowered function
    assert len(re.findall(r"call @weight_only_matmul", text)) == 7 * config.n_layers


def test_quantized_matmul_default_is_the_xla_path_on_a_cpu():
    rng = np.random.default_rng()
    q = quantize_kernel(rng.standard_normal((256, 128)).astype(np.float32), "int8-weights")
    x = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
    got = quantized_matmul(x, q["qkernel"], q["scale"], jnp.float32)
    want = wo.weight_only_matmul_reference(x, q["qkernel"], q["scale"], out_dtype=jnp.float32)
    assert_close(got, want, jnp.float32, "quantized_matmul on a CPU vs the weight-only reference")
    assert dllm_jax.models.quantization.WEIGHT_ONLY_MAX_ROWS >= 128
