"""The fp8 path with each projection's input quantized once by its producer (RMSNorm + quantize,
SwiGLU + quantize: layers.Fp8Producers) and, at one slot's sparse step, q/k/v through the fused
Mosaic GPU FP8 kernel: the routing, today's fp8 numbers on the CPU (float32, the kernels in
interpret mode), and the loop lowered for CUDA without XLA's quantization passes.

The decoded tokens with the producers are checked in tests/test_quantization.py, beside the fp8
engine whose compiled loop they reuse.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_dream_config
from cuda_lowering import GPU_AUTO, GPU_FP8_FUSED, lower_for_cuda
from tolerances import assert_close, rel_l2

import dllm_jax.common.platform
import pallas_kernels.matmul.weight_only_matmul
import pallas_kernels.projection.qkv_rope_cache_mosaic as fused
import pallas_kernels.projection.quantize_rows as producers
from dllm_jax.engine.engine import Engine
from dllm_jax.models.config import llada_8b_config
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.models.loading import load_model
from dllm_jax.models.quantization import quantize_params
from dllm_jax.models.transformer import abstract_params, init_params, unstack_layers
from dllm_jax.runtime.cached_forward import PassSpec, cached_forward
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.flat_cache import allocate_cache
from dllm_jax.runtime.kernel_routing import (
    FP8_FUSED_QKV_ROWS,
    Kernels,
    fused_fp8_qkv,
    pass_producers,
    resolve_kernels,
)
from dllm_jax.runtime.sharding import parse_mesh
from dllm_jax.runtime.slots import zero_sampling

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

JAX_0_10 = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)
PRODUCERS = Kernels(fp8_producers=True, interpret=True)


def spy(monkeypatch, calls: Counter, module, name: str, replacement=None) -> None:
    """Counts the calls of module.name in calls[name] (at trace time), optionally running
    `replacement` instead."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return (replacement or original)(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


# ----------------------------------------------------------------------------- routing


def test_auto_leaves_the_quantization_to_xla_and_the_producers_are_opt_in(monkeypatch):
    """On the H200 the producers did not beat XLA's quantization in the step (BENCHMARKS.md,
    2026-12-03), so auto keeps XLA's; Kernels takes them (and the fused kernel) explicitly."""
    assert resolve_kernels("auto") == Kernels()  # this CPU: today's XLA path
    monkeypatch.setattr(dllm_jax.common.platform, "on_nvidia_gpu", lambda: True)
    monkeypatch.setattr(pallas_kernels.matmul.weight_only_matmul, "on_hopper_gpu", lambda: True)
    gpu = resolve_kernels("auto")
    assert gpu == GPU_AUTO and not gpu.fp8_producers and gpu.fp8_fused_qkv_rows == 0
    assert GPU_FP8_FUSED.fp8_fused_qkv_rows == FP8_FUSED_QKV_ROWS and GPU_FP8_FUSED.fp8_producers
    assert GPU_FP8_FUSED.name == GPU_AUTO.name == "xla+pallas-attention-scatter"  # nothing changes for other models
    with pytest.raises(ValueError, match="fp8_fused_qkv_rows needs fp8_producers"):
        Kernels(fp8_fused_qkv_rows=128)


def test_the_producers_and_the_fused_kernel_apply_only_where_they_can():
    fp8 = tiny_config(d_model=128, n_heads=2, mlp_hidden_size=128, dtype="bfloat16", quantization="fp8")
    spec = PassSpec(max_len=64, kernels=Kernels(fp8_producers=True, fp8_fused_qkv_rows=128))
    assert pass_producers(fp8, spec) is not None
    assert pass_producers(dataclasses.replace(fp8, quantization="int8-weights"), spec) is None
    assert pass_producers(fp8, PassSpec(max_len=64)) is None
    # a row's SwiGLU output (and its abs-max) is split across a tensor axis
    tensor = dataclasses.replace(spec, mesh=parse_mesh("tensor=2", jax.devices()[:2]))
    assert pass_producers(fp8, tensor) is None and not fused_fp8_qkv(fp8, tensor, 128)
    assert fused_fp8_qkv(fp8, spec, 128) and not fused_fp8_qkv(fp8, spec, 129)
    assert not fused_fp8_qkv(dataclasses.replace(fp8, dtype="float32"), spec, 128)  # bfloat16 caches only
    assert not fused_fp8_qkv(dataclasses.replace(fp8, n_heads=4, n_kv_heads=2), spec, 128)  # head_dim 32


