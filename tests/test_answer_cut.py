"""max_new_tokens cuts the answer; gen_length sets the canvas (issue 34, item 3).

A request cut at k tokens decodes on its full canvas and returns the first k tokens of the
answer it would have given uncut (finish_reason "length" unless that answer ended earlier),
and its decoding stops once those k positions are decoded. A smaller gen_length is the other,
diffusion, behaviour: the model sees a shorter masked answer (tests/test_engine.py pins that it
decodes as a DecodeConfig of that length).
"""

from __future__ import annotations

import pytest

from dllm_jax.common.errors import GenerationError
from dllm_jax.sampling.params import SamplingParams
from tests.engine_checks import FAST_DUAL, FLASH, LLADA, random_prompts

pytestmark = pytest.mark.engine

# The session's shared loops over the lively model (tests/engine_checks.py): Flash-Cache with
# look-ahead masks and tracked rows, Fast-dLLM (dual cache) and LLaDA's sampler over two blocks
# of 16; the cut at 17 ends inside the second block.
DECODES = {"flash_cache": FLASH, "fast_dllm": FAST_DUAL, "llada": LLADA}
CUTS = (1, 3, 17)


@pytest.fixture(scope="module")
def engine(lively_engine):
    return lively_engine


@pytest.mark.parametrize("method", list(DECODES))
def test_a_cut_answer_is_the_prefix_of_the_uncut_one(engine, method):
    decode = DECODES[method]
    prompts = random_prompts()
    sampling = dict(threshold=0.3) if method != "llada" else {}
    full = engine.generate(prompts, SamplingParams(**sampling), decode_config=decode).results
    assert any(len(r.token_ids) > max(CUTS) for r in full), "the lively model writes long answers"
    for k in CUTS:
        cut = engine.generate(prompts, SamplingParams(max_new_tokens=k, **sampling), decode_config=decode).results
        for whole, part in zip(full, cut):
            assert part.token_ids == whole.token_ids[:k]
            ended_before = len(whole.token_ids) < k
            assert part.finish_reason == ("stop" if ended_before else "length")
            assert part.completion_tokens == len(part.token_ids) <= k
            assert part.steps <= whole.steps and part.reference_num_tokens <= k


def test_the_cut_ends_the_decoding_early(engine):
    """One commit per step (a threshold above 1), by confidence anywhere in the window: a cut
    at 3 ends at the step that decodes the last of the first 3 positions, before the full
    answer's last step."""
    decode = DECODES["flash_cache"]
    prompts = random_prompts()
    session = engine.session(decode, max_prompt_len=max(map(len, prompts)), stream=True)
    for i, ids in enumerate(prompts):
        session.add(("full", i), ids, SamplingParams(threshold=2.0))
        session.add(("cut", i), ids, SamplingParams(threshold=2.0, max_new_tokens=3))
    commit_step, results = {}, {}
    while session.num_running or session.num_waiting:
        for update in session.step(1):
            for commits in update.commits:
                for p in commits.positions:
                    commit_step.setdefault(update.request_id, {})[p] = commits.step
            if update.result is not None:
                results[update.request_id] = update.result
    for i in range(len(prompts)):
        whole, part = results[("full", i)], results[("cut", i)]
        assert part.token_ids == whole.token_ids[:3]
        if len(whole.token_ids) >= 3:
            steps = commit_step[("full", i)]
            assert part.steps == 1 + max(steps[p] for p in range(3)) < whole.steps
            assert part.finish_reason == "length"


def test_gen_length_and_max_new_tokens_bounds(engine):
    decode = DECODES["flash_cache"]
    cases = [
        (SamplingParams(gen_length=8, max_new_tokens=9), "max_new_tokens=9 is more than the request's gen_length=8"),
        (SamplingParams(gen_length=33), "gen_length=33 is more than this engine's generation bucket gen_length=32"),
        (SamplingParams(max_new_tokens=40), "max_new_tokens=40 is more than this engine's generation bucket"),
    ]
    for sampling, message in cases:
        with pytest.raises(GenerationError, match=message):
            engine.generate([[1, 2, 3]], sampling, decode_config=decode)
    short = engine.generate([[1, 2, 3]], SamplingParams(gen_length=8, max_new_tokens=8), decode_config=decode).results[
        0
    ]
    assert len(short.token_ids) <= 8
