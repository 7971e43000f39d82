"""8-bit weights of DiffusionGemma (dllm_jax.models.quantization): the tree and its bytes (tiny
and 26B-A4B shapes, the canvas loop's memory estimate), the experts' per-expert quantization and
grouped GEMMs against plain references (and as float8 ragged dots for CUDA), logits close to
unquantized on a small random model and on the embedded trained one, and the embedded
tiny-diffusiongemma answering its held-out problems through the engine on 8-bit weights."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from dllm_jax.engine.engine import Engine
from dllm_jax.evaluation import tiny_tasks
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.checkpoint.hf_reader import read_checkpoint
from dllm_jax.models.diffusion_gemma_config import (
    AttentionKind,
    diffusion_gemma_26b_a4b_config,
)
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.models.experts import dense_expert_mlp, grouped_expert_mlp
from dllm_jax.models.quantization import (
    DIFFUSION_GEMMA_EXPERTS,
    dequantize_kernel,
    quantize_experts,
    quantize_params,
    quantized_ragged_dot,
    weight_bytes,
)
from dllm_jax.policies.factory import make_canvas_policy
from dllm_jax.runtime.canvas_loop import CanvasLoop
from dllm_jax.runtime.canvas_memory import estimate_canvas_loop
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.params import SamplingParams
from tests.diffusion_gemma_small import small_config

pytestmark = pytest.mark.unit

MODES = ("fp8", "int8-weights")
SLIDING, FULL = AttentionKind.SLIDING, AttentionKind.FULL


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def small():
    """small_config() and its random weights (float32, numpy leaves: quantize_params' host path)."""
    config = small_config()
    return config, jax.tree.map(np.asarray, jax.jit(dg.init_params, static_argnums=0)(config, jax.random.key(0)))


def shapes(tree):
    return jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)


# ----- the tree and its bytes ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_quantized_tree_is_the_one_the_model_builds_and_has_the_bytes_the_config_counts(small, dtype):
    config = dataclasses.replace(small[0], dtype=dtype)
    params = jax.tree.map(lambda w: w.astype(dtype), small[1])
    assert config.num_params() == dg.count_params(params) and config.weight_bytes() == weight_bytes(params)
    for mode in MODES:
        q = quantize_params(params, mode)
        q_config = dataclasses.replace(config, quantization=mode)
        assert shapes(dg.abstract_params(q_config)) == shapes(q)
        assert q_config.weight_bytes() == weight_bytes(q) < weight_bytes(params)
        for name, kind in (("sliding_layers", SLIDING), ("full_layers", FULL)):
            layer = q[name]
            projections = [layer[p] for p in ("q_proj", "k_proj", "o_proj")] + list(layer["mlp"].values())
            assert ("v_proj" in layer) == (kind is SLIDING)
            for leaf in projections + [layer["experts"][n] for n in DIFFUSION_GEMMA_EXPERTS]:
                assert set(leaf) == {"qkernel", "scale"} and leaf["scale"].dtype == jnp.float32
                assert leaf["qkernel"].dtype == (jnp.float8_e4m3fn if mode == "fp8" else jnp.int8)
            # experts: [NL, E, out, in] kept, a scale per expert and output channel
            gate_up = layer["experts"]["gate_up_proj"]
            assert gate_up["qkernel"].shape == (1, 4, 32, 32) and gate_up["scale"].shape == (1, 4, 32)
            # the router and the norms stay in the model dtype
            assert layer["router"]["proj"]["kernel"].dtype == jnp.dtype(dtype)
            assert layer["input_layernorm"]["weight"].dtype == jnp.dtype(dtype)
        # the embedding is the LM head (tied): it stays, as self-conditioning does
        assert q["embed_tokens"] is params["embed_tokens"] and q["self_conditioning"] is params["self_conditioning"]
        # per-layer tuples (the engine's unrolled layers) quantize into the same leaves
        unstacked = quantize_params(dg.unstack_layers(params), mode)
        assert shapes(unstacked) == shapes(dg.unstack_layers(q))


