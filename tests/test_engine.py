"""The decode engine against a plain-Python reference, on a tiny random model (float32).

The tests decode with the session's shared engine and loops (tests/engine_checks.py); a test
builds an engine of its own where it counts compilations or changes an engine option.
"""

import dataclasses
import warnings

import numpy as np
import pytest

from dllm_jax.engine.engine import Engine, GenerationError
from dllm_jax.runtime.decode_config import DecodeConfig, DecodeConfigError
from dllm_jax.sampling.params import SamplingParams
from tests.engine_checks import (
    EXACT_REFRESH,
    FAST_DUAL,
    FAST_PREFIX,
    FLASH,
    LLADA,
    assert_batching_invariance,
    assert_block_method_matches_reference,
    assert_decodes_like_the_no_cache_model,
    assert_flash_cache_matches_reference,
    one_slot,
    random_prompts,
)

pytestmark = pytest.mark.engine

# no look-ahead masks and no tracked tokens: the window alone (the sparse pass's smallest rows)
FLASH_WINDOW_ONLY = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, mask_num=1, track_num=0)


@pytest.fixture(scope="module")
def engine(lively_engine):
    return lively_engine


@pytest.fixture(scope="module")
def prompts():
    return random_prompts()


@pytest.mark.parametrize(
    "decode, threshold",
    [(FLASH, 0.3), (FLASH, 2.0), (FLASH_WINDOW_ONLY, 0.2)],
    ids=["mask2-track1-t0.3", "mask2-track1-t2.0", "mask1-track0-t0.2"],
)
def test_flash_cache_matches_the_python_reference(engine, prompts, decode, threshold):
    assert_flash_cache_matches_reference(engine, prompts, decode, SamplingParams(threshold=threshold))


def test_answers_end_at_the_first_committed_eos(engine, prompts):
    out = engine.generate(prompts, SamplingParams(threshold=0.5), decode_config=FLASH)
    ended = [r for r in out.results if r.reference_num_tokens < 32]
    assert ended, "the lively model commits EOS for some prompts"
    for r in ended:
        # everything before the EOS bound is decoded, nothing after it is generated
        assert r.reference_num_tokens >= len(r.token_ids) + 1
        assert engine.config.mask_token_id not in r.token_ids


@pytest.mark.parametrize("method", list(EXACT_REFRESH))
def test_exact_refresh_reproduces_the_no_cache_model(engine, prompts, method):
    assert_decodes_like_the_no_cache_model(engine, prompts, EXACT_REFRESH[method], SamplingParams(threshold=0.5))


@pytest.mark.parametrize(
    "decode",
    [
        LLADA,
        DecodeConfig(method="llada", gen_length=32, block_length=8, steps=12, batch_size=2),
        FAST_PREFIX,
        FAST_DUAL,
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=8, cache="dual", steps=8, batch_size=2),
    ],
    ids=["llada-2perstep", "llada-uneven", "fast-prefix", "fast-dual", "fast-dual-schedule"],
)
def test_block_methods_match_the_python_reference(engine, prompts, decode):
    sampling = SamplingParams() if decode.fixed_schedule else SamplingParams(threshold=0.5)
    assert_block_method_matches_reference(engine, prompts, decode, sampling)


@pytest.mark.parametrize(
    "decode, sampling",
    [
        (FLASH, SamplingParams(threshold=0.5)),
        (FAST_DUAL, SamplingParams(threshold=0.5)),
        (LLADA, SamplingParams(temperature=0.7, seed=3)),
    ],
    ids=["flash", "fast_dllm", "llada-sampled"],
)
def test_continuous_batching_and_batch_invariance(engine, decode, sampling):
    """More requests than slots, mixed lengths: results in order, independent of the batching.

    A request's random stream depends on (seed, its index in the call, step), never on its slot.
    """
    assert_batching_invariance(engine, decode, sampling)


