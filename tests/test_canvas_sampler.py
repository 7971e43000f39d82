"""The canvas sampler kernel: interpret mode against its jnp reference (today's XLA path) on fresh
random rows (ties, infinities, peaked rows with zero-probability tokens, NaN rows, vocabularies
that are not a multiple of the chunk, several temperatures and splits), the argument checks, and
its CUDA lowering at the 26B-A4B shape.

Interpret mode starts every output at NaN (floats) or the int32 minimum (jax's
uninitialized_value), so an entry the kernel leaves unwritten fails these comparisons.

Tolerances: argmax, sample and finite equal the reference's exactly. Entropy and probs are
compared with float64 math on the same float32 processed logits (``_truth``), not with the
reference's: XLA drops the reference's float32 -> bf16 -> float32 round trip before the softmax
(its excess-precision simplification, xla_allow_excess_precision), so the reference's probs are
those of the unrounded logits (up to 180% apart from the rounded ones' here), and under the
tests' XLA:CPU flags (tests/conftest.py) its entropy of a peaked row is 2e-5 off. The kernel's
probs are within 2 units of their dtype plus the rounding of exp's float32 argument and 2^-16
for XLA:CPU's exp, which runs the kernel's body here (relative; entries below 1e-12 absolute),
its entropy within 1e-6 + 1e-5 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from pallas_kernels.sampling.canvas_sampler import (
    SamplerBlockSizes,
    canvas_sampler,
    canvas_sampler_reference,
    default_sampler_block_sizes,
)
from pallas_kernels.sampling.inverse_cdf import soft_cap

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

SOFTCAP = 30.0
# one unit in the last place, relative
ULP = {jnp.dtype(jnp.bfloat16): 2.0**-7, jnp.dtype(jnp.float32): 2.0**-23}


def _rows(seed: int, n: int, vocab: int, dtype):
    """n rows of logits: random, ties (rounded), +-inf entries (capped to +-cap), peaked rows
    (every other token's probability 0 in float32); temperatures and uniforms (0 and the
    largest float32 below 1 among them)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, vocab)) * 6
    logits[0] = np.round(logits[0] / 4)  # many ties, the max among them
    logits[1, rng.integers(0, vocab, 3)] = np.inf  # three tokens at the cap
    logits[1, rng.integers(0, vocab, 3)] = -np.inf
    logits[2] = -100.0
    logits[2, vocab - 1] = 100.0  # peaked on the last token, past the last full chunk
    logits[3] = -100.0
    logits[3, [5, vocab // 2]] = 100.0  # two tokens, the rest without probability
    temperature = rng.choice([0.05, 0.4, 0.8, 1.7], n).astype(np.float32)
    temperature[2:4] = 0.05  # p = +-600: the other tokens' exp(p - max) is 0
    uniform = rng.random(n).astype(np.float32)
    uniform[2:4] = np.float32(1) - np.finfo(np.float32).epsneg
    uniform[4] = 0.0
    return jnp.asarray(logits, dtype), jnp.asarray(temperature), jnp.asarray(uniform)


def _truth(logits, temperature, softcap: float = SOFTCAP):
    """float64 entropy [R] and probs [R, V] of the float32 processed logits (as XLA computes
    them), the probs' input rounded to the logits' dtype as the reference rounds it, and that
    input minus its row's max [R, V]."""
    processed = jax.jit(lambda x, t: soft_cap(x, softcap) / t[:, None])(logits, temperature)
    p = np.asarray(processed, np.float64)
    logp = p - p.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    entropy = -np.sum(np.exp(logp) * logp, axis=1)
    q = np.asarray(processed.astype(logits.dtype), np.float64)
    shifted = q - q.max(1, keepdims=True)
    probs = np.exp(shifted)
    return entropy, probs / probs.sum(1, keepdims=True), shifted


def _assert_matches(got, want, logits, temperature, rows=slice(None)):
    np.testing.assert_array_equal(np.asarray(got.argmax)[rows], np.asarray(want.argmax)[rows], "argmax")
    np.testing.assert_array_equal(np.asarray(got.sample)[rows], np.asarray(want.sample)[rows], "sample")
    np.testing.assert_array_equal(np.asarray(got.finite)[rows], np.asarray(want.finite)[rows], "finite")
    entropy, probs, shifted = (x[rows] for x in _truth(logits, temperature))
    np.testing.assert_allclose(np.asarray(got.entropy)[rows], entropy, rtol=1e-5, atol=1e-6, err_msg="entropy")
    actual = np.asarray(got.probs[rows], np.float64)
    assert np.isfinite(actual).all(), "probs: an entry left unwritten"
    # two units of the dtype, plus the rounding of exp's float32 argument (2^-24 of it, relative)
    # and XLA:CPU's exp, which runs the kernel's body in interpret mode (2^-16, relative)
    bound = (2 * ULP[jnp.dtype(logits.dtype)] + 2.0**-24 * np.abs(shifted) + 2.0**-16) * probs + 1e-12
    assert (np.abs(actual - probs) <= bound).all(), f"probs: {np.max(np.abs(actual - probs) / bound):.3g} x the bound"


@pytest.mark.parametrize(
    "vocab, dtype, blocks",
    [
        # chunks of 64 over 300 tokens (the last one 44 wide); inverse-CDF blocks of 32
        (300, jnp.bfloat16, SamplerBlockSizes(block_v=64)),
        # 10 chunks of 32 in two programs per row
        (300, jnp.bfloat16, SamplerBlockSizes(block_v=32, num_splits=2)),
        # a float32 model (nothing rounded), chunks of 128 in four programs per row
        (1000, jnp.float32, SamplerBlockSizes(block_v=128, num_splits=4)),
        # the default block sizes at a power-of-two vocabulary
        (512, jnp.bfloat16, None),
        # one chunk of 4096, where XLA:CPU dropped an astype round trip to bf16 in the kernel's
        # body (interpret mode): the rounding must survive it
        (4096, jnp.bfloat16, SamplerBlockSizes(block_v=4096)),
    ],
)
def test_kernel_statistics_equal_the_reference(vocab, dtype, blocks):
    logits, temperature, uniform = _rows(vocab, 12, vocab, dtype)
    got = canvas_sampler(logits, temperature, uniform, softcap=SOFTCAP, interpret=True, block_sizes=blocks)
    want = canvas_sampler_reference(logits, temperature, uniform, softcap=SOFTCAP)
    _assert_matches(got, want, logits, temperature)
    assert np.asarray(got.finite).all()
    # the peaked rows draw a token with probability, even at the largest uniform
    assert int(got.sample[2]) == vocab - 1 and int(got.sample[3]) == vocab // 2
    assert int(got.argmax[3]) == 5  # the tie's lowest index


def test_a_nan_row_is_flagged_and_leaves_the_others_alone():
    logits, temperature, uniform = _rows(7, 6, 200, jnp.bfloat16)
    logits = logits.at[1, 17].set(jnp.nan).at[4].set(jnp.nan)
    blocks = SamplerBlockSizes(block_v=32, num_splits=1)
    got = canvas_sampler(logits, temperature, uniform, softcap=SOFTCAP, interpret=True, block_sizes=blocks)
    want = canvas_sampler_reference(logits, temperature, uniform, softcap=SOFTCAP)
    np.testing.assert_array_equal(np.asarray(got.finite), [True, False, True, True, False, True])
    _assert_matches(got, want, logits, temperature, rows=np.array([0, 2, 3, 5]))
    assert ((np.asarray(got.argmax) >= 0) & (np.asarray(got.argmax) < 200)).all()
    assert ((np.asarray(got.sample) >= 0) & (np.asarray(got.sample) < 200)).all()


def test_default_block_sizes_fill_the_chip_and_cover_an_inverse_cdf_block():
    one_slot = default_sampler_block_sizes(256, 262144)
    assert one_slot.block_v == 4096 and one_slot.num_splits == 2
    assert default_sampler_block_sizes(1024, 262144).num_splits == 1
    assert default_sampler_block_sizes(4, 300).block_v == 512  # the whole row in one chunk
    assert default_sampler_block_sizes(4, 1 << 26).block_v == 8192  # at least the block of 8192


def test_bad_arguments_are_named():
    x, f = jnp.zeros((2, 64), jnp.bfloat16), jnp.ones((2,), jnp.float32)
    with pytest.raises(ValueError, match=r"uniform.shape=\(3,\): expected \(2,\)"):
        canvas_sampler(x, f, jnp.ones((3,)), softcap=SOFTCAP, interpret=True)
    with pytest.raises(ValueError, match="softcap=0.0: expected a number > 0"):
        canvas_sampler(x, f, f, softcap=0.0, interpret=True)
    with pytest.raises(ValueError, match="block_v=16: expected at least the inverse-CDF block 32"):
        canvas_sampler(jnp.zeros((2, 600)), f, f, softcap=SOFTCAP, block_sizes=SamplerBlockSizes(block_v=16))
    with pytest.raises(ValueError, match="num_splits=3: expected a divisor of the 4 chunks"):
        canvas_sampler(x, f, f, softcap=SOFTCAP, block_sizes=SamplerBlockSizes(block_v=16, num_splits=3))
    with pytest.raises(ValueError, match="block_v=48: expected a power of two"):
        SamplerBlockSizes(block_v=48)


def _kernel_bodies(jaxpr) -> dict[str, str]:
    """The jaxpr text of every pallas_call body in a closed jaxpr, by the call's name."""
    bodies = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            # jax 0.10 names the call "name"; later ones "name_and_src_info"
            name = eqn.params.get("name") or eqn.params["name_and_src_info"].name
            bodies[str(name)] = str(eqn.params["jaxpr"])
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                bodies.update(_kernel_bodies(inner))
    return bodies


def test_soft_cap_multiplies_by_the_reciprocal_as_xla_compiles_the_division():
    """soft_cap is, bit for bit, the model's cap * tanh(x / cap) as XLA compiles it, and the
    kernels divide per element only by the temperature (and pass 2 by the denominator): a
    division by the cap would cost the kernel an IEEE division per element that XLA never runs."""
    x = jax.random.normal(jax.random.key(3), (64, 1024), jnp.float32) * 60
    got = jax.jit(lambda x: soft_cap(x, SOFTCAP))(x)
    written = jax.jit(lambda x: jnp.tanh(x / jnp.float32(SOFTCAP)) * jnp.float32(SOFTCAP))(x)
    assert bool(jnp.all(got == written))
    spec = jax.ShapeDtypeStruct
    jaxpr = jax.make_jaxpr(lambda a, t, u: canvas_sampler(a, t, u, softcap=SOFTCAP))(
        spec((4, 1024), jnp.bfloat16), spec((4,), jnp.float32), spec((4,), jnp.float32)
    )
    divisions = {name: body.count(" div ") for name, body in _kernel_bodies(jaxpr.jaxpr).items()}
    assert divisions == {"canvas_sampler_stats": 1, "canvas_sampler_probs": 2}
    with pytest.raises(ValueError, match="cap=0.0: expected a number > 0"):
        soft_cap(x, 0.0)


def test_lowers_for_cuda_at_the_26b_a4b_shape():
    # one slot's canvas (256 rows) over DiffusionGemma's vocabulary, bf16 logits
    rows, vocab = 256, 262144
    spec = jax.ShapeDtypeStruct
    text = lower_for_cuda(
        canvas_sampler,
        spec((rows, vocab), jnp.bfloat16),
        spec((rows,), jnp.float32),
        spec((rows,), jnp.float32),
        softcap=SOFTCAP,
    )
    assert "canvas_sampler_stats" in text and "canvas_sampler_probs" in text


def test_the_canvas_loop_lowers_for_cuda_with_the_kernel_where_auto_picks_it():
    """backend "auto" on a GPU: the denoising stage is the two kernels, and the LM head writes
    bf16 (no float32 [.., V] product); the XLA path (Kernels()) keeps its float32 head."""
    from test_grouped_matmul import _canvas_config

    from dllm_jax.engine.engine import Engine
    from dllm_jax.models import diffusion_gemma as dg
    from dllm_jax.runtime.decode_config import DecodeConfig
    from dllm_jax.runtime.kernel_routing import Kernels
    from dllm_jax.runtime.slots import zero_sampling
    from tests.cuda_lowering import GPU_AUTO

    config = _canvas_config()
    params = jax.eval_shape(dg.unstack_layers, dg.abstract_params(config))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    texts = {}
    for name, backend in (("auto", GPU_AUTO), ("xla", Kernels())):
        engine = Engine(config, params, backend=backend, full_pass_lanes=())
        loop = engine.decode_loop(DecodeConfig(method="diffusion_gemma", gen_length=32, batch_size=2), 16)
        state = jax.eval_shape(loop.init_state, i32(4, 16), i32(4), jax.eval_shape(lambda: zero_sampling((4,))), i32())
        run = jax.jit(loop.run, donate_argnums=1)
        texts[name] = lower_for_cuda(run, engine.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_))
    # the head's product [2, 16, V] of the two slots' canvases
    head_f32 = f"-> tensor<2x16x{config.vocab_size}xf32>"
    head = [
        line
        for line in texts["auto"].splitlines()
        if "stablehlo.dot_general" in line and f"x{config.vocab_size}x" in line
    ]
    assert "canvas_sampler_stats" in texts["auto"] and "canvas_sampler_probs" in texts["auto"]
    assert head and not any(head_f32 in line for line in head)
    assert "canvas_sampler" not in texts["xla"]
    assert any("stablehlo.dot_general" in line and head_f32 in line for line in texts["xla"].splitlines())
