"""Batch invariance in bfloat16 on the CPU: a request's answer does not depend on the batch.

tests/test_engine.py checks the same in float32; bf16 rounds every activation, so a result
that depends on how many rows share a GEMM, an attention call or a full-pass lane shows up here.
"""

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.engine.engine import Engine, GenerationError
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.kernel_routing import Kernels, resolve_kernels
from dllm_jax.sampling.params import SamplingParams
from tests.engine_checks import FAST_DUAL, FLASH, FLASH_VERIFY, one_slot

pytestmark = pytest.mark.engine

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "batch_invariance.py"
_spec = importlib.util.spec_from_file_location("batch_invariance_script", _SCRIPT)
batch_invariance_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(batch_invariance_script)


@pytest.fixture(scope="module")
def lively_bf16(lively):
    cfg, params = lively
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    return cfg, jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), params)


def _prompts(seed, lengths):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(0, 100, n)) for n in lengths]


@pytest.fixture(scope="module")
def bf16_engine(lively_bf16):
    cfg, params = lively_bf16
    return Engine(cfg, params, backend="xla")


# Flash-Verify runs every pass of the loop (full, sparse over the window, look-ahead and
# tracked rows, verify); Fast-dLLM its block pass. A pass whose rows round differently with
# the number of slots sharing it shows up in one of them (LLaDA's sampler runs the full pass
# alone, which both also run).
@pytest.mark.parametrize("decode", [FLASH_VERIFY, FAST_DUAL], ids=["flash_verify", "fast_dllm"])
@pytest.mark.integration  # full tier: batch invariance of whole decodes
def test_bf16_answers_do_not_depend_on_the_batch(bf16_engine, decode):
    engine = bf16_engine
    sampling = SamplingParams(threshold=0.5)
    many = _prompts(1, (5, 14, 8, 11, 3, 16, 9))
    together = engine.generate(many, sampling, decode_config=decode)
    assert together.stats.iterations < sum(r.steps for r in together.results), "slots ran concurrently"
    answers = [r.token_ids for r in together.results]
    assert len({tuple(a) for a in answers}) > 1, "the prompts should get different answers"
    for i in (0, 3, 5):
        alone = engine.generate([many[i]], sampling, decode_config=one_slot(decode)).results[0]
        assert (alone.token_ids, alone.steps) == (answers[i], together.results[i].steps), i


# ----- the batch-invariant mode and the leak report (scripts/batch_invariance.py)


@pytest.mark.unit
def test_invariant_kernels_replace_the_row_count_dependent_ones():
    k = resolve_kernels("pallas", interpret=True, batch_invariant=True)
    assert (k.invariant, k.matmul, k.qkv, k.attention, k.scatter) == (True, True, False, True, True)
    assert k.name == "xla+pallas-attention-scatter-matmul+invariant"
    k = resolve_kernels("xla", batch_invariant=True)
    assert (k.invariant, k.matmul, k.attention) == (True, False, False) and k.name == "xla+invariant"
    assert not resolve_kernels("xla").invariant


# On XLA's ops; the invariant Pallas kernels (what backend="pallas" chooses with
# batch_invariant=True, the GPU's choice below) are checked step by step to the end of the
# answer in test_invariant_gpu_kernels_are_bit_identical_in_every_tap.
@pytest.mark.integration  # full tier: batch invariance of whole decodes
def test_invariant_mode_answers_do_not_depend_on_the_batch(lively_bf16):
    cfg, params = lively_bf16
    engine = Engine(cfg, params, backend="xla", batch_invariant=True)
    assert engine.batch_invariant and engine.backend.endswith("+invariant")
    decode, sampling = FLASH_VERIFY, SamplingParams(threshold=0.5)
    many = _prompts(2, (5, 14, 8, 11, 3))
    together = engine.generate(many, sampling, decode_config=decode)
    assert together.stats.tokens_per_step > 1.1
    for i in (1, 4):
        alone = engine.generate([many[i]], sampling, decode_config=one_slot(decode)).results[0]
        assert (alone.token_ids, alone.steps) == (together.results[i].token_ids, together.results[i].steps), i


@pytest.mark.unit
def test_invariant_mode_rejects_what_it_cannot_run(lively_bf16):
    cfg, params = lively_bf16
    with pytest.raises(
        GenerationError, match="batch_invariant=True runs bfloat16 weights, not quantization='int8-weights'"
    ):
        Engine(dataclasses.replace(cfg, quantization="int8-weights"), params, batch_invariant=True)
    with pytest.raises(GenerationError, match="batch_invariant"):
        Engine(cfg, params, batch_invariant="yes")