def test_a_request_ring_smaller_than_the_stream_never_stalls(lively, engine):
    """Request g waits for request g - Q's result; while that one still decodes, the other
    slots keep stepping (a free slot must not stop the loop for a push the host cannot make).
    Rings of 1 (fewer entries than slots) and 3 (more, not a power of two) entries."""
    cfg, params = lively
    sampling = SamplingParams(threshold=0.5)
    many = random_prompts((5, 14, 8, 11, 3, 16, 9, 7, 12, 4), seed=4)
    wide = engine.generate(many, sampling, decode_config=FLASH)
    steps = [r.steps for r in wide.results]
    assert any(steps[g] > steps[g + 1] for g in range(len(many) - 1)), "some request must outlast the next one"
    for capacity in (1, 3):
        tight = Engine(cfg, params, backend="xla", queue_capacity=capacity, chunk_iterations=4)
        out = tight.generate(many, sampling, decode_config=FLASH)
        assert [r.token_ids for r in out.results] == [r.token_ids for r in wide.results], capacity
        assert [r.steps for r in out.results] == steps
    for bad in (0, 2.5):
        with pytest.raises(GenerationError, match="queue_capacity"):
            Engine(cfg, params, backend="xla", queue_capacity=bad)


def test_sampling_is_seeded(engine, prompts):
    hot = SamplingParams(threshold=0.5, temperature=1.0)
    first = engine.generate(prompts, hot, decode_config=FLASH, seed=5)
    again = engine.generate(prompts, hot, decode_config=FLASH, seed=5)
    other = engine.generate(prompts, hot, decode_config=FLASH, seed=6)
    assert [r.token_ids for r in first.results] == [r.token_ids for r in again.results]
    assert [r.token_ids for r in first.results] != [r.token_ids for r in other.results]


def test_one_compilation_per_bucket(lively):
    cfg, params = lively
    engine = Engine(cfg, params, backend="xla")
    decode = FLASH
    engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], decode_config=decode)
    engine.generate([[9] * 11, [3] * 16, [4] * 2], decode_config=decode)  # same prompt bucket (16), more requests
    engine.generate([[5] * 7], SamplingParams(threshold=0.9, temperature=0.5), decode_config=decode)  # traced knobs
    assert engine.num_compilations == 1
    engine.generate([[5] * 17], decode_config=decode)  # next prompt bucket
    assert engine.num_compilations == 2


def test_bad_inputs_are_named(engine):
    decode = FLASH
    with pytest.raises(GenerationError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], decode)
    limit = engine.config.max_sequence_length
    with pytest.raises(GenerationError, match="max_sequence_length"):
        engine.generate([[1] * limit], decode)
    with pytest.raises(GenerationError, match=f"{limit - 20} prompt tokens \\+ max_new_tokens=32"):
        engine.generate([[1] * (limit - 20)], SamplingParams(max_new_tokens=32), decode_config=decode)
    with pytest.raises(GenerationError, match="no tokenizer"):
        engine.generate(["hello"], decode)
    with pytest.raises(GenerationError, match="outside"):
        engine.generate([[1, 999]], decode)
    with pytest.raises(GenerationError, match="no prompts"):
        engine.generate([], decode)


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="nope"), "method"),
        (dict(method="llada", gen_length=30, block_length=16), "multiple of block_length"),
        (dict(method="llada", gen_length=32, block_length=16, steps=3), "steps"),
        (dict(method="llada", threshold=0.9), "threshold"),
        (dict(method="fast_dllm", cache="triple"), "cache"),
        (dict(method="fast_dllm", verify=True), "verify"),
        (dict(batch_size=0), "batch_size"),
        (dict(gen_length=-1), "gen_length"),
        (dict(temperature=-1.0), "temperature"),
        (dict(mask_num=0), "mask_num"),
    ],
)
def test_decode_config_rejects_bad_options(kwargs, match):
    # threshold= and temperature= are the deprecated request defaults: warned, and still checked
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DecodeConfig\\(.*\\): request defaults", DeprecationWarning)
        with pytest.raises(DecodeConfigError, match=match):
            DecodeConfig(**kwargs)


