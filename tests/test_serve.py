"""The OpenAI-compatible server end to end: one server subprocess on 127.0.0.1 (embedded tiny
model, 8 slots, an API key, a small waiting queue) serves every test of this file; the last
test stops it with SIGTERM. Queueing and 429, cancellation, deadlines, streaming order, request
validation and the API key are tests/test_serve_worker.py's, over a fake session."""

from __future__ import annotations

import concurrent.futures
import json
import random
import signal
import time

import httpx
import openai
import pytest

from dllm_jax import DecodeConfig, Engine
from dllm_jax.evaluation.tiny_tasks import held_out_problems
from dllm_jax.sampling.params import SamplingParams
from tests.server_process import ServerProcess

pytestmark = pytest.mark.integration

KEY = "test-key-0123456789"
MODEL = "tiny-llada"
SLOTS = 8
MAX_WAITING = 12
GEN = 64
# one token per step: a request that lasts GEN steps (cancellation, deadlines, a full queue)
SLOW = {"threshold": 1.5}
SLOW_TOKENS = 16


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        [
            "--api-key",
            KEY,
            "--batch-size",
            str(SLOTS),
            "--max-waiting",
            str(MAX_WAITING),
            "--shutdown-grace",
            "20",
            "--log-level",
            "warning",
        ]
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(embedded_engine):
    return embedded_engine


def alone(engine: Engine, prompts, params=None, *, chat: bool) -> list[str]:
    return [r.text for r in alone_results(engine, prompts, params, chat=chat)]


def alone_results(engine: Engine, prompts, params=None, *, chat: bool):
    """The prompts decoded in one call with their SamplingParams, with the server's method,
    lengths, slots and prompt bucket (an answer does not depend on the batch: tests/test_engine.py).

    The server compiles one loop for prompts up to its limit (64 tokens); a loop compiled for a
    shorter bucket has a shorter cache, whose attention sums round differently, and that flips
    threshold decisions of uncertain answers. A filler prompt of the limit's length puts these
    prompts in the server's bucket.
    """
    params = list(params) if params is not None else [SamplingParams()] * len(prompts)
    filler = [0] * (engine.config.max_sequence_length - GEN)
    ids = engine.encode(prompts, chat)
    # the server's own loop (its slots too), so the sums round as the server's do
    decode = DecodeConfig(method="flash_cache", gen_length=GEN, batch_size=SLOTS)
    engine.compile(decode, len(filler))  # all SLOTS slots, which generate then reuses for fewer requests
    out = engine.generate(ids + [filler], params + [SamplingParams(max_new_tokens=1)], decode_config=decode)
    return out.results[:-1]


