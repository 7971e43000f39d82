"""The decode engine against a plain-Python reference, on a tiny random model (float32)."""

import dataclasses

import numpy as np
import pytest

from dllm_jax.decode_config import DecodeConfig, DecodeConfigError
from dllm_jax.engine import Engine, GenerationError
from tests.reference_decoder import ReferenceDecoder

PROMPT_LENGTHS = (12, 7, 15, 9, 3)


@pytest.fixture(scope="module")
def engine(lively):
    cfg, params = lively
    return Engine(cfg, params, backend="xla")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    return [list(rng.randint(0, 100, n)) for n in PROMPT_LENGTHS]


def _reference(engine, decode, prompts):
    loop = engine.decode_loop(decode, max(map(len, prompts)))
    return ReferenceDecoder(engine.config, engine.params, decode, loop.max_len)


def _answer(tokens, eos):
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


FLASH_SETTINGS = [
    dict(mask_num=2, track_num=1, threshold=0.3),
    dict(mask_num=4, track_num=0, threshold=0.3),
    dict(mask_num=1, track_num=2, threshold=0.2),
    dict(mask_num=2, track_num=1, threshold=2.0),
]


@pytest.mark.parametrize("setting", FLASH_SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_flash_cache_matches_the_python_reference(engine, prompts, setting):
    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, **setting)
    out = engine.generate(prompts, decode)
    ref = _reference(engine, decode, prompts)
    eos = engine.config.eos_token_id
    for prompt, result in zip(prompts, out.results):
        tokens, steps, committed = ref.flash_cache(prompt)
        assert result.token_ids == _answer(tokens, eos)
        assert (result.steps, result.num_tokens) == (steps, committed)
    if setting["threshold"] > 1:  # the at-least-one rule alone: one token per step
        assert all(r.steps == r.num_tokens for r in out.results)
    else:
        assert out.stats.tokens_per_step > 1.1, "the setting should exercise parallel commits"


def test_answers_end_at_the_first_committed_eos(engine, prompts):
    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, threshold=0.5, mask_num=2, track_num=1)
    out = engine.generate(prompts, decode)
    ended = [r for r in out.results if r.num_tokens < 32]
    assert ended, "the lively model commits EOS for some prompts"
    for r in ended:
        # everything before the EOS bound is decoded, nothing after it is generated
        assert r.num_tokens >= len(r.token_ids) + 1
        assert engine.config.mask_token_id not in r.token_ids


@pytest.mark.parametrize("method", ["flash_full_refresh", "flash_sparse_everything"])
def test_exact_refresh_reproduces_the_no_cache_model(engine, prompts, method):
    if method == "flash_full_refresh":
        decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, threshold=0.5, track_num=-1)
    else:  # the sparse path with budgets large enough to recompute every row every step
        decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, threshold=0.5, mask_num=20, track_num=20)
    out = engine.generate(prompts, decode)
    ref = _reference(engine, decode, prompts)
    for prompt, result in zip(prompts, out.results):
        tokens, steps, _ = ref.flash_cache(prompt, no_cache=True)
        assert result.token_ids == _answer(tokens, engine.config.eos_token_id)
        assert result.steps == steps


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(method="llada", gen_length=32, block_length=16, steps=16, batch_size=2),
        DecodeConfig(method="llada", gen_length=32, block_length=8, steps=12, batch_size=3),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, cache="prefix", threshold=0.5, batch_size=2),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, cache="dual", threshold=0.5, batch_size=2),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=8, cache="dual", steps=8, threshold=None, batch_size=2),
    ],
    ids=["llada-2perstep", "llada-uneven", "fast-prefix", "fast-dual", "fast-dual-schedule"],
)
def test_block_methods_match_the_python_reference(engine, prompts, decode):
    out = engine.generate(prompts, decode)
    ref = _reference(engine, decode, prompts)
    cache = "none" if decode.method == "llada" else decode.cache
    for prompt, result in zip(prompts, out.results):
        tokens, steps = ref.block_decode(prompt, cache)
        assert result.token_ids == _answer(tokens, engine.config.eos_token_id)
        assert result.steps == steps
    if decode.method == "llada":
        assert all(r.steps == decode.total_steps for r in out.results)


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(method="flash_cache", gen_length=32, batch_size=3, threshold=0.5, mask_num=2, track_num=1),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, threshold=0.5, batch_size=3),
        DecodeConfig(method="llada", gen_length=32, block_length=16, steps=16, batch_size=3, temperature=0.7, seed=3),
    ],
    ids=["flash", "fast_dllm", "llada-sampled"],
)
def test_continuous_batching_and_batch_invariance(engine, decode):
    """More requests than slots, mixed lengths: results in order, independent of the batching.

    A request's random stream depends on (seed, its index in the call, step), never on its slot.
    """
    rng = np.random.RandomState(1)
    many = [list(rng.randint(0, 100, n)) for n in (5, 14, 8, 11, 3, 16, 9)]
    together = engine.generate(many, decode)
    assert [r.index for r in together.results] == list(range(len(many)))
    assert together.stats.num_requests == len(many)
    assert together.stats.iterations < sum(r.steps for r in together.results), "slots ran concurrently"
    fewer_slots = engine.generate(many, dataclasses.replace(decode, batch_size=2))
    assert [r.token_ids for r in fewer_slots.results] == [r.token_ids for r in together.results]
    if decode.temperature == 0:
        for i, prompt in enumerate(many):
            alone = engine.generate([prompt], decode).results[0]
            assert together.results[i].token_ids == alone.token_ids
            assert together.results[i].steps == alone.steps