# ----------------------------------------------------------------------------- one pass, float32


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream"])
def fp8_pass(request):
    """A pass of an embedded tiny model in fp8 (float32 activations; Dream: q/k/v biases and
    grouped-query heads): two groups of 64 rows (padding rows in the first) over a fresh
    cache, as a function of the kernel choice; and today's result (no producers)."""
    model = load_model(tiny_model_path(request.param), dtype="float32")
    config = dataclasses.replace(model.config, quantization="fp8")
    weights = quantize_params(model.weights, "fp8")
    S, L = 2, 64
    tokens = jax.random.randint(jax.random.key(0), (S, L), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (S, L))
    key_len = jnp.array([50, 63])
    candidates = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32) + 30, (S, 16))

    def run(kernels: Kernels):
        spec = PassSpec(max_len=L, kernels=kernels)
        logits, _, cache = cached_forward(
            config, spec, weights, allocate_cache(config, S, L), tokens, positions, positions < key_len[:, None],
            None, key_len, candidates,
        )  # fmt: skip
        return logits, cache

    return run, run(Kernels())


def test_with_the_producers_references_the_pass_is_todays_bit_for_bit(fp8_pass, monkeypatch):
    """The wiring alone: quantized once by the producers' jnp references (the model's op, then
    the engine's quantization rule), every projection, logit and cache row is as today."""
    run, (logits, cache) = fp8_pass
    calls = Counter()
    spy(monkeypatch, calls, producers, "rms_norm_quantize", producers.rms_norm_quantize_reference)
    spy(monkeypatch, calls, producers, "swiglu_quantize", producers.swiglu_quantize_reference)
    got_logits, got_cache = run(PRODUCERS)
    assert calls["rms_norm_quantize"] and calls["swiglu_quantize"]
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(cache.k))
    np.testing.assert_array_equal(np.asarray(got_cache.v), np.asarray(cache.v))


def test_with_the_interpreted_producers_the_pass_is_todays_up_to_rounding(fp8_pass, monkeypatch):
    """The kernels order their sums differently, so a float8 element of a row sometimes rounds
    the other way (one step of e4m3 is 6-12%); over 6 layers that moves the logits by about
    1% (fp8 against float32: 5%), not their argmax."""
    run, (logits, cache) = fp8_pass
    calls = Counter()
    spy(monkeypatch, calls, producers, "rms_norm_quantize")
    spy(monkeypatch, calls, producers, "swiglu_quantize")
    got_logits, got_cache = run(PRODUCERS)
    assert calls["rms_norm_quantize"] and calls["swiglu_quantize"]
    assert rel_l2(got_logits, logits) < 0.03
    assert float(jnp.mean(got_logits.argmax(-1) == logits.argmax(-1))) >= 0.95
    for got, want in ((got_cache.k, cache.k), (got_cache.v, cache.v)):
        assert rel_l2(got, want) < 0.03


# ----------------------------------------------------------------------------- the fused kernel


def fused_model(dream: bool):
    """An fp8 model the fused kernel takes: bfloat16, head_dim 64, d_model 128 (Dream: q/k/v
    biases, 2 query heads per kv head)."""
    make = tiny_dream_config if dream else tiny_config
    config = make(d_model=128, n_heads=2, n_kv_heads=1 if dream else 2, mlp_hidden_size=128, dtype="bfloat16")
    weights = init_params(config, jax.random.key(1))
    if dream:  # random biases (init_params makes them zero)
        for name in ("q_proj", "k_proj", "v_proj"):
            bias = weights["layers"][name]["bias"]
            weights["layers"][name]["bias"] = jax.random.normal(jax.random.key(2), bias.shape, bias.dtype)
    return dataclasses.replace(config, quantization="fp8"), quantize_params(weights, "fp8")