@pytest.mark.integration  # full tier: batch invariance of whole decodes
def test_leak_report_compares_every_tap_bit_for_bit(bf16_engine):
    engine = bf16_engine
    decode = dataclasses.replace(FLASH, batch_size=4)
    request, *others = _prompts(3, (9, 9, 9, 9))
    report = batch_invariance_script.leak_report(engine, decode, request, others, steps=3)
    steps = report["steps"]
    assert [s["pass"] for s in steps] == ["full", "sparse", "sparse"] and steps[0]["lanes_among"] == 4
    assert all(s["logits_identical"] and s["committed_identical"] and s["first_difference"] is None for s in steps)
    assert "bit-identical over 3 steps" in batch_invariance_script.summary_line(report)

    # the comparison itself: one ulp in one valid row of one op is found, in order; invalid rows are ignored
    alone = batch_invariance_script.Run(engine, decode, [request], 0).taps()
    among = jax.tree_util.tree_map(np.copy, alone)
    bits = among["layers"]["ff_proj"].view(f"u{among['layers']['ff_proj'].dtype.itemsize}")
    rows = np.flatnonzero(alone["rows"])
    bits[1, rows[2], 3] ^= 1  # one ulp
    if (~alone["rows"]).any():  # a row outside the pass may differ
        among["layers"]["residual"][0, np.flatnonzero(~alone["rows"])[0]] += 1
    first = batch_invariance_script.first_difference(alone, among)
    assert (first["op"], first["layer"], first["differing"]) == ("ff_proj", 1, 1)


@pytest.mark.kernels
def test_invariant_decode_loop_lowers_for_cuda_at_llada_8b_widths():
    """The whole loop (flash_cache + verify) of the GPU's invariant kernels, lowered for CUDA on
    the CPU at LLaDA-8B widths (2 layers): every matmul and every norm is an invariant kernel."""
    from dllm_jax.models.config import llada_8b_config
    from dllm_jax.models.transformer import abstract_params, unstack_layers
    from dllm_jax.runtime.kernel_routing import Kernels
    from dllm_jax.runtime.slots import zero_sampling
    from tests.cuda_lowering import lower_for_cuda

    cfg = dataclasses.replace(llada_8b_config(), n_layers=2)
    engine = Engine(
        cfg,
        jax.eval_shape(unstack_layers, abstract_params(cfg)),
        backend=Kernels(attention=True, scatter=True),
        full_pass_lanes=(),
        batch_invariant=True,
    )
    assert engine.kernels.matmul and engine.backend == "xla+pallas-attention-scatter-matmul+invariant"
    decode = DecodeConfig(method="flash_cache", gen_length=256, batch_size=8, verify=True)
    loop = engine.decode_loop(decode, 256)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    state = jax.eval_shape(loop.init_state, i32(32, 256), i32(32), jax.eval_shape(lambda: zero_sampling((32,))), i32())
    text = lower_for_cuda(
        jax.jit(loop.run, donate_argnums=1), engine.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_)
    )
    assert "invariant_matmul" in text and "cache_attention" in text
    weight_dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line and "4096x" in line]
    assert not weight_dots, weight_dots[:3]  # no projection or LM head left to XLA's dot
    # Every RMSNorm is the invariant kernel: 2 layers x 2 norms + the final norm in each of the
    # loop's 3 passes, and no float32 row reduction over the model width left to XLA.
    assert text.count("call @invariant_rms_norm") == 15
    # (a maximum, like the drift rule's K/V change, is exact in any order: only sums count)
    row_sums = [
        line
        for line in text.splitlines()
        if "stablehlo.reduce" in line and "x4096xf32>" in line and "applies stablehlo.add" in line
    ]
    assert not row_sums, row_sums[:3]


@pytest.mark.unit
def test_deterministic_flags_keep_what_is_set():
    from dllm_jax import deterministic_xla_flags
    from dllm_jax.serve.cli import parse_args

    assert deterministic_xla_flags({}) == "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
    flags = deterministic_xla_flags({"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=4"}).split()
    assert flags == ["--xla_dump_to=/tmp/x", "--xla_gpu_autotune_level=4", "--xla_gpu_deterministic_ops=true"]
    assert parse_args(["--batch-invariant"]).batch_invariant and not parse_args([]).batch_invariant


@pytest.mark.integration  # full tier: batch invariance of whole decodes
def test_invariant_gpu_kernels_are_bit_identical_in_every_tap(lively_bf16):
    """The GPU's invariant kernel choice (Pallas attention, scatter and matmul; interpret mode;
    what backend="pallas" chooses with batch_invariant=True) through the leak report,
    Flash-Verify on, to the end of the answer: at every step every intermediate of the
    request's rows is bit-identical alone and among three others, and so are the tokens it
    commits, so its answer is too. (In the default mode XLA:CPU's dot itself can differ in the
    last bit between 1 and 4 slots.)"""
    cfg, params = lively_bf16
    engine = Engine(cfg, params, backend=Kernels(attention=True, scatter=True), interpret=True, batch_invariant=True)
    assert engine.backend == resolve_kernels("pallas", interpret=True, batch_invariant=True).name
    decode = DecodeConfig(
        method="flash_cache", gen_length=32, batch_size=4, threshold=0.5, mask_num=2, track_num=1, verify=True
    )
    many = _prompts(2, (5, 14, 8, 11))
    request, others = many[1], [many[0], *many[2:]]
    cap = decode.gen_length + 1  # every step commits at least one of the gen_length tokens
    steps = batch_invariance_script.leak_report(engine, decode, request, others, steps=cap)["steps"]
    assert len(steps) < cap and {s["pass"] for s in steps} == {"full", "sparse"}  # the answer ended
    assert all(s["logits_identical"] and s["committed_identical"] and s["first_difference"] is None for s in steps)