def test_a_request_ring_smaller_than_the_stream_never_stalls(lively):
    """Request g waits for request g - Q's result; while that one still decodes, the other
    slots keep stepping (a free slot must not stop the loop for a push the host cannot make)."""
    cfg, params = lively
    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, threshold=0.5, mask_num=2, track_num=1)
    rng = np.random.RandomState(4)
    many = [list(rng.randint(0, 100, n)) for n in (5, 14, 8, 11, 3, 16, 9, 7, 12, 4)]
    wide = Engine(cfg, params, backend="xla").generate(many, decode)
    steps = [r.steps for r in wide.results]
    assert any(steps[g] > steps[g + 1] for g in range(len(many) - 1)), "some request must outlast the next one"
    for capacity in (1, 2, 3):
        tight = Engine(cfg, params, backend="xla", queue_capacity=capacity, chunk_iterations=4).generate(many, decode)
        assert [r.token_ids for r in tight.results] == [r.token_ids for r in wide.results], capacity
        assert [r.steps for r in tight.results] == steps
    for bad in (0, 2.5):
        with pytest.raises(GenerationError, match="queue_capacity"):
            Engine(cfg, params, backend="xla", queue_capacity=bad)


def test_sampling_is_seeded(engine, prompts):
    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, threshold=0.5, temperature=1.0, seed=5)
    first = engine.generate(prompts, decode)
    again = engine.generate(prompts, decode)
    other = engine.generate(prompts, dataclasses.replace(decode, seed=6))
    assert [r.token_ids for r in first.results] == [r.token_ids for r in again.results]
    assert [r.token_ids for r in first.results] != [r.token_ids for r in other.results]


def test_one_compilation_per_bucket(lively):
    cfg, params = lively
    engine = Engine(cfg, params, backend="xla")
    decode = DecodeConfig(method="flash_cache", gen_length=16, batch_size=2, threshold=0.5)
    engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], decode)
    engine.generate([[9] * 11, [3] * 16, [4] * 2], decode)  # same prompt bucket (16), more requests
    engine.generate([[5] * 7], dataclasses.replace(decode, threshold=0.9, temperature=0.5))  # traced knobs
    assert engine.num_compilations == 1
    engine.generate([[5] * 17], decode)  # next prompt bucket
    assert engine.num_compilations == 2


def test_bad_inputs_are_named(engine):
    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2)
    with pytest.raises(GenerationError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], decode)
    with pytest.raises(GenerationError, match="max_sequence_length"):
        engine.generate([[1] * 500], decode)
    with pytest.raises(GenerationError, match="no tokenizer"):
        engine.generate(["hello"], decode)
    with pytest.raises(GenerationError, match="outside"):
        engine.generate([[1, 999]], decode)
    with pytest.raises(GenerationError, match="no prompts"):
        engine.generate([], decode)


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
    with pytest.raises(DecodeConfigError, match=match):
        DecodeConfig(**kwargs)


def test_more_requests_than_the_queue_ring_holds(engine):
    """40 requests through a 16-entry ring: every request comes back once, in order."""
    rng = np.random.RandomState(2)
    many = [list(rng.randint(0, 100, n)) for n in rng.randint(2, 12, size=40)]
    decode = DecodeConfig(method="flash_cache", gen_length=16, batch_size=2, threshold=0.3)
    out = engine.generate(many, decode)
    wider = engine.generate(many, dataclasses.replace(decode, batch_size=4))
    assert [r.index for r in out.results] == list(range(40))
    assert [r.prompt_ids for r in out.results] == many
    assert [r.token_ids for r in out.results] == [r.token_ids for r in wider.results]
    assert all(r.seconds >= 0 for r in out.results)
