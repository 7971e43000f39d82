"""Checks of the decode engine against the plain-Python ReferenceDecoder, for any family, and
the decode loops the engine tests share.

Each ``assert_*`` runs ``engine.generate`` once (or, for batching, once per batching) and
compares every request's tokens and step counts with the reference's; the test files choose
the model (tests/test_engine.py: LLaDA, tests/test_dream_engine.py: Dream) and the settings.

A decode loop takes 15-20 s to compile on a CPU core and well under one to run, so the tests
of a model share one Engine (a session fixture of tests/conftest.py) and the few loops below:
equal DecodeConfigs share one compiled loop, and what a request may choose (threshold,
temperature, seed, gamma, max_new_tokens) is a run-time SamplingParams value, never a new
loop. A test that needs another compiled shape says why.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import numpy as np

from dllm_jax.engine.engine import Engine
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.params import SamplingParams
from tests.reference_decoder import ReferenceDecoder

PROMPT_LENGTHS = (12, 7, 15, 9, 3)

# Flash-Cache with one block of look-ahead masks and one of tracked tokens: every kind of
# sparse row, and parallel commits at thresholds below 1.
FLASH = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, mask_num=2, track_num=1)
FLASH_VERIFY = dataclasses.replace(FLASH, verify=True)
LLADA = DecodeConfig(method="llada", gen_length=32, block_length=16, steps=16, batch_size=2)
FAST_DUAL = DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, cache="dual", batch_size=2)
FAST_PREFIX = dataclasses.replace(FAST_DUAL, cache="prefix")
# Flash-Cache settings that must decode exactly what the no-cache model decodes.
EXACT_REFRESH = {
    "flash_full_refresh": DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, track_num=-1),
    # the sparse path with budgets large enough to recompute every row every step
    "flash_sparse_everything": DecodeConfig(
        method="flash_cache", gen_length=32, batch_size=2, mask_num=20, track_num=20
    ),
}


def one_slot(decode: DecodeConfig) -> DecodeConfig:
    """The same loop with one slot (what 'fewer slots' and 'alone' checks compile)."""
    return dataclasses.replace(decode, batch_size=1)


def with_weights(engine: Engine, weights) -> Engine:
    """An engine over other weights of the same tree, shapes and dtypes (a poisoned model, say)
    that shares `engine`'s compiled loops: what swap_weights does, on a copy."""
    other = copy.copy(engine)  # the same dict of compiled loops
    other.swap_weights(weights)
    return other


def random_prompts(lengths: Sequence[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, of token ids in [0, 100)."""
    rng = np.random.RandomState(seed)
    return [list(rng.randint(0, 100, n)) for n in lengths]


def reference_for(engine: Engine, decode: DecodeConfig, prompts, sampling: SamplingParams | None = None):
    """The reference decoder over the engine's model, with the engine loop's sequence length and
    the request's threshold and gamma (None: the defaults)."""
    sampling = SamplingParams() if sampling is None else sampling
    loop = engine.decode_loop(decode, max(map(len, prompts)))
    return ReferenceDecoder(
        engine.config, engine.weights, decode, loop.max_len, threshold=sampling.threshold, gamma=sampling.gamma
    )


def answer(tokens, eos: int) -> list[int]:
    """The reference's tokens as the engine reports them: up to the first EOS."""
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def assert_flash_cache_matches_reference(
    engine: Engine, prompts, decode: DecodeConfig, sampling: SamplingParams | None = None
) -> None:
    """Tokens, steps, committed count (and, with verify, accepted drafts) equal the reference's;
    the setting commits several tokens a step (a threshold above 1: exactly one)."""
    sampling = SamplingParams() if sampling is None else sampling
    out = engine.generate(prompts, sampling, decode_config=decode)
    ref = reference_for(engine, decode, prompts, sampling)
    eos = engine.config.eos_token_id
    for prompt, result in zip(prompts, out.results):
        tokens, steps, committed = ref.flash_cache(prompt)
        assert result.token_ids == answer(tokens, eos)
        assert (result.steps, result.reference_num_tokens) == (steps, committed)
        if decode.verify:
            assert result.accepted_drafts == ref.accepted
    if ref.threshold > 1:  # the at-least-one rule alone: one token per step
        assert all(r.steps == r.reference_num_tokens for r in out.results)
    else:
        assert out.stats.tokens_per_step > 1.1, "the setting should exercise parallel commits"
    if decode.verify:
        assert sum(r.accepted_drafts for r in out.results) > 0


def assert_decodes_like_the_no_cache_model(
    engine: Engine, prompts, decode: DecodeConfig, sampling: SamplingParams | None = None
) -> None:
    """Tokens and steps equal the reference's with a full forward pass every step."""
    out = engine.generate(prompts, sampling, decode_config=decode)
    ref = reference_for(engine, decode, prompts, sampling)
    for prompt, result in zip(prompts, out.results):
        tokens, steps, _ = ref.flash_cache(prompt, no_cache=True)
        assert result.token_ids == answer(tokens, engine.config.eos_token_id)
        assert result.steps == steps


def assert_block_method_matches_reference(
    engine: Engine, prompts, decode: DecodeConfig, sampling: SamplingParams | None = None
) -> None:
    """LLaDA's sampler (no cache) or Fast-dLLM (decode.cache): tokens and steps equal the
    reference's; LLaDA's sampler takes exactly its total steps."""
    out = engine.generate(prompts, sampling, decode_config=decode)
    ref = reference_for(engine, decode, prompts, sampling)
    cache = "none" if decode.method == "llada" else decode.cache
    for prompt, result in zip(prompts, out.results):
        tokens, steps = ref.block_decode(prompt, cache)
        assert result.token_ids == answer(tokens, engine.config.eos_token_id)
        assert result.steps == steps
    if decode.method == "llada":
        assert all(r.steps == decode.total_steps for r in out.results)


def assert_batching_invariance(
    engine: Engine,
    decode: DecodeConfig,
    sampling: SamplingParams | None = None,
    alone: Sequence[int] | None = None,
) -> None:
    """Seven requests of mixed lengths, more than the slots: results in order, slots run
    concurrently, and the same tokens with one slot; greedily, the requests ``alone``
    (indices; None: all) decoded on their own give the same tokens and steps."""
    sampling = SamplingParams() if sampling is None else sampling
    many = random_prompts((5, 14, 8, 11, 3, 16, 9), seed=1)
    together = engine.generate(many, sampling, decode_config=decode)
    assert [r.index for r in together.results] == list(range(len(many)))
    assert together.stats.num_requests == len(many)
    assert together.stats.iterations < sum(r.steps for r in together.results), "slots ran concurrently"
    fewer_slots = engine.generate(many, sampling, decode_config=one_slot(decode))
    assert [r.token_ids for r in fewer_slots.results] == [r.token_ids for r in together.results]
    if not sampling.temperature:  # greedy (None: 0, these engines' models have no generation_config)
        for i in range(len(many)) if alone is None else alone:
            result = engine.generate([many[i]], sampling, decode_config=decode).results[0]
            assert together.results[i].token_ids == result.token_ids
            assert together.results[i].steps == result.steps