def test_more_requests_than_the_queue_ring_holds(engine):
    """40 requests through a 16-entry ring: every request comes back once, in order, and
    decodes the same in one slot as in two."""
    rng = np.random.RandomState(2)
    many = [list(rng.randint(0, 100, n)) for n in rng.randint(2, 12, size=40)]
    sampling = SamplingParams(threshold=0.3, max_new_tokens=16)
    out = engine.generate(many, sampling, decode_config=FLASH)
    narrower = engine.generate(many, sampling, decode_config=one_slot(FLASH))
    assert engine.compile(FLASH, 12).queue_capacity == engine.compile(one_slot(FLASH), 12).queue_capacity == 16
    assert [r.index for r in out.results] == list(range(40))
    assert [r.prompt_ids for r in out.results] == many
    assert [r.token_ids for r in out.results] == [r.token_ids for r in narrower.results]
    assert all(r.seconds >= 0 for r in out.results)


# ----- per-request parameters ------------------------------------------------------------------


def test_mixed_request_parameters_share_one_compiled_loop(lively, prompts):
    cfg, params = lively
    engine = Engine(cfg, params, backend="xla")
    decode = FLASH
    mixed = [
        SamplingParams(max_new_tokens=8),
        SamplingParams(threshold=0.3, temperature=0.8, seed=4),
        SamplingParams(max_new_tokens=20, top_k=5, temperature=1.0),
        SamplingParams(remasking="random", top_p=0.9, seed=2),
        SamplingParams(threshold=2.0, stop_token_ids=[3]),
    ]
    out = engine.generate(prompts, mixed, decode_config=decode)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=3), decode_config=decode)
    assert engine.num_compilations == 1
    assert len(out.results[0].token_ids) <= 8 and len(out.results[2].token_ids) <= 20
    assert out.results[4].steps == out.results[4].reference_num_tokens  # threshold 2: one per step


@pytest.mark.parametrize(
    "short, bucket",
    [
        (dataclasses.replace(FLASH, gen_length=16), FLASH),
        # three steps a block of 8 in both (uneven: 3, 3, 2 tokens), as in the block methods' test
        (
            DecodeConfig(method="llada", gen_length=16, block_length=8, steps=6, batch_size=2),
            DecodeConfig(method="llada", gen_length=32, block_length=8, steps=12, batch_size=2),
        ),
    ],
    ids=["flash_cache", "llada"],
)
def test_gen_length_decodes_as_a_config_of_that_length(engine, prompts, short, bucket):
    """A request of a canvas of m positions in a bucket of G decodes what gen_length=m would."""
    sampling = SamplingParams() if short.fixed_schedule else SamplingParams(threshold=0.3)
    alone = engine.generate(prompts, sampling, decode_config=short)
    inside = engine.generate(prompts, dataclasses.replace(sampling, gen_length=16), decode_config=bucket)
    for a, b in zip(alone.results, inside.results):
        assert (a.token_ids, a.steps, a.finish_reason) == (b.token_ids, b.steps, b.finish_reason)


def test_per_request_threshold_equals_the_deprecated_config_default(engine, prompts):
    with pytest.warns(DeprecationWarning, match="set them per request in SamplingParams"):
        old_style = dataclasses.replace(FLASH, threshold=0.3)
    by_config = engine.generate(prompts, decode_config=old_style)
    by_request = engine.generate(prompts, SamplingParams(threshold=0.3), decode_config=FLASH)
    assert [r.token_ids for r in by_config.results] == [r.token_ids for r in by_request.results]
    assert [r.steps for r in by_config.results] == [r.steps for r in by_request.results]


def test_seeded_request_is_the_same_wherever_it_runs(engine, prompts):
    hot = SamplingParams(threshold=0.5, temperature=1.0, seed=9)
    cold = SamplingParams(threshold=0.5)
    together = engine.generate(prompts, [cold] * 2 + [hot] + [cold] * 2, decode_config=FLASH)
    alone = engine.generate([prompts[2]], hot, decode_config=FLASH)
    assert together.results[2].token_ids == alone.results[0].token_ids