@pytest.mark.parametrize("mode", MODES)
def test_26b_a4b_weights_in_8_bits_and_the_canvas_loops_memory_estimate(mode):
    """50.50 GB in bf16; 26.09 GB with the projections and experts in 8 bits (the tied 1.48 GB
    embedding stays bf16). Shapes only (jax.eval_shape)."""
    plain = diffusion_gemma_26b_a4b_config()
    config = dataclasses.replace(plain, quantization=mode)
    abstract = dg.abstract_params(config)
    assert plain.weight_bytes() == weight_bytes(dg.abstract_params(plain)) == 50_501_973_624
    assert config.weight_bytes() == weight_bytes(abstract) == 26_085_610_104
    experts = abstract["sliding_layers"]["experts"]["down_proj"]
    assert experts["qkernel"].shape == (25, 128, 2816, 704) and experts["scale"].shape == (25, 128, 2816)
    decode = DecodeConfig(method="diffusion_gemma", gen_length=256, batch_size=1).for_model(config)
    loop = CanvasLoop(model=config, policy=make_canvas_policy(decode, config), num_slots=1, max_len=512, gen_length=256)
    assert estimate_canvas_loop(loop, queue_capacity=1, prompt_width=256).weights == config.weight_bytes()


# ----- the experts -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode, bound", [("fp8", 0.04), ("int8-weights", 0.01)])
def test_experts_are_quantized_per_expert_and_channel_and_host_and_device_agree(mode, bound):
    rng = np.random.default_rng(0)
    # [NL, E, out, in], channels of very different sizes
    w = rng.standard_normal((2, 3, 20, 24)).astype(np.float32) * rng.uniform(0.01, 3.0, (2, 3, 20, 1))
    w[1, 2, 5] = 0.0  # an all-zero channel
    q = quantize_experts(w, mode)
    assert q["qkernel"].shape == w.shape and q["scale"].shape == (2, 3, 20) and q["scale"][1, 2, 5] == 1.0
    back = np.asarray(q["qkernel"], np.float32) * q["scale"][..., None]
    worst = max(rel(back[l, e, j], w[l, e, j]) for l in range(2) for e in range(3) for j in range(20) if j != 5)
    assert worst < 4 * bound and np.all(back[1, 2, 5] == 0)
    for on_device in (quantize_experts(jnp.asarray(w), mode), jax.jit(quantize_experts, static_argnums=1)(w, mode)):
        np.testing.assert_array_equal(
            np.asarray(on_device["qkernel"], np.float32), np.asarray(q["qkernel"], np.float32)
        )
        np.testing.assert_array_equal(np.asarray(on_device["scale"]), q["scale"])


