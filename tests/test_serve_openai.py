"""OpenAI's fields through the official `openai` client against both endpoints (issue 34, items
3, 4 and 7): max_tokens cuts the answer, n independent samples, logprobs, echo, the default
values clients send, refusals with their reason, and the engine's counters over HTTP. One
server subprocess (the embedded tiny model; flash_cache, fast_dllm and llada+cfg) for the
module."""

from __future__ import annotations

import openai
import pytest

from dllm_jax import DecodeConfig, Engine
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.sampling.params import SamplingParams
from dllm_jax.serve.params import choice_seed
from tests.server_process import ServerProcess

MODEL = "tiny-llada"
GEN = 64
QUESTION = "13+5-1-9"
ANSWER = "13+5=18\n18-1=17\n17-9=8\n#### 8"  # the embedded model's answer


@pytest.fixture(scope="module")
def server():
    # 2 slots: enough for n=3 and two prompts to share the loop (the rest wait), and the start-up's
    # warm-up runs each loop's requests to their end (llada+cfg's one step per token, two passes a
    # step: about 11 s with 2 slots on the 2-core CPU, 21 s with 4)
    proc = ServerProcess(
        ["--batch-size", "2", "--max-logprobs", "3"]
        + ["--method", "flash_cache", "--method", "fast_dllm", "--method", "llada+cfg"]
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(str(tiny_model_path()), dtype="float32")


def ask(client, content: str = QUESTION, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def streamed(client, **kw) -> tuple[str, list, str | None]:
    """The text, the logprob records and the finish reason of a streamed chat answer."""
    text, records, reason = "", [], None
    for chunk in ask(client, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                records += choice.logprobs.content
            reason = choice.finish_reason or reason
    return text, records, reason


def test_max_tokens_cuts_the_answer_on_both_endpoints(client, engine):
    full = ask(client)
    assert full.choices[0].message.content == ANSWER and full.choices[0].finish_reason == "stop"
    for k in (1, 5, 12):
        cut = ask(client, max_tokens=k)
        assert cut.choices[0].message.content == ANSWER[:k] and cut.choices[0].finish_reason == "length"
        assert cut.usage.completion_tokens == k
        assert streamed(client, max_tokens=k)[::2] == (ANSWER[:k], "length")
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=5)
    assert text.choices[0].text == ANSWER[:5] and text.choices[0].finish_reason == "length"
    # the diffusion knob: a canvas of 8 positions, a different answer of at most 8 tokens
    small = ask(client, extra_body={"dllm": {"gen_length": 8}})
    assert small.usage.completion_tokens <= 8
    with pytest.raises(openai.BadRequestError, match="max_tokens=9 is more than the request's dllm.gen_length"):
        ask(client, max_tokens=9, extra_body={"dllm": {"gen_length": 8}})


def test_n_gives_independent_samples_with_derived_seeds(client):
    sampled = dict(temperature=2.0, seed=11, max_tokens=8)
    answer = ask(client, "sort: 5 3 8 1 9 2", n=3, **sampled)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for j, choice in enumerate(answer.choices):
        alone = ask(client, "sort: 5 3 8 1 9 2", **{**sampled, "seed": choice_seed(11, j)})
        assert choice.message.content == alone.choices[0].message.content
    assert answer.usage.completion_tokens == sum(len(c.message.content) for c in answer.choices)
    both = client.completions.create(model=MODEL, prompt=["sort: 2 1", "sort: 4 3"], n=2, max_tokens=4, seed=3)
    assert sorted(c.index for c in both.choices) == [0, 1, 2, 3]


def test_chat_logprobs_stream_and_answer_agree(client):
    answer = ask(client, logprobs=True, top_logprobs=3, max_tokens=12)
    records = answer.choices[0].logprobs.content
    assert "".join(r.token for r in records) == answer.choices[0].message.content == ANSWER[:12]
    for r in records:
        assert r.logprob <= 0 and r.bytes == list(r.token.encode())
        assert len(r.top_logprobs) == 3 and r.top_logprobs[0].token == r.token  # greedy: the most likely
        values = [t.logprob for t in r.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == pytest.approx(r.logprob)
    text, chunks, _ = streamed(client, logprobs=True, top_logprobs=3, max_tokens=12)
    assert text == ANSWER[:12] and [(r.token, r.logprob) for r in chunks] == [(r.token, r.logprob) for r in records]
    assert ask(client, max_tokens=3).choices[0].logprobs is None


def test_completion_logprobs_and_echo(client, engine):
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    answer = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert "".join(logprobs.tokens) == answer.choices[0].text == ANSWER[:10]
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == 10
    assert logprobs.text_offset == list(range(10))  # one character per token
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in logprobs.top_logprobs)
    echoed = client.completions.create(model=MODEL, prompt="sort: 3 1 2", echo=True, max_tokens=3)
    assert echoed.choices[0].text.startswith("sort: 3 1 2")
    stream = client.completions.create(model=MODEL, prompt="sort: 3 1 2", echo=True, max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text


def test_the_defaults_clients_send_are_accepted_and_the_rest_refused_with_the_reason(client):
    defaults = dict(
        n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False, response_format={"type": "text"}, max_tokens=5
    )
    assert ask(client, **defaults).choices[0].message.content == ANSWER[:5]
    text = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, echo=False, presence_penalty=0, frequency_penalty=0, best_of=1
    )
    assert text.choices[0].finish_reason in ("stop", "length")
    refusals = [
        (lambda: ask(client, presence_penalty=0.5), "commits tokens anywhere"),
        (lambda: ask(client, frequency_penalty=-1), "no 'already generated' prefix"),
        (lambda: ask(client, response_format={"type": "json_object"}), "does not constrain decoding"),
        (
            lambda: client.completions.create(model=MODEL, prompt="x", echo=True, logprobs=1),
            "never predicts its prompt",
        ),
        (lambda: ask(client, top_logprobs=2), "top_logprobs needs logprobs=true"),
        (lambda: ask(client, logprobs=True, top_logprobs=4), "records at most 3 alternatives"),
    ]
    for call, reason in refusals:
        with pytest.raises(openai.BadRequestError, match=reason):
            call()


def test_counters_over_http_are_the_engines(client, engine):
    """fast_dllm decodes its whole canvas after the EOS: the server waits for the engine's
    result, so forward_passes is reported and every counter is Engine.generate's."""
    filler = [0] * (engine.config.max_sequence_length - GEN)  # the server's prompt bucket
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    decode = DecodeConfig(method="fast_dllm", gen_length=GEN, batch_size=1)
    reference = engine.generate(
        [ids, filler], [SamplingParams(), SamplingParams(max_new_tokens=1)], decode_config=decode
    )
    expected = reference.results[0]
    answer = ask(client, extra_body={"dllm": {"method": "fast_dllm"}})
    stats = answer.model_extra["dllm"]
    assert answer.choices[0].message.content == expected.text
    assert stats["steps"] == expected.steps and stats["forward_passes"] == expected.forward_passes is not None
    assert stats["reference_tokens"] == expected.reference_num_tokens
    assert stats["tokens_per_step"] == pytest.approx(expected.reference_num_tokens / expected.steps)
    assert answer.usage.completion_tokens == expected.completion_tokens


def test_cfg_scale_runs_on_the_guided_loop(client):
    guided = ask(client, max_tokens=8, extra_body={"dllm": {"method": "llada+cfg", "cfg_scale": 1.0}})
    assert guided.choices[0].finish_reason in ("stop", "length") and guided.usage.completion_tokens <= 8
    with pytest.raises(openai.BadRequestError, match="dllm.method='llada\\+cfg'"):
        ask(client, extra_body={"dllm": {"cfg_scale": 1.0}})