def test_stop_token_ids_and_finish_reasons(engine, prompts):
    decode = FLASH
    eos = engine.config.eos_token_id
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=16, threshold=0.3), decode_config=decode)
    for r in plain.results:
        assert r.prompt_tokens == len(r.prompt_ids) and r.completion_tokens == len(r.token_ids)
        assert r.finish_reason == ("stop" if len(r.token_ids) < 16 else "length") and r.error is None
        assert eos not in r.token_ids
    long = max(plain.results, key=lambda r: len(r.token_ids))
    assert len(long.token_ids) >= 3
    stop_id = long.token_ids[2]
    cut = engine.generate(
        [long.prompt_ids],
        SamplingParams(max_new_tokens=16, threshold=0.3, stop_token_ids=[stop_id]),
        decode_config=decode,
    )
    r = cut.results[0]
    first = long.token_ids.index(stop_id)
    assert r.token_ids == long.token_ids[:first] and r.finish_reason == "stop"
    assert r.completion_tokens == first and r.reference_num_tokens == long.reference_num_tokens


def test_library_inputs_are_strict(engine):
    decode = FLASH
    cases = [
        ("2+3", "prompts: expected a list of prompts, got a str"),
        (b"2+3", "prompts: expected a list of prompts, got a bytes"),
        (np.array([1, 2, 3]), r"2-D array of token ids \[N, P\], got an array of shape \(3,\)"),
        (np.ones((1, 2, 3), np.int32), "shape"),
        ([b"abc"], "prompt 0: bytes are not a prompt"),
        ([[1, True]], "prompt 0 token 1: True"),
        ([[1, 2.0]], r"prompt 0 token 1: 2.0 \(float\)"),
        ([[1, float("nan")]], "prompt 0 token 1: nan"),
        ([["1", 2]], "prompt 0 token 0: '1'"),
        ([np.array([1.0, 2.0])], "expected integer token ids, got an array of float64"),
        ([np.ones((2, 2), np.int32)], "prompt 0: expected a 1-D array"),
        ([None], "prompt 0: expected a string or a list of token ids, got NoneType"),
        (5, "prompts: expected a list of prompts, got int"),
    ]
    for prompts, match in cases:
        with pytest.raises(GenerationError, match=match):
            engine.generate(prompts, decode_config=decode)
    bad_params = [
        ("fast", "sampling='fast'"),
        ([SamplingParams()], "1 SamplingParams for 2 prompts"),
        ([SamplingParams(), None], r"sampling\[1\]=None"),
        (dict(temperature=1.0), "expected a SamplingParams"),
    ]
    for params, match in bad_params:
        with pytest.raises(GenerationError, match=match):
            engine.generate([[1, 2], [3, 4]], params, decode_config=decode)
    with pytest.raises(GenerationError, match="decode_config=5"):
        engine.generate([[1, 2]], decode_config=5)
    with pytest.raises(GenerationError, match="chat=None"):
        engine.generate([[1, 2]], decode_config=decode, chat=None)
    with pytest.raises(GenerationError, match="max_new_tokens=64 is more than this engine's generation bucket"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=64), decode_config=decode)
    with pytest.raises(GenerationError, match="gamma=0.5 applies only with verify=True"):
        engine.generate([[1, 2]], SamplingParams(gamma=0.5), decode_config=decode)
    with pytest.raises(GenerationError, match="threshold=0.5 does not apply"):
        engine.generate(
            [[1, 2]], SamplingParams(threshold=0.5), decode_config=DecodeConfig(method="llada", gen_length=32)
        )
    with pytest.raises(GenerationError, match="stop_token_ids"):
        engine.generate([[1, 2]], SamplingParams(stop_token_ids=[10_000]), decode_config=decode)
    with pytest.raises(GenerationError, match="stop strings need a tokenizer"):
        engine.generate([[1, 2]], SamplingParams(stop=["x"]), decode_config=decode)


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk_iterations=0), "chunk_iterations=0"),
        (dict(chunk_iterations=2.5), r"chunk_iterations=2.5 \(float\)"),
        (dict(queue_capacity=True), r"queue_capacity=True \(bool\)"),
        (dict(full_pass_lanes=(0,)), "full_pass_lanes entry=0"),
        (dict(interpret="yes"), "interpret='yes'"),
    ],
)
def test_engine_options_are_strict(lively, kwargs, match):
    cfg, params = lively
    with pytest.raises(GenerationError, match=match):
        Engine(cfg, params, backend="xla", **kwargs)