def routed_rows(seed: int = 3, T: int = 37, D: int = 16, E: int = 5, F: int = 12):
    """Rows, top-2 routing to the first 4 of E experts (the last gets no row) and expert weights."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, D)) * rng.uniform(0.1, 10, (T, 1)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.permutation(4)[:2] for _ in range(T)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(T, 2)), jnp.float32)
    gate_up = rng.normal(size=(E, 2 * F, D)).astype(np.float32) / D**0.5
    down = rng.normal(size=(E, D, F)).astype(np.float32) / F**0.5
    return x, weights, experts, gate_up, down


def dequantized(q) -> np.ndarray:
    """[E, out, in] float32 of a quantize_experts leaf."""
    return np.swapaxes(np.asarray(dequantize_kernel(q)), -1, -2)


@pytest.mark.parametrize("mode", MODES)
def test_the_quantized_grouped_gemm_equals_its_plain_reference(mode):
    x, _, _, gate_up, _ = routed_rows()
    sizes = np.array([10, 0, 20, 7, 0], np.int32)  # rows sorted by group; groups 1 and 4 empty
    groups = np.repeat(np.arange(5), sizes)
    q = quantize_experts(gate_up, mode)
    out = quantized_ragged_dot(x, q["qkernel"], q["scale"], jnp.asarray(sizes), jnp.asarray(groups), jnp.float32)
    xs = np.asarray(x, np.float64)
    if mode == "fp8":  # quantized_matmul's W8A8 rule: each row scaled to e4m3's 448 and rounded
        scale = np.abs(xs).max(-1, keepdims=True) / 448.0
        xs = np.asarray(jnp.asarray(xs / scale, jnp.float32).astype(jnp.float8_e4m3fn), np.float64) * scale
    w = dequantized(q).astype(np.float64)
    expected = np.stack([w[g] @ row for g, row in zip(groups, xs)])
    assert out.shape == (37, 24) and rel(out, expected) < 1e-5
    plain = np.stack([gate_up[g] @ row for g, row in zip(groups, np.asarray(x))])
    assert rel(out, plain) < (0.08 if mode == "fp8" else 0.02)


@pytest.mark.parametrize("mode, bound", [("fp8", 0.08), ("int8-weights", 1e-5)])
def test_quantized_experts_compute_the_dense_reference_over_their_dequantized_weights(mode, bound):
    """int8-weights is exactly the reference over the dequantized weights; fp8 also rounds the
    gathered rows and the hidden rows to e4m3."""
    x, weights, experts, gate_up, down = routed_rows()
    q_gate_up, q_down = quantize_experts(gate_up, mode), quantize_experts(down, mode)
    grouped = jax.jit(grouped_expert_mlp)(x, weights, experts, q_gate_up, q_down)
    dense = jax.jit(dense_expert_mlp)(x, weights, experts, dequantized(q_gate_up), dequantized(q_down))
    assert grouped.shape == x.shape and rel(grouped, dense) < bound


@pytest.mark.parametrize("mode, operand", [("fp8", "f8E4M3FN"), ("int8-weights", "bf16")])
def test_the_experts_reach_cuda_as_ragged_dots_on_8_bit_or_converted_weights(mode, operand):
    """fp8: both grouped GEMMs are float8 x float8 ragged dots (XLA's FP8 GEMMs on Hopper), not
    weights dequantized into a bf16 one; int8-weights: the int8 weights converted into bf16 ones."""
    T, D, E, F = 64, 32, 4, 16
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16)
    routing = jax.ShapeDtypeStruct((T, 2), jnp.float32), jax.ShapeDtypeStruct((T, 2), jnp.int32)
    qdtype = jnp.float8_e4m3fn if mode == "fp8" else jnp.int8
    leaf = lambda out, inp: {  # noqa: E731
        "qkernel": jax.ShapeDtypeStruct((E, out, inp), qdtype),
        "scale": jax.ShapeDtypeStruct((E, out), jnp.float32),
    }
    text = lower_for_cuda(jax.jit(grouped_expert_mlp), x, *routing, leaf(2 * F, D), leaf(D, F))
    dots = [line for line in text.splitlines() if "chlo.ragged_dot" in line]
    assert len(dots) == 2, dots
    for line in dots:  # "(tensor<MxKxT>, tensor<ExNxKxT>, tensor<Exi32>) -> ..."
        lhs, rhs = line.split(" : (")[1].split(", ")[:2]
        assert lhs.endswith(f"x{operand}>") and rhs.endswith(f"x{operand}>"), line


# ----- the model -------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _logits(config, weights, prompt, canvas):
    """The decoder's logits of a canvas after the prompt, then of a self-conditioned second step:
    float32 [2, B, L, V]."""
    cache, _ = dg.encode(config, weights, prompt, dg.init_cache(config, prompt.shape[0], 64))
    first = dg.decode(config, weights, canvas, cache)
    return jnp.stack([first, dg.decode(config, weights, canvas, cache, first)])


def _inputs(config, batch: int = 2, prompt_length: int = 20):
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(3, config.vocab_size, (batch, prompt_length)), jnp.int32)
    return prompt, jnp.asarray(rng.integers(3, config.vocab_size, (batch, config.canvas_length)), jnp.int32)


def _dequantized_tree(tree, experts: bool = False):
    """The unquantized tree a quantized one stands for (kernels back to [in, out])."""
    if not isinstance(tree, dict):
        return tree
    if set(tree) == {"qkernel", "scale"}:
        w = dequantized(tree)
        return w if experts else {"kernel": np.swapaxes(w, -1, -2)}
    return {k: _dequantized_tree(v, experts=experts or k == "experts") for k, v in tree.items()}


def test_int8_weights_compute_the_model_over_their_dequantized_weights(small):
    """Every 8-bit leaf is read as what it stands for: the int8-weights model equals the plain
    model over the dequantized weights (the order of the scaling is all that differs). On random
    weights the quantization error itself is amplified from layer to layer (logits 2-6% off for
    int8-weights, 12-35% for fp8 at two layers, against 0.6% and 2.5% on the trained tiny model:
    the next test), so closeness is checked on the trained model."""
    config, weights = small
    prompt, canvas = _inputs(config)
    q = quantize_params(weights, "int8-weights")
    expected = _logits(config, _dequantized_tree(q), prompt, canvas)
    got = _logits(dataclasses.replace(config, quantization="int8-weights"), q, prompt, canvas)
    assert rel(got, expected) < 1e-5
    assert rel(got, _logits(config, weights, prompt, canvas)) > 1e-3  # the quantization is not a no-op


@pytest.fixture(scope="module")
def embedded_weights():
    info, weights = read_checkpoint(tiny_model_path("tiny-diffusiongemma"), dtype="float32")
    return info.config, jax.tree.map(jnp.asarray, weights)


@pytest.mark.parametrize("mode, logit_bound, agreement", [("fp8", 0.06, 0.9), ("int8-weights", 0.015, 0.95)])
def test_quantized_logits_of_the_trained_tiny_model_stay_close(embedded_weights, mode, logit_bound, agreement):
    config, weights = embedded_weights
    prompt, canvas = _inputs(config)
    expected = _logits(config, weights, prompt, canvas)
    got = _logits(dataclasses.replace(config, quantization=mode), quantize_params(weights, mode), prompt, canvas)
    assert rel(got, expected) < logit_bound
    assert float(jnp.mean(got.argmax(-1) == expected.argmax(-1))) >= agreement


# The first 16 held-out problems through the engine (the tiny model's generation_config values,
# seed 0, 8 slots, two canvases): 9 solved on the unquantized weights, 8 on each 8-bit mode
# (measured on the CPU); the bound leaves one more problem for float differences between
# JAX versions that change a sampled token.
PROBLEMS, PLAIN_SOLVED = 16, 9
TINY_SAMPLING = SamplingParams(
    max_denoising_steps=16, t_min=0.1, t_max=0.5, entropy_bound=1.0, stability_threshold=1, confidence_threshold=0.01
)


# Each mode compiles its own loop: its weights are other dtypes, so the program differs.
@pytest.mark.integration  # a whole evaluation per mode: 16 held-out problems
@pytest.mark.parametrize("mode", MODES)
def test_the_embedded_model_answers_held_out_problems_on_8_bit_weights(mode):
    engine = Engine.from_pretrained("tiny-diffusiongemma", dtype="float32", quantization=mode)
    stack = engine.weights["sliding_layers"]  # stacked, or per layer once unrolled
    experts = (stack[0] if isinstance(stack, tuple) else stack)["experts"]
    assert engine.config.quantization == mode and set(experts["down_proj"]) == {"qkernel", "scale"}
    problems = tiny_tasks.held_out_problems(PROBLEMS)
    decode = DecodeConfig(method="diffusion_gemma", gen_length=64, batch_size=8)
    out = engine.generate([p.prompt for p in problems], TINY_SAMPLING, decode_config=decode, chat=True, seed=0)
    solved = sum(tiny_tasks.is_correct(p, r.text) for p, r in zip(problems, out.results))
    assert solved >= PLAIN_SOLVED - 2, [r.text for r in out.results]