@pytest.mark.parametrize("dream, layout", [(False, "stacked"), (True, "per-layer")], ids=["llada", "dream"])
def test_the_fused_kernel_projects_and_writes_the_cache_like_the_producers_path(monkeypatch, dream, layout):
    """One slot's pass of 128 rows (at the routing's limit) through the fused FP8 kernel gives
    the producers path's logits and cache rows, over layer-stacked weights (indexed in place)
    and per-layer ones. jax 0.10's Mosaic GPU interpreter cannot run the FP8 kernel (its
    transposed shared-memory tiles), so there its jnp reference stands in: the same
    signature, the kernel checked against it in test_qkv_rope_cache_mosaic.py."""
    config, weights = fused_model(dream)
    if layout == "per-layer":
        weights = unstack_layers(weights)
    calls = Counter()
    reference = fused.qkv_rope_cache_mosaic_fp8_reference if JAX_0_10 else None
    spy(monkeypatch, calls, fused, "qkv_rope_cache_mosaic_fp8", reference)
    L, R = 160, 128
    tokens = jax.random.randint(jax.random.key(3), (1, R), 0, config.vocab_size)
    positions = jnp.arange(R, dtype=jnp.int32)[None] + 20
    valid = jnp.arange(R)[None] < 120  # the last rows are padding: they write the trash row
    key_len = jnp.array([140])

    def run(kernels):
        # old cache rows below position 20, so the attention reads the rows the pass did not write
        cache = allocate_cache(config, 1, L)
        cache = jax.tree_util.tree_map(lambda c: c.at[:, :20].set(0.5), cache)
        spec = PassSpec(max_len=L, kernels=kernels)
        one_pass = jax.jit(functools.partial(cached_forward, config, spec))
        logits, _, cache = one_pass(weights, cache, tokens, positions, valid, None, key_len, jnp.arange(16)[None])
        return logits, cache

    logits, cache = run(dataclasses.replace(PRODUCERS, fp8_fused_qkv_rows=R))
    assert calls["qkv_rope_cache_mosaic_fp8"] == (1 if layout == "stacked" else config.n_layers)
    want_logits, want_cache = run(PRODUCERS)
    assert calls["qkv_rope_cache_mosaic_fp8"] == (1 if layout == "stacked" else config.n_layers)
    assert_close(logits, want_logits, jnp.bfloat16, "logits")
    written = slice(20, 140)
    for got, want, name in ((cache.k, want_cache.k, "k"), (cache.v, want_cache.v, "v")):
        assert_close(got[:, written], want[:, written], jnp.bfloat16, name)
        np.testing.assert_array_equal(np.asarray(got[:, :20]), np.asarray(want[:, :20]))


# ----------------------------------------------------------------------------- CUDA lowering


def lowered_one_slot_loop(kernels: Kernels) -> str:
    """The 1-slot flash_cache + verify loop of a 2-layer fp8 model of LLaDA-8B's widths (per-layer
    weights, as on a GPU) lowered for CUDA: a full pass of 640 rows, the 128-row sparse step,
    the verify pass."""
    config = dataclasses.replace(llada_8b_config(), n_layers=2, quantization="fp8")
    engine = Engine(
        config, jax.eval_shape(unstack_layers, abstract_params(config)), backend=kernels, full_pass_lanes=()
    )
    loop = engine.decode_loop(DecodeConfig(method="flash_cache", gen_length=256, batch_size=1, verify=True), 256)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    state = jax.eval_shape(loop.init_state, i32(16, 256), i32(16), jax.eval_shape(lambda: zero_sampling((16,))), i32())
    run = jax.jit(loop.run, donate_argnums=1)
    return lower_for_cuda(run, engine.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_))


def quantization_passes(text: str) -> Counter:
    """XLA's per-row abs-max reductions (float32 rows -> a max per row) by row width."""
    widths = re.findall(r"applies stablehlo\.maximum across dimensions = \[2\] : \(tensor<\d+x\d+x(\d+)xf32>", text)
    return Counter(int(w) for w in widths)


def test_the_fp8_loop_lowers_for_cuda_with_the_producers_and_without_xla_quantization_passes():
    config = llada_8b_config()
    D, F, layers, passes = config.d_model, config.mlp_hidden_size, 2, 3
    today = lowered_one_slot_loop(GPU_AUTO)
    text = lowered_one_slot_loop(GPU_FP8_FUSED)
    before, after = quantization_passes(today), quantization_passes(text)
    # per layer and pass XLA quantized q, k, v, attn_out, gate and up's D-wide rows and down's
    # F-wide ones; only attn_out's (the attention kernel's output) remain
    assert before[F] == layers * passes and after[F] == 0
    assert before[D] - after[D] == 5 * layers * passes
    convert = rf"stablehlo\.convert [^\n]*-> tensor<[0-9x]*x{F}xf8E4M3FN>"  # F-wide rows to float8 in XLA
    assert re.search(convert, today) and not re.search(convert, text)
    for kernel in ("rms_norm_quantize", "swiglu_quantize"):
        assert f'name = "{kernel}"' in text and f'name = "{kernel}"' not in today
    # SwiGLU reads the gate and up GEMMs' products and their scales: no scaled copy between
    call = r"call @swiglu_quantize(?:_\d+)?\([^)]*\) : "
    scaled_inputs = call + rf"\((?:tensor<\d+x{F}xbf16>, ){{2}}tensor<\d+xf32>, tensor<{F}xf32>, tensor<{F}xf32>\)"
    assert len(re.findall(scaled_inputs, text)) == len(re.findall(call, text)) == layers * passes
    # the sparse step's q/k/v of each layer in the fused kernel (its 128 rows), not the others
    assert len(re.findall(r"call @qkv_rope_cache_mosaic_fp8\(", text)) == layers
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