def test_slots_never_exceed_the_requests(lively):
    cfg, params = lively
    engine = Engine(cfg, params, backend="xla")
    decode = dataclasses.replace(FLASH, batch_size=10_000)
    out = engine.generate([[1, 2, 3]], decode_config=decode)
    (key,) = engine._executables
    assert key[0].num_slots == 1 and out.stats.cache_bytes < 10**7
    engine.generate([[1, 2, 3]] * 3, decode_config=decode)
    assert sorted(k[0].num_slots for k in engine._executables) == [1, 4]
    engine.generate([[1, 2, 3]] * 2, decode_config=decode)  # reuses the 4-slot loop
    assert engine.num_compilations == 2


def test_chat_stop_strings_and_counts_on_the_embedded_model(embedded_engine):
    engine = embedded_engine
    decode = DecodeConfig(gen_length=64, batch_size=2)
    question = "sort: 3 9 1 4"
    # generate never templates unless asked; chat() and chat=True render the same template
    assert engine.encode([question]) == [engine.tokenizer.encode(question)]
    templated = engine.encode([question], chat=True)
    assert templated == engine.encode_chat([[{"role": "user", "content": question}]]) != engine.encode([question])
    with_system = engine.encode_chat([[{"role": "system", "content": "short"}, {"role": "user", "content": question}]])
    assert len(with_system[0]) > len(templated[0])

    out = engine.chat([[{"role": "user", "content": question}]], decode_config=decode)
    full = out.results[0]
    assert full.text.startswith("1 3 4 9") and full.finish_reason == "stop"
    assert full.completion_tokens == len(full.token_ids) < full.reference_num_tokens
    assert engine.tokenizer.decode(full.token_ids) == full.text

    cut = engine.chat([[{"role": "user", "content": question}]], SamplingParams(stop=[" 4", "9"]), decode_config=decode)
    r = cut.results[0]
    assert r.text == "1 3" and r.finish_reason == "stop"
    assert engine.tokenizer.decode(r.token_ids) == "1 3" and r.completion_tokens == len(r.token_ids)
    assert r.prompt_tokens == len(templated[0])

    short = engine.chat(
        [[{"role": "user", "content": question}]], SamplingParams(max_new_tokens=3), decode_config=decode
    )
    assert short.results[0].finish_reason == "length" and short.results[0].completion_tokens == 3

    with pytest.raises(GenerationError, match="conversation 0 message 0"):
        engine.chat([[{"role": "robot", "content": "hi"}]], decode_config=decode)
    with pytest.raises(GenerationError, match="conversation 0: expected a non-empty list of messages, got str"):
        engine.chat(["hi"], decode_config=decode)
    with pytest.raises(GenerationError, match="conversations: expected a non-empty list"):
        engine.chat("hi", decode_config=decode)


def test_full_passes_with_the_mlp_in_chunks_decode_the_same(lively, engine, prompts, monkeypatch):
    """Large passes run the attention output and MLP in chunks of whole groups (the xla
    backend's memory peak at 32 slots): with a chunk bound this small every full pass of
    these 4 slots is chunked, one group at a time, and decodes the same tokens."""
    import dllm_jax.runtime.cached_forward as cached_forward

    cfg, params = lively
    decode = dataclasses.replace(FLASH, batch_size=4)
    sampling = SamplingParams(threshold=0.5)
    want = engine.generate(prompts, sampling, decode_config=decode)
    chunked = []
    real_groups = cached_forward.mlp_chunk_groups
    monkeypatch.setattr(cached_forward, "MLP_CHUNK_ROWS", 8)
    monkeypatch.setattr(
        cached_forward, "mlp_chunk_groups", lambda s, r: chunked.append((s, real_groups(s, r))) or chunked[-1][1]
    )
    got = Engine(cfg, params, backend="xla").generate(prompts, sampling, decode_config=decode)
    assert (4, 1) in chunked, chunked  # the full passes: 4 chunks of one group
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    assert [r.steps for r in got.results] == [r.steps for r in want.results]
