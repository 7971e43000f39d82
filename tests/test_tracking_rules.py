"""Flash-Cache's tracking rules (SamplingParams.track_rule), the drift they may rank by, and the
staleness probe.

Selection is checked on hand-built slots; decoding with every rule, mixed in one call of one
compiled loop, against the plain-Python reference (tests/reference_decoder.py), which keeps
its own ranking for each rule."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.cli.arguments import add_knob_flags, knob_values
from dllm_jax.common.errors import SamplingParamsError
from dllm_jax.engine.engine import GenerationError
from dllm_jax.policies.flash_cache import FlashCachePolicy
from dllm_jax.policies.tracking_rules import PINNED_KEY, rule_index
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.flat_cache import flat_rows
from dllm_jax.runtime.row_drift import drift_layer
from dllm_jax.runtime.slots import empty_slots
from dllm_jax.runtime.tracking_probe import _attention_and_error, probe_staleness
from dllm_jax.sampling.params import TRACK_RULES, SamplingParams
from dllm_jax.serve.params import make_params
from dllm_jax.serve.protocol import CompletionRequest
from tests.engine_checks import FLASH, answer, random_prompts, reference_for

pytestmark = pytest.mark.engine  # the selection and probe checks alone are unit-sized

L = 16
POLICY = FlashCachePolicy(window=4, lookahead=4, tracked=4, max_len=L, n_heads=2, eos_id=15, mask_id=14)
# one compiled loop for every rule, the session's shared Flash-Cache loop (tests/engine_checks.py:
# one block of look-ahead masks and one of tracked rows, a budget of 16 rows, so the rules
# differ) at a run-time threshold of 0.3 (parallel commits, so sparse steps follow full ones)
DECODE = FLASH
THRESHOLD = 0.3


def hand_built_slot(rule: str, **values):
    """One slot (no batch axis) of L positions: positions 0-3 the prompt, 4-9 committed at
    steps 1, 1, 2, 3, 4, 4 (8 and 9 this step's fresh commits, pinned), 10-15 masks."""
    slot = jax.tree_util.tree_map(lambda a: a[0], empty_slots(1, L))
    pos = np.arange(L)
    commit_step = np.array([-1] * 4 + [1, 1, 2, 3, 4, 4] + [-1] * 6)
    sampling = slot.sampling.replace(track_rule=jnp.int32(rule_index(rule)), seed=jnp.int32(values.pop("seed", 0)))
    return slot.replace(
        decoded=jnp.asarray(pos < 10),
        pinned=jnp.asarray((pos == 8) | (pos == 9)),
        commit_step=jnp.asarray(commit_step, jnp.int32),
        scores=jnp.asarray(values.pop("scores", np.zeros(L)), jnp.float32),
        drift=jnp.asarray(values.pop("drift", np.zeros(L)), jnp.float32),
        steps=jnp.int32(values.pop("steps", 5)),
        key_len=jnp.int32(L - 1),
        sampling=sampling,
    )


def selected(slot, count: int = 5) -> list[int]:
    positions, valid = POLICY.tracked_rows(slot, count)
    return [int(p) for p, v in zip(positions, valid) if v]


# scores and drift with their maxima on masks (10, 12: never tracked) and the pinned 8
SCORES = np.array([0.5, 9.0, 0.1, 3.0, 7.0, 0.2, 0.3, 0.4, 99.0, 0.0, 50.0, 0, 0, 0, 0, 0])
DRIFT = np.array([0.0, 0.0, 6.0, 0.0, 1.0, 8.0, 0.5, 2.0, 99.0, 0.0, 0.0, 0, 70.0, 0, 0, 0])


def test_attention_ranks_fresh_commits_then_the_highest_scores():
    assert selected(hand_built_slot("attention", scores=SCORES)) == [8, 9, 1, 4, 3]


def test_attention_is_the_published_key():
    """The key of the rule before rules existed: fresh commits at 3e38, then the score."""
    slot = hand_built_slot("attention", scores=SCORES)
    old_key = jnp.where(slot.decoded, jnp.where(slot.pinned, PINNED_KEY, slot.scores), -jnp.inf)
    for count in (1, 4, 9, 12):
        values, positions = jax.lax.top_k(old_key, count)
        new_positions, new_valid = POLICY.tracked_rows(slot, count)
        np.testing.assert_array_equal(new_positions, positions)
        np.testing.assert_array_equal(new_valid, values > -jnp.inf)


def test_recent_ranks_fresh_commits_then_the_latest_commits_then_the_prompt():
    assert selected(hand_built_slot("recent", scores=SCORES), 8) == [8, 9, 7, 6, 4, 5, 0, 1]


def test_drift_ranks_fresh_commits_then_the_largest_last_change():
    assert selected(hand_built_slot("drift", scores=SCORES, drift=DRIFT)) == [8, 9, 5, 2, 7]


def test_none_tracks_nothing_not_even_fresh_commits():
    assert selected(hand_built_slot("none", scores=SCORES, drift=DRIFT), 10) == []


def test_random_draws_from_the_request_stream_after_fresh_commits():
    draws = []
    for step in range(40):
        chosen = selected(hand_built_slot("random", scores=SCORES, steps=step, seed=3), 4)
        assert chosen[:2] == [8, 9] and set(chosen[2:]) <= set(range(8))
        assert chosen == selected(hand_built_slot("random", scores=SCORES, steps=step, seed=3), 4)
        draws.append(tuple(chosen[2:]))
    assert len(set(draws)) > 20, "different steps draw different rows"
    assert set(np.ravel(draws)) == set(range(8)), "every decoded, unpinned row gets drawn"
    other_seed = [tuple(selected(hand_built_slot("random", steps=s, seed=4), 4)[2:]) for s in range(40)]
    assert other_seed != draws


@pytest.fixture(scope="module")
def engine(lively_engine):
    return lively_engine


@pytest.fixture(scope="module")
def prompts():
    return random_prompts()


@pytest.fixture(scope="module")
def mixed(engine, prompts):
    """Every prompt under every rule, all in one generate call: (requests, their results)."""
    requests = [(prompt, rule) for rule in TRACK_RULES for prompt in prompts]
    sampling = [SamplingParams(track_rule=rule, seed=7, threshold=THRESHOLD) for _, rule in requests]
    compilations = engine.num_compilations
    out = engine.generate([p for p, _ in requests], sampling, decode_config=DECODE)
    # the shared engine may have compiled the loop already (0) or compiles it now (1)
    return requests, out.results, engine.num_compilations - compilations


def test_every_rule_decodes_as_the_reference_in_one_compiled_loop(engine, prompts, mixed):
    requests, results, new_compilations = mixed
    assert new_compilations <= 1, "every rule runs in one compiled loop"
    ref = reference_for(engine, DECODE, prompts, SamplingParams(threshold=THRESHOLD))
    eos = engine.config.eos_token_id
    answers = {}
    for (prompt, rule), result in zip(requests, results):
        tokens, steps, committed = ref.flash_cache(prompt, rule=rule, seed=7)
        assert result.token_ids == answer(tokens, eos), rule
        assert (result.steps, result.reference_num_tokens) == (steps, committed), rule
        answers.setdefault(rule, []).append(result.token_ids)
    assert len({tuple(map(tuple, a)) for a in answers.values()}) >= 3, "the rules must choose differently here"


def test_none_decodes_as_a_budget_of_zero(engine, prompts, mixed):
    requests, results, _ = mixed
    ref = reference_for(engine, dataclasses.replace(DECODE, track_num=0), prompts, SamplingParams(threshold=THRESHOLD))
    none = [r for (_, rule), r in zip(requests, results) if rule == "none"]
    for prompt, result in zip(prompts, none):
        tokens, steps, _ = ref.flash_cache(prompt)
        assert (result.token_ids, result.steps) == (answer(tokens, engine.config.eos_token_id), steps)


def test_the_loop_records_each_refreshed_rows_last_layer_change(engine, prompts):
    """Slots.drift after an iteration: at the rows of the step's sparse pass, max |(K, V) after -
    (K, V) before| at the last layer; elsewhere unchanged."""
    compiled = engine.compile(DECODE, max(map(len, prompts)))
    loop = compiled.loop
    state = compiled.initial_state(prompts, SamplingParams(track_rule="drift", threshold=THRESHOLD))
    layer = drift_layer(engine.config)
    checked = 0
    for _ in range(5):
        slots = jax.device_get(state.slots)
        sparse = slots.active & ~slots.needs_full
        positions, valid = jax.device_get(jax.vmap(loop.policy.sparse_rows)(state.slots))
        valid = valid & sparse[:, None]
        rows = np.asarray(flat_rows(jnp.arange(len(sparse)), positions, valid, loop.max_len))
        before = [np.asarray(c[layer], np.float64)[rows] for c in (state.cache.k, state.cache.v)]
        state = compiled.run(engine.weights, state, 1)
        after = [np.asarray(c[layer], np.float64)[rows] for c in (state.cache.k, state.cache.v)]
        expected = np.array(slots.drift)
        change = np.maximum(*(np.max(np.abs(a - b), axis=-1) for a, b in zip(after, before)))
        for b in np.flatnonzero(sparse):
            expected[b, positions[b, valid[b]]] = change[b, valid[b]]
        drift = np.asarray(state.slots.drift)
        same_request = np.asarray(state.slots.request) == slots.request
        np.testing.assert_allclose(drift[same_request], expected[same_request], rtol=1e-5, atol=1e-6)
        checked += int(valid[same_request].sum())
    assert checked > 0


def test_the_staleness_probe_matches_one_row_replaced_at_a_time():
    """attention and error of _attention_and_error against recomputing the attention with
    each key's exact K/V replaced by its cached one, one key at a time."""
    rng = np.random.default_rng(0)
    W, H, n, Dh = 3, 2, 7, 4
    q, k_exact, v_exact = (rng.normal(size=s) for s in ((W, H, Dh), (n, H, Dh), (n, H, Dh)))
    k_cached, v_cached = k_exact + rng.normal(size=(n, H, Dh)), v_exact + rng.normal(size=(n, H, Dh))
    key_valid = np.arange(n) < 6
    row_weight = np.array([0.5, 0.5, 0.0])  # the third window row is invalid
    attention, error = _attention_and_error(
        *(jnp.asarray(a, jnp.float32) for a in (q, k_exact, v_exact, k_cached, v_cached)),
        jnp.asarray(key_valid),
        jnp.asarray(row_weight, jnp.float32),
        Dh**-0.5,
    )

    def attend(keys, values):
        logits = np.einsum("rhd,lhd->rhl", q, keys[:6]) * Dh**-0.5
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return p, np.einsum("rhl,lhd->rhd", p, values[:6])

    p, out = attend(k_exact, v_exact)
    for i in range(n):
        if not key_valid[i]:
            assert (attention[i], error[i]) == (0, 0)
            continue
        k, v = k_exact.copy(), v_exact.copy()
        k[i], v[i] = k_cached[i], v_cached[i]
        _, stale = attend(k, v)
        per_row = np.linalg.norm(stale - out, axis=-1).mean(axis=1)
        np.testing.assert_allclose(error[i], per_row @ row_weight, rtol=1e-4)
        np.testing.assert_allclose(attention[i], p[:, :, i].mean(axis=1) @ row_weight, rtol=1e-5)


def test_the_probe_reports_the_decoded_rows_of_sparse_steps(engine, prompts):
    compiled = engine.compile(DECODE, max(map(len, prompts)))
    state = compiled.initial_state(prompts, SamplingParams(threshold=THRESHOLD))
    state = compiled.run(engine.weights, state, 2)
    probe = jax.device_get(jax.jit(lambda w, s: probe_staleness(compiled.loop, w, s))(engine.weights, state))
    slots = jax.device_get(state.slots)
    pos = np.arange(compiled.loop.max_len)
    expected = (slots.active & ~slots.needs_full)[:, None] & slots.decoded & (pos < slots.key_len[:, None])
    np.testing.assert_array_equal(probe.rows, expected)
    assert expected.any()
    for name in ("attention", "drift", "error"):
        values = getattr(probe, name)
        assert np.isfinite(values).all() and (values[:, ~expected] == 0).all(), name
        assert (values[:, expected] > 0).any(), name
    # per layer, the window's attention over the decoded rows is a part of its whole attention
    assert (probe.attention.sum(axis=2) <= 1 + 1e-5).all()


def test_the_rule_is_validated_and_reaches_the_cli_and_the_server():
    with pytest.raises(SamplingParamsError, match="track_rule='best'"):
        SamplingParams(track_rule="best")
    import argparse

    parser = argparse.ArgumentParser()
    add_knob_flags(parser.add_argument_group())
    assert knob_values(parser.parse_args(["--track-rule", "drift"]))["track_rule"] == "drift"
    assert knob_values(parser.parse_args([]))["track_rule"] == "attention"
    with pytest.raises(SystemExit):
        parser.parse_args(["--track-rule", "best"])
    body = CompletionRequest(model="m", prompt="x", dllm={"track_rule": "recent"})
    assert make_params(body).track_rule == "recent"
    with pytest.raises(ValueError, match="track_rule"):
        CompletionRequest(model="m", prompt="x", dllm={"track_rule": "best"})


@pytest.mark.parametrize(
    "decode, why",
    [
        (DecodeConfig(method="flash_cache", gen_length=32, track_num=-1), "track_num >= 0"),
        (DecodeConfig(method="fast_dllm", gen_length=32), "method='fast_dllm'"),
    ],
)
def test_a_rule_the_loop_cannot_apply_is_refused(engine, decode, why):
    with pytest.raises(GenerationError, match=why):
        engine.generate([[1, 2, 3]], SamplingParams(track_rule="recent"), decode_config=decode)
