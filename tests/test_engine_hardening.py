"""The decode loop always terminates: non-finite logits and runaway requests end with an error
in THEIR result while the other requests go on; sessions take requests online and abort them."""

import dataclasses
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dllm_jax.engine.session as session_module
from dllm_jax import GenerationError, RequestStatus, SamplingParams
from tests.engine_checks import FAST_DUAL, FLASH, FLASH_VERIFY, LLADA, one_slot, with_weights

pytestmark = pytest.mark.engine

# the token whose embedding the poisoned model holds as non-finite: one the lively model never
# answers with here (an answer holding it would turn non-finite at the next block, rightly)
POISON = 51


def _poisoned(engine, value: float):
    """The engine's model with token POISON's embedding set to `value` (its compiled loops shared)."""
    params = dict(engine.weights)
    wte = params["wte"]["embedding"]
    params["wte"] = {"embedding": wte.at[POISON].set(value)}
    return with_weights(engine, params)


@pytest.fixture(scope="module")
def engine(lively_engine):
    return lively_engine


@pytest.fixture(scope="module")
def nan_engine(engine):
    return _poisoned(engine, float("nan"))


# each loop with the request values its tests decode with
DECODES = {
    "flash": (FLASH, SamplingParams(threshold=0.5)),
    "verify": (FLASH_VERIFY, SamplingParams(threshold=0.7, gamma=0.5)),
    "fast_dllm": (FAST_DUAL, SamplingParams(threshold=0.5)),
    "llada": (LLADA, SamplingParams()),
}


@pytest.mark.parametrize("name", list(DECODES))
def test_non_finite_logits_end_that_request_only(nan_engine, engine, name):
    decode, sampling = DECODES[name]
    prompts = [[3, 4, 5], [7, POISON, 9, 10], [11, 12], [POISON], [13, 14, 15]]
    out = nan_engine.generate(prompts, sampling, decode_config=decode)
    clean = engine.generate([p for p in prompts if POISON not in p], sampling, decode_config=decode)
    clean_results = iter(clean.results)
    for prompt, r in zip(prompts, out.results):
        if POISON in prompt:
            assert r.finish_reason == "error" and "non-finite logits" in r.error
            assert r.steps == 1
        else:
            expected = next(clean_results)
            assert POISON not in expected.token_ids, "the clean answer holds POISON: choose another token"
            assert (r.token_ids, r.finish_reason, r.error) == (expected.token_ids, expected.finish_reason, None)


@pytest.mark.parametrize("name", ["fast_dllm", "llada"])
def test_a_slot_after_a_non_finite_request_decodes_as_if_fresh(nan_engine, engine, name):
    """One slot: a long poisoned request leaves NaN K/V in its cache rows, also past the next
    request's keys (these methods attend to exactly prompt + max_new_tokens keys); the next
    request in that slot must not see them (its full pass rewrites its own rows, attention hides
    the rest by selection: the loop does not clear them)."""
    decode, sampling = DECODES[name]
    decode = one_slot(decode)
    params = [dataclasses.replace(sampling, max_new_tokens=32), dataclasses.replace(sampling, max_new_tokens=16)]
    prompts = [[POISON] + list(range(1, 16)), [3, 4, 5]]
    out = nan_engine.generate(prompts, params, decode_config=decode)
    clean = engine.generate(prompts[1:], params[1:], decode_config=decode).results[0]
    assert out.results[0].finish_reason == "error"
    after = out.results[1]
    assert (after.token_ids, after.finish_reason, after.error) == (clean.token_ids, clean.finish_reason, None)


def test_a_model_with_a_nan_layer_errors_every_request_without_hanging(engine):
    params = engine.weights
    layers = dict(params["layers"])
    mlp = dict(layers["ff_out"])
    mlp["kernel"] = mlp["kernel"].at[1].set(jnp.nan)  # layer 1 of the stacked weights
    layers["ff_out"] = mlp
    broken = with_weights(engine, {**params, "layers": layers})
    decode, sampling = DECODES["flash"]
    out = broken.generate([[1, 2, 3], [4, 5]] * 3, sampling, decode_config=decode)
    assert [r.finish_reason for r in out.results] == ["error"] * 6
    assert all(r.steps == 1 for r in out.results)