def post(server, path: str, body, *, key: str | None = KEY, raw: bytes | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def wait_until_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics(KEY)
        if m["dllm_requests_running"] == 0 and m["dllm_slots_busy"] == 0 and m["dllm_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {m}"
        time.sleep(0.1)


def answered_total(m: dict[str, float]) -> float:
    """Requests answered, summed over finish reasons."""
    return sum(v for k, v in m.items() if k.startswith("dllm_requests_total{"))


def test_openai_client_chat_stream_equals_answer_equals_engine(server, client, engine):
    """Sampled (temperature 0.8, seed 3) and cut at a stop string: the stream, the answer and
    Engine.generate agree on the text and the counts."""
    asks = [("sort: 7 2 9 4", {}), ("(12+3)*2-5", {"stop": ["*2"]})]
    sampled = {"temperature": 0.8, "seed": 3}
    expected = alone_results(
        engine,
        [q for q, _ in asks],
        [SamplingParams(**sampled, stop=tuple(kw.get("stop", ()))) for _, kw in asks],
        chat=True,
    )
    for (question, kw), reference in zip(asks, expected):
        messages = [{"role": "user", "content": question}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, **sampled, **kw)
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, **sampled, **kw, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert answer.choices[0].message.content == streamed == reference.text
        assert answer.choices[0].finish_reason == reference.finish_reason == "stop"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
        assert usage.completion_tokens == answer.usage.completion_tokens == reference.completion_tokens
        assert usage.prompt_tokens == answer.usage.prompt_tokens == reference.prompt_tokens
    assert expected[0].text.startswith("2 4 7 9") and expected[1].text == "12+3=15\n15"
    stats = answer.model_extra["dllm"]
    assert stats["steps"] >= 1
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": asks[0][0]}])
    stats = plain.model_extra["dllm"]
    assert stats["forward_passes"] >= stats["steps"] >= 1
    # one definition everywhere (docs/counters.md): the reference tokens per step, as the library counts
    assert stats["tokens_per_step"] == pytest.approx(stats["reference_tokens"] / stats["steps"])


def test_completions_take_a_string_a_list_and_token_ids(server, client, engine):
    prompts = ["sort: 3 1 2", "sort: 9 8"]
    texts = alone(engine, prompts, chat=False)
    single = client.completions.create(model=MODEL, prompt=prompts[0])
    assert single.choices[0].text == texts[0] and single.object == "text_completion"
    both = client.completions.create(model=MODEL, prompt=prompts)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == texts
    ids = engine.tokenizer.encode(prompts[1])
    by_ids = client.completions.create(model=MODEL, prompt=ids)
    assert by_ids.choices[0].text == texts[1]
    stream = client.completions.create(model=MODEL, prompt=prompts, stream=True)
    streamed = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def test_32_requests_from_16_clients_each_answered_once_as_alone(server, engine):
    """Mixed lengths and parameters in one batch; each answer is the one of decoding it alone.
    32 requests: each of the 8 slots takes about 4 in turn, and every kind below is among them."""
    problems = held_out_problems(32, seed=11)
    rng = random.Random(0)
    asks = []
    for i, p in enumerate(problems):
        sampled = rng.random() < 0.4
        asks.append(
            {
                "prompt": p.prompt,
                "chat": rng.random() < 0.7,
                "stream": rng.random() < 0.5,
                "max_tokens": rng.choice([16, 40, GEN]),
                "temperature": 0.8 if sampled else None,
                "seed": i if sampled else None,
                "top_k": 5 if sampled and rng.random() < 0.5 else None,
                "threshold": rng.choice([None, 0.6, 0.95]),
            }
        )

    # every kind of request is in the mix (chat or not, streamed or not, each length, sampled with
    # and without top_k, each threshold)
    assert {(a["chat"], a["stream"]) for a in asks} == {(c, s) for c in (True, False) for s in (True, False)}
    assert {a["max_tokens"] for a in asks} == {16, 40, GEN} and {a["threshold"] for a in asks} == {None, 0.6, 0.95}
    assert {(a["temperature"], a["top_k"]) for a in asks} == {(None, None), (0.8, None), (0.8, 5)}

    def ask(a):
        body = {"model": MODEL, "max_tokens": a["max_tokens"], "dllm": {}}
        for key in ("temperature", "seed", "top_k"):
            if a[key] is not None:
                body[key] = a[key]
        if a["threshold"] is not None:
            body["dllm"]["threshold"] = a["threshold"]
        if a["chat"]:
            body["messages"], path = [{"role": "user", "content": a["prompt"]}], "/v1/chat/completions"
        else:
            body["prompt"], path = a["prompt"], "/v1/completions"
        if not a["stream"]:
            r = post(server, path, body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if a["chat"] else choice["text"]
        text = ""
        with httpx.stream(
            "POST",
            f"{server.url}{path}",
            json={**body, "stream": True},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    c = json.loads(line[6:])["choices"][0]
                    text += (c["delta"].get("content") or "") if a["chat"] else c["text"]
        return text

    answered_before = answered_total(wait_until_idle(server))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, asks))

    def params(a):
        return SamplingParams(
            max_new_tokens=a["max_tokens"],
            temperature=a["temperature"] or 0.0,
            seed=a["seed"],
            top_k=a["top_k"] or 0,
            threshold=a["threshold"],
        )

    expected = {}
    for chat in (True, False):
        group = [a for a in asks if a["chat"] == chat]
        for a, text in zip(group, alone(engine, [a["prompt"] for a in group], map(params, group), chat=chat)):
            expected[id(a)] = text
    mismatches = [(a, got, expected[id(a)]) for a, got in zip(asks, answers) if got != expected[id(a)]]
    assert not mismatches, mismatches[:3]
    m = wait_until_idle(server)
    assert m["dllm_requests_running"] == 0 and m["dllm_slots_busy"] == 0
    assert answered_total(m) - answered_before == len(asks)


def chat_body(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def test_metrics_count_the_work_of_each_request_and_no_compilation_while_serving(server, client):
    """Counted from this test's own requests (a difference of two scrapes): it holds in any order."""
    before = wait_until_idle(server)
    answers = [
        client.completions.create(model=MODEL, prompt="sort: 3 1 2"),
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "sort: 9 8"}]),
    ]
    after = wait_until_idle(server)

    def added(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert answered_total(after) - answered_total(before) == len(answers), (before, after)
    for reason in {a.choices[0].finish_reason for a in answers}:
        expected = sum(a.choices[0].finish_reason == reason for a in answers)
        assert added(f'dllm_requests_total{{finish_reason="{reason}"}}') == expected, reason
    assert added("dllm_tokens_generated_total") == sum(a.usage.completion_tokens for a in answers) > 0
    assert added("dllm_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers) > 0
    assert added("dllm_steps_total") == sum(a.model_extra["dllm"]["steps"] for a in answers) > 0
    assert after["dllm_warmup_seconds"] > 0 and after["dllm_slots_total"] == SLOTS
    assert after["dllm_compilations_after_warmup"] == 0, server.log()[-3000:]


def test_sigterm_lets_a_running_stream_finish_then_exits(server):
    """Last test of the module: it stops the server."""
    body = chat_body("sort: 5 3 8 1 9 2", stream=True, max_tokens=SLOW_TOKENS, dllm=SLOW)
    text, done, signalled = "", False, False
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if not signalled and line.startswith("data: "):
                server.terminate()  # once: a second signal makes uvicorn exit at once
                signalled = True
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
    assert done and text.startswith("1 2 3")
    # uvicorn re-raises the signal once it has shut down: the exit status is SIGTERM's
    assert server.proc.wait(60) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)
