"""Log-probabilities recorded at each token's commit (SamplingParams.logprobs, issue 34 item 4).

LLaDA's loop runs a full forward pass at every step, so the logits a commit saw are those of
the no-cache model on the canvas of that step: the prompt, the tokens committed at earlier
steps, masks elsewhere. The recorded log-probability must be log_softmax of those logits at
the token, and the alternatives that row's most likely tokens.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.common.errors import GenerationError
from dllm_jax.engine.engine import Engine
from dllm_jax.models.transformer import forward
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.params import SamplingParams
from tests.engine_checks import random_prompts

TOP = 3
LLADA = DecodeConfig(method="llada", gen_length=16, block_length=8, steps=16, batch_size=2, max_logprobs=TOP)
FLASH_VERIFY = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, verify=True, max_logprobs=TOP)


@pytest.fixture(scope="module")
def engine(lively):
    cfg, params = lively
    return Engine(cfg, params, backend="xla")


def run_session(engine: Engine, decode: DecodeConfig, prompts, samplings):
    """Results and, per request, {position: (step, TokenLogprob)} from the streamed commits."""
    session = engine.session(decode, max_prompt_len=max(map(len, prompts)), stream=True)
    for i, (ids, sampling) in enumerate(zip(prompts, samplings)):
        session.add(i, ids, sampling)
    commits, results = {i: {} for i in range(len(prompts))}, {}
    while session.num_running or session.num_waiting:
        for update in session.step(1):
            for step in update.commits:
                records = step.logprobs or (None,) * len(step.positions)
                for position, record in zip(step.positions, records):
                    commits[update.request_id][position] = (step.step, record)
            if update.result is not None:
                results[update.request_id] = update.result
    return [results[i] for i in range(len(prompts))], [commits[i] for i in range(len(prompts))]


def test_llada_commits_record_the_log_softmax_of_their_steps_logits(engine):
    cfg = engine.config
    prompts = random_prompts()[:3]
    results, commits = run_session(engine, LLADA, prompts, [SamplingParams(logprobs=TOP)] * len(prompts))
    full_forward = jax.jit(lambda t: forward(cfg, engine.weights, t[None])[0])
    G = LLADA.gen_length
    for prompt, result, committed in zip(prompts, results, commits):
        assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
        P = len(prompt)
        for position, (step, record) in committed.items():
            canvas = np.array(list(prompt) + [cfg.mask_token_id] * G, np.int32)
            for other, (other_step, other_record) in committed.items():
                if other_step < step:
                    canvas[P + other] = other_record.token_id
            logits = np.asarray(full_forward(jnp.asarray(canvas)), np.float64)[P + position]
            expected = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
            assert record.logprob == pytest.approx(expected[record.token_id], abs=2e-4)
            top = [t for t, _ in record.top]
            assert top == list(np.argsort(-expected, kind="stable")[:TOP])
            assert [v for _, v in record.top] == pytest.approx(list(expected[top]), abs=2e-4)
        for p, r in enumerate(result.logprobs):  # the result's records are the commits'
            assert r == committed[p][1]


def test_flash_verify_greedy_tokens_are_their_steps_most_likely(engine):
    """Greedy: every committed token (window commits and accepted drafts) is the argmax of its
    step's logits, so its record is the first alternative; other requests are not changed by
    one that asks."""
    prompts = random_prompts()
    lenient = dict(threshold=0.7, gamma=0.3)  # as tests/test_verify.py: drafts get accepted
    asking = [SamplingParams(logprobs=TOP if i % 2 else None, **lenient) for i in range(len(prompts))]
    results, _ = run_session(engine, FLASH_VERIFY, prompts, asking)
    plain, _ = run_session(engine, FLASH_VERIFY, prompts, [SamplingParams(**lenient)] * len(prompts))
    assert sum(r.accepted_drafts for r in results) > 0, "Flash-Verify accepted drafts"
    for sampling, result, alone in zip(asking, results, plain):
        assert result.token_ids == alone.token_ids and result.steps == alone.steps
        if sampling.logprobs is None:
            assert result.logprobs is None
            continue
        for r in result.logprobs:
            assert r.logprob <= 0 and len(r.top) == TOP
            assert r.top[0] == (r.token_id, pytest.approx(r.logprob, abs=1e-6))
            values = [v for _, v in r.top]
            assert values == sorted(values, reverse=True)


def test_logprobs_beyond_the_loops_records_are_refused(engine):
    plain = DecodeConfig(method="llada", gen_length=16, block_length=8, steps=16, batch_size=2)
    with pytest.raises(GenerationError, match="this loop records no log-probabilities"):
        engine.generate([[1, 2, 3]], SamplingParams(logprobs=0), decode_config=plain)
    with pytest.raises(
        GenerationError, match=f"logprobs=4 asks for 4 alternatives per token; this loop records at most {TOP}"
    ):
        engine.generate([[1, 2, 3]], SamplingParams(logprobs=TOP + 1), decode_config=LLADA)
    # two prompts: the loop of the tests above (two slots)
    for result in engine.generate([[1, 2, 3], [4, 5]], SamplingParams(logprobs=0), decode_config=LLADA).results:
        assert len(result.logprobs) == len(result.token_ids)
        assert all(r.top == () and r.logprob <= 0 for r in result.logprobs)


def test_recording_adds_no_conditional_to_the_step(engine):
    """Recording is compiled in or not (DecodeConfig.max_logprobs), never a per-step branch:
    the loop that records has exactly the conditionals of the loop that does not."""
    plain = dataclasses.replace(LLADA, max_logprobs=None)

    def conditionals(decode: DecodeConfig) -> int:
        return len(re.findall(r"\sconditional\(", engine.compile(decode, 3, num_slots=2).call.as_text()))

    assert conditionals(LLADA) == conditionals(plain)