def test_a_request_past_its_step_bound_ends_with_an_error(engine, monkeypatch):
    """A commit rule that stops committing cannot spin: the request's step bound ends it."""
    resolve = session_module.slot_values

    def tight(sampling, prompt_len, *args, **kwargs):
        values = resolve(sampling, prompt_len, *args, **kwargs)
        return dict(values, step_limit=3) if sampling.seed == 1 else values

    monkeypatch.setattr(session_module, "slot_values", tight)
    one_per_step = dict(threshold=2.0, max_new_tokens=16)  # one token per step: 16 steps
    out = engine.generate(
        [[1, 2, 3], [4, 5, 6]],
        [SamplingParams(seed=1, **one_per_step), SamplingParams(seed=2, **one_per_step)],
        decode_config=FLASH,
    )
    bounded, free = out.results
    assert bounded.finish_reason == "error" and "step bound" in bounded.error and bounded.steps == 3
    assert free.finish_reason in ("stop", "length") and free.steps > 3


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    poison=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    name=st.sampled_from(["flash", "fast_dllm"]),
)
def test_the_loop_terminates_on_any_mix_of_finite_and_non_finite_requests(engine, data, poison, name):
    poisoned = _POISONED.setdefault(poison, _poisoned(engine, poison))
    n = data.draw(st.integers(1, 5), label="requests")
    prompts = [data.draw(st.lists(st.sampled_from([1, 2, 3, 40, POISON]), min_size=1, max_size=6)) for _ in range(n)]
    params = [
        SamplingParams(
            max_new_tokens=data.draw(st.integers(1, 16)),
            threshold=data.draw(st.sampled_from([0.0, 0.5, 0.99, 2.0])),
            temperature=data.draw(st.sampled_from([0.0, 1.0])),
            seed=data.draw(st.integers(0, 5)),
        )
        for _ in range(n)
    ]
    out = poisoned.generate(prompts, params, decode_config=DECODES[name][0])
    canvas = DECODES[name][0].gen_length  # max_new_tokens cuts the answer; the step bound is the canvas's
    for prompt, p, r in zip(prompts, params, out.results):
        assert r.steps <= 2 * canvas + 2
        if POISON in prompt:
            assert r.finish_reason == "error", (prompt, r)
        else:
            assert r.finish_reason in ("stop", "length") and len(r.token_ids) <= p.max_new_tokens


_POISONED: dict = {}


# ----- sessions ----------------------------------------------------------------------------------


def test_session_takes_requests_online_and_matches_generate(engine):
    decode, sampling = DECODES["flash"]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12, 13]]
    expected = engine.generate(prompts, sampling, decode_config=decode)
    session = engine.session(decode, max_prompt_len=16)
    session.add("a", prompts[0], sampling)
    session.add("b", prompts[1], sampling)
    results = {}
    for i, p in enumerate(prompts[2:]):
        for u in session.step(2):
            if u.result:
                results[u.request_id] = u.result
        session.add(f"late{i}", p, sampling)
    while session.num_running or session.num_waiting:
        for u in session.step():
            if u.result:
                results[u.request_id] = u.result
    got = [results[k] for k in ["a", "b", "late0", "late1", "late2"]]
    assert [r.token_ids for r in got] == [r.token_ids for r in expected.results]
    with pytest.raises(GenerationError, match="already in this session"):
        session.add("x", [1]) or session.add("x", [1])
    with pytest.raises(GenerationError, match="max_prompt_len=16"):
        session.add("long", [1] * 17)


def test_session_abort_frees_the_slot_and_reports_nothing(engine):
    session = engine.session(FLASH, max_prompt_len=16, num_slots=2)
    for name in ("run", "stop_running", "stop_waiting", "after"):
        session.add(name, [1, 2, 3], SamplingParams(threshold=2.0, max_new_tokens=16))
    session.step(1)
    assert session.num_running == 4 and session.num_waiting == 0  # all four fit the ring
    assert session.abort("stop_running") and session.abort("stop_waiting")
    assert not session.abort("unknown")
    finished = {}
    for _ in range(100):
        if not (session.num_running or session.num_waiting):
            break
        for u in session.step(4):
            if u.result:
                finished[u.request_id] = u.result
    assert set(finished) == {"run", "after"}
    assert finished["after"].token_ids == finished["run"].token_ids


