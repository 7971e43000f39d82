"""The server's stable-prefix streaming logic and request validation, without a server."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dllm_jax.engine.results import first_stop
from dllm_jax.serve.protocol import ChatCompletionRequest, CompletionRequest
from dllm_jax.serve.stable_text import StableText, stable_prefix_length, stop_prefix_holdback

pytestmark = pytest.mark.unit

EOS = 0
ALPHABET = "abc#\n"


def decode(ids):
    """A toy tokenizer: id i > 0 is ALPHABET[i - 1]; EOS (0) decodes to nothing."""
    return "".join(ALPHABET[i - 1] for i in ids if i)


def reference_answer(tokens, stops, max_tokens):
    """What the whole answer says: text before the first EOS (within max_tokens), cut at the
    first stop string."""
    ids = tokens[:max_tokens]
    ended = EOS in ids
    if ended:
        ids = ids[: ids.index(EOS)]
    text = decode(ids)
    cut = first_stop(text, stops)
    if cut is not None:
        return text[:cut], "stop"
    return text, "stop" if ended else "length"


def test_stable_prefix_length_counts_leading_decoded_positions():
    assert stable_prefix_length([True, True, False, True]) == 2
    assert stable_prefix_length([False, True]) == 0
    assert stable_prefix_length([True] * 3) == 3
    assert stable_prefix_length([]) == 0


def test_stop_prefix_holdback_keeps_only_tails_that_may_become_a_stop():
    assert stop_prefix_holdback("ab##", ["###"]) == 2
    assert stop_prefix_holdback("ab#", ["###", "b#c"]) == 2
    assert stop_prefix_holdback("abc", ["###"]) == 0
    assert stop_prefix_holdback("", ["###"]) == 0


def test_text_appears_only_once_the_prefix_before_it_is_decoded():
    text = StableText(decode, 6, end_ids=[EOS])
    text.commit([2, 3], [3, 3])  # "cc" at positions 2-3, nothing before them
    assert text.advance().text == ""
    text.commit([0], [1])
    assert text.advance().text == "a"
    text.commit([1], [2])
    assert text.advance().text == "bcc"
    text.commit([4, 5], [EOS, EOS])
    delta = text.advance()
    assert (delta.text, delta.finish_reason) == ("", "stop")
    assert text.eos_position == 4


def test_stop_string_is_held_back_then_cut():
    text = StableText(decode, 8, end_ids=[EOS], stops=["##"])
    text.commit([0, 1, 2], [1, 2, 4])  # "ab#": "#" may start "##"
    assert text.advance().text == "ab"
    text.commit([3], [4])
    delta = text.advance()
    assert (delta.text, delta.finish_reason) == ("", "stop")
    assert text.emitted == "ab" and text.answer_tokens == 2


def test_max_tokens_ends_the_answer_with_length():
    text = StableText(decode, 8, end_ids=[EOS], max_tokens=3)
    text.commit([0, 1, 2, 3], [1, 1, 1, 1])
    delta = text.advance()
    assert (delta.text, delta.finish_reason) == ("aaa", "length")
    assert text.answer_tokens == 3


def test_finish_emits_the_rest_of_the_engine_answer_once():
    text = StableText(decode, 4, end_ids=[EOS])
    text.commit([0], [1])
    assert text.advance().text == "a"
    assert text.finish("abc", "stop").text == "bc"
    assert text.finish("abc", "stop").text == ""


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, len(ALPHABET)), min_size=1, max_size=24),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=2),
    max_tokens=st.integers(1, 30),
    seed=st.integers(0, 2**16),
)
def test_any_commit_order_streams_the_final_answer_append_only(tokens, stops, max_tokens, seed):
    """Commits in random order and random groups: the deltas concatenate to the answer, every
    emitted text is a prefix of it, and the finish comes exactly when the answer is complete."""
    expected, reason = reference_answer(tokens, stops, max_tokens)
    order = list(range(len(tokens)))
    random.Random(seed).shuffle(order)
    text = StableText(decode, len(tokens), end_ids=[EOS], stops=stops, max_tokens=max_tokens)
    streamed, finish = "", None
    while order and finish is None:
        group, order = order[:3], order[3:]
        text.commit(group, [tokens[p] for p in group])
        delta = text.advance()
        streamed += delta.text
        assert expected.startswith(streamed)
        finish = delta.finish_reason
    assert finish == reason
    assert streamed == expected


def test_request_models_name_the_bad_field():
    with pytest.raises(ValueError, match="top_k and dllm.top_k disagree"):
        CompletionRequest(model="m", prompt="x", top_k=2, dllm={"top_k": 3})
    with pytest.raises(ValueError, match="max_tokens and max_completion_tokens disagree"):
        ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2, max_completion_tokens=3
        )
    with pytest.raises(ValueError, match="stream_options"):
        CompletionRequest(model="m", prompt="x", stream_options={"include_usage": True})
    with pytest.raises(ValueError, match="gamma"):
        CompletionRequest(model="m", prompt="x", dllm={"gamma": 0})
    with pytest.raises(ValueError, match="temperature"):
        CompletionRequest(model="m", prompt="x", temperature="0.5")


def test_completion_prompts_in_every_openai_form():
    assert CompletionRequest(model="m", prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(ValueError, match="empty"):
        CompletionRequest(model="m", prompt=[]).prompts()
    chat = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2"}]},
        ],
    )
    assert chat.conversation() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2"}]
