"""The OpenAI-compatible server end to end: one server subprocess on 127.0.0.1 (embedded tiny
model, 8 slots, an API key, a small waiting queue) serves every test of this file; the last
test stops it with SIGTERM."""

from __future__ import annotations

import asyncio
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
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.sampling.params import SamplingParams
from tests.server_process import ServerProcess

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
def engine():
    return Engine.from_pretrained(str(tiny_model_path()), dtype="float32")


def alone(engine: Engine, prompts, params=None, *, chat: bool) -> list[str]:
    return [r.text for r in alone_results(engine, prompts, params, chat=chat)]


def alone_results(engine: Engine, prompts, params=None, *, chat: bool):
    """Each prompt decoded alone (one slot) with its SamplingParams, with the server's method,
    lengths and prompt bucket.

    The server compiles one loop for prompts up to its limit (64 tokens); a loop compiled for a
    shorter bucket has a shorter cache, whose attention sums round differently, and that flips
    threshold decisions of uncertain answers. A filler prompt of the limit's length puts these
    prompts in the server's bucket.
    """
    params = list(params) if params is not None else [SamplingParams()] * len(prompts)
    filler = [0] * (engine.config.max_sequence_length - GEN)
    ids = engine.encode(prompts, chat)
    decode = DecodeConfig(method="flash_cache", gen_length=GEN, batch_size=1)
    out = engine.generate(ids + [filler], params + [SamplingParams(max_new_tokens=1)], decode=decode)
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


def test_canvas_stream_carries_each_steps_commits(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "(12+3)*2-5"}],
        "stream": True,
        "dllm": {"canvas": True},
    }
    chunks = []
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    canvas = [c["dllm"] for c in chunks if "dllm" in c]
    assert len(canvas) >= 2 and all(c["gen_length"] == GEN for c in canvas)
    assert [c["step"] for c in canvas] == sorted({c["step"] for c in canvas})
    positions = [p["position"] for c in canvas for p in c["commits"]]
    assert len(positions) == len(set(positions)), "a position committed twice"
    tokens = {p["position"]: p["token_id"] for c in canvas for p in c["commits"]}
    eos = canvas[-1]["eos_position"]
    assert eos is not None and all(p in tokens for p in range(eos)), "the answer before EOS was not all committed"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "".join(
        p["text"]
        for p in sorted((p for c in canvas for p in c["commits"]), key=lambda p: p["position"])
        if p["position"] < eos
    )


def test_64_requests_from_16_clients_each_answered_once_as_alone(server, engine):
    """Mixed lengths and parameters in one batch; each answer is the one of decoding it alone."""
    problems = held_out_problems(64, seed=11)
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


def test_cancelled_stream_frees_its_slot_for_the_next_request(server):
    """All 8 slots busy with requests of 16 steps; one client leaves after step 1: its slot is
    freed at the next loop call and serves a new request while the other 7 still decode."""
    before = server.metrics(KEY)["dllm_requests_cancelled_total"]
    slow = chat_body("sort: 5 3 8 1 9 2", max_tokens=SLOW_TOKENS, dllm=SLOW)
    with concurrent.futures.ThreadPoolExecutor(SLOTS - 1) as pool:
        others = [pool.submit(post, server, "/v1/chat/completions", slow) for _ in range(SLOTS - 1)]
        # the canvas stream sends a chunk every step: the first one comes after step 1 of 16
        body = {**slow, "stream": True, "dllm": {**SLOW, "canvas": True}}
        with httpx.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        ) as r:
            lines = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
            first = next(c for c in lines if "dllm" in c)
            assert first["dllm"]["step"] == 1 and first["choices"][0]["finish_reason"] is None
        deadline = time.monotonic() + 30
        while server.metrics(KEY)["dllm_requests_cancelled_total"] == before:
            assert time.monotonic() < deadline, "the cancelled request was not aborted"
            time.sleep(0.05)
        quick = post(server, "/v1/chat/completions", chat_body("sort: 4 2 7 1"))
        still_running = sum(not f.done() for f in others)
        assert quick.status_code == 200 and quick.json()["choices"][0]["message"]["content"].startswith("1 2 4 7")
        assert still_running > 0, "the new request waited for the others: the cancelled slot was not freed"
        assert all(f.result().status_code == 200 for f in others)
    wait_until_idle(server)


def test_deadline_ends_a_request_with_504(server):
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "sort: 5 3 8 1 9 2", "max_tokens": SLOW_TOKENS, "dllm": {**SLOW, "timeout": 0.2}},
    )
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    wait_until_idle(server)


def test_full_queue_answers_429_and_serves_the_rest(server):
    async def flood():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
            body = {"model": MODEL, "prompt": "sort: 4 2", "max_tokens": 8, "dllm": SLOW}
            return await asyncio.gather(*[http.post(f"{server.url}/v1/completions", json=body) for _ in range(30)])

    full = 'dllm_errors_total{kind="queue_full"}'
    before = server.metrics(KEY).get(full, 0.0)
    responses = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= MAX_WAITING
    rejected = next(r for r in responses if r.status_code == 429).json()["error"]
    assert rejected["type"] == "rate_limit_error" and str(MAX_WAITING) in rejected["message"]
    assert wait_until_idle(server)[full] - before == codes.count(429)


@pytest.mark.parametrize(
    "path, body, raw, status, param, words",
    [
        ("/v1/completions", None, b'{"model": "tiny-llada", "prompt": ', 400, None, "not valid JSON"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, None, 400, "temperature", "number"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2.5}, None, 400, "max_tokens", "integer"),
        ("/v1/completions", {"model": MODEL}, None, 400, "prompt", "missing"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400, "messages", "at least 1"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
            None,
            400,
            "messages[0].role",
            "'user'",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "dllm": {"treshold": 0.5}},
            None,
            400,
            "dllm.treshold",
            "unrecognized",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "dllm": {"gamma": 3}}, None, 400, "dllm.gamma", "1"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "dllm": {"method": "ar"}},
            None,
            400,
            "dllm.method",
            "flash_cache",
        ),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, None, 404, "model", "tiny-llada"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 100}, None, 400, "prompt", "at most 64 prompt tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 65}, None, 400, "max_tokens", "(64)"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 999]}, None, 400, "prompt", "outside [0, 128)"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * (2 << 20)}, None, 413, None, "limit of 1048576 bytes"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_problem(server, path, body, raw, status, param, words):
    r = post(server, path, body, raw=raw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert "Traceback" not in r.text and "/dllm_jax/" not in r.text


def test_api_key_is_required_everywhere_but_health(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    for key in (None, "wrong-key"):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            r = httpx.request(method, f"{server.url}{path}", headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (key, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    models = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]


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