def test_an_aborted_requests_slot_takes_the_next_request_within_two_calls(engine):
    """step() dispatches the next call before it reads the last one's results. An abort takes
    effect in the next call (the aborted request's last step, then its slot takes the waiting
    request), the waiting request commits in the call after, and the host reads that one step()
    later: three step() calls after the abort."""
    session = engine.session(DECODES["flash"][0], max_prompt_len=16, num_slots=2, stream=True)
    one_per_step = SamplingParams(threshold=2.0)
    for name in ("a", "b", "next"):
        session.add(name, [1, 2, 3], one_per_step)
    seen = set()
    for _ in range(2):  # the first call's report is read by the second step()
        seen |= {u.request_id for u in session.step(1) if u.commits}
    assert seen == {"a", "b"}
    assert session.status("next") is RequestStatus.RUNNING  # in the device's ring, waiting for a slot
    assert session.abort("a") and session.status("a") is None
    later = [{u.request_id for u in session.step(1) if u.commits} for _ in range(3)]
    assert later == [{"b"}, {"b"}, {"b", "next"}], later
    while session.num_running:
        session.step(8)


def test_streamed_commits_rebuild_the_answer(engine):
    decode, sampling = DECODES["verify"]
    sampling = dataclasses.replace(sampling, max_new_tokens=16)
    session = engine.session(decode, max_prompt_len=16, stream=True)
    prompts = {"x": [1, 2, 3], "y": [9, 8, 7, 6]}
    for k, p in prompts.items():
        session.add(k, p, sampling)
    canvases = {k: {} for k in prompts}
    steps_seen = {k: [] for k in prompts}
    verified = {k: 0 for k in prompts}
    results = {}
    while session.num_running or session.num_waiting:
        for u in session.step(1):
            for c in u.commits:
                steps_seen[u.request_id].append(c.step)
                verified[u.request_id] += sum(c.verified)
                for pos, tok in zip(c.positions, c.tokens):
                    assert pos not in canvases[u.request_id]
                    canvases[u.request_id][pos] = tok
            if u.result:
                results[u.request_id] = u.result
    for k, r in results.items():
        assert steps_seen[k] == sorted(set(steps_seen[k])), "each step reported once, in order"
        answer = [canvases[k][i] for i in range(len(r.token_ids))]
        assert answer == r.token_ids
        assert verified[k] == r.accepted_drafts
    assert sum(verified.values()) > 0, "the setting should accept some drafts"
    expected = engine.generate(list(prompts.values()), sampling, decode_config=decode)
    assert [results[k].token_ids for k in prompts] == [r.token_ids for r in expected.results]


def test_results_ring_carries_commit_steps(engine):
    decode, sampling = DECODES["flash"]
    compiled = engine.compile(decode, 16)
    state = compiled.initial_state([[1, 2, 3]], dataclasses.replace(sampling, gen_length=12))  # 12 of the bucket's 32
    state = compiled.run(engine.weights, state, 100)
    steps = np.asarray(state.results.commit_step[0])
    assert steps.shape == (32,)
    assert (steps[12:] == -1).all(), "padding positions are never committed"
    assert steps[:12].max() < int(state.results.steps[0])


def test_a_long_sessions_timeline_is_trimmed_to_what_its_results_need(engine, monkeypatch):
    """A server's session lives for millions of calls: its timeline keeps only the entries its
    running requests' seconds interpolate over, and the seconds come out as untrimmed (the same
    calls on a clock that counts its readings)."""

    def run(trim: int) -> tuple[list[float], int]:
        ticks = iter(range(1_000_000))
        monkeypatch.setattr(session_module, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
        monkeypatch.setattr(session_module, "_TIMELINE_TRIM", trim)
        session = engine.session(FLASH, max_prompt_len=16, num_slots=2)
        seconds, longest = {}, 0
        for i in range(24):  # short requests arrive every other call, so the oldest one moves on
            session.add(i, [1 + i, 2, 3], SamplingParams(threshold=2.0, max_new_tokens=2 + i % 3))
            for _ in range(2):
                for u in session.step(2):
                    if u.result:
                        seconds[u.request_id] = u.result.seconds
                longest = max(longest, len(session.timeline))
        while session.num_running or session.num_waiting:
            for u in session.step(2):
                if u.result:
                    seconds[u.request_id] = u.result.seconds
            longest = max(longest, len(session.timeline))
        return [seconds[i] for i in range(24)], longest

    untrimmed, grown = run(10_000)
    trimmed, bounded = run(4)
    assert trimmed == untrimmed and all(s > 0 for s in trimmed)
    assert grown >= 48 and bounded <= 12, (bounded, grown)
