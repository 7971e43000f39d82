"""The server's worker and HTTP layer over a fake session (tests/fake_session.py): queueing and
429, cancellation, deadlines, streaming order, request validation, the API key and the
metrics, in this process and without a model. tests/test_serve.py runs the server end to end
on the real engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest

from tests.fake_session import EOS, CharTokenizer, FakeSession, ThreadedServer, answer_ids

pytestmark = pytest.mark.unit

KEY = "test-key-0123456789"
MODEL = "tiny-llada"
SLOTS = 2
MAX_WAITING = 4
GEN = 64
SLOW = {"threshold": 1.5}  # one position per step: the chat answer below lasts 35 steps (0.9 s)
SLOW_TOKENS = 64
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def session():
    return FakeSession(num_slots=SLOTS, gen_length=GEN, max_prompt_len=64, step_seconds=0.025)


@pytest.fixture(scope="module")
def server(session):
    running = ThreadedServer({"flash_cache": session}, max_waiting=MAX_WAITING, api_key=KEY, model=MODEL)
    try:
        yield running
    finally:
        running.stop()


def post(server, path: str, body, *, key: str | None = KEY, raw: bytes | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=HEADERS, timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def wait_until_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["dllm_requests_running"] == 0 and m["dllm_slots_busy"] == 0 and m["dllm_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {m}"
        time.sleep(0.05)


def chat_body(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def events(response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
    ]


def expected_text(prompt_ids: list[int], max_tokens: int = GEN) -> str:
    ids = answer_ids(prompt_ids, max_tokens)
    return CharTokenizer().decode(ids[: ids.index(EOS)] if EOS in ids else ids)


def test_stream_and_answer_are_the_sessions_answer_in_order(server):
    """The canvas stream reports each step once, in order, every position once; the streamed
    text is the stable prefix of the commits (pairs come swapped) and equals the answer."""
    prompt = "sort: 7 2 9"
    want = expected_text(CharTokenizer().encode(prompt))
    answer = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == want
    body = {"model": MODEL, "prompt": prompt, "stream": True, "dllm": {"canvas": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r)
    canvas = [c["dllm"] for c in chunks if "dllm" in c]
    assert [c["step"] for c in canvas] == list(range(1, len(canvas) + 1))
    positions = [p["position"] for c in canvas for p in c["commits"]]
    assert len(positions) == len(set(positions)), "a position committed twice"
    streamed = [c["choices"][0]["text"] for c in chunks]
    assert "".join(streamed) == want
    # position 0 comes with step 1's pair (1, 0): no text before it, then the prefix grows
    assert streamed[0] == want[:2] and all(len(t) <= 2 for t in streamed)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"


def test_several_prompts_stream_each_choice_in_its_own_order(server):
    prompts = ["abc", "sort: 9 8", "12+3"]
    body = {"model": MODEL, "prompt": prompts, "stream": True, "max_tokens": 8}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
        chunks = events(r)
    texts = ["" for _ in prompts]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [expected_text(CharTokenizer().encode(p), 8) for p in prompts]
    plain = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 8}).json()
    assert [c["text"] for c in sorted(plain["choices"], key=lambda c: c["index"])] == texts


def test_a_stop_string_ends_the_answer_and_frees_the_slot(server, session):
    prompt = "xyz-abc"  # answer: "cba-zyx"
    before = metrics(server)["dllm_requests_cancelled_total"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "stop": ["-"]})
    assert r.status_code == 200 and r.json()["choices"][0] == {
        "index": 0,
        "text": "cba",
        "finish_reason": "stop",
        "logprobs": None,
    }
    # the server ended it at the stop string, before the session finished it
    assert wait_until_idle(server)["dllm_requests_cancelled_total"] == before + 1


def test_cancelled_stream_frees_its_slot_for_the_next_request(server, session):
    """Both slots busy with requests of 16 steps; one client leaves after step 1: its slot is
    freed and serves a new request while the other one still decodes."""
    before = metrics(server)["dllm_requests_cancelled_total"]
    slow = chat_body("sort: 5 3 8 1 9 2", max_tokens=SLOW_TOKENS, dllm=SLOW)
    with concurrent.futures.ThreadPoolExecutor(SLOTS - 1) as pool:
        other = pool.submit(post, server, "/v1/chat/completions", slow)
        body = {**slow, "stream": True, "dllm": {**SLOW, "canvas": True}}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=HEADERS, timeout=60) as r:
            lines = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
            first = next(c for c in lines if "dllm" in c)
            assert first["dllm"]["step"] == 1 and first["choices"][0]["finish_reason"] is None
        deadline = time.monotonic() + 30
        while metrics(server)["dllm_requests_cancelled_total"] == before:
            assert time.monotonic() < deadline, "the cancelled request was not aborted"
            time.sleep(0.02)
        quick = post(server, "/v1/completions", {"model": MODEL, "prompt": "4 2", "max_tokens": 4})
        assert quick.status_code == 200 and quick.json()["choices"][0]["text"] == "2 4"
        assert not other.done(), "the new request waited for the other one: the cancelled slot was not freed"
        assert other.result().status_code == 200
    with session.lock:
        assert any(str(a).startswith("chatcmpl-") for a in session.aborted)
    wait_until_idle(server)


def test_deadline_ends_a_request_with_504(server):
    body = {"model": MODEL, "prompt": "sort: 5 3 8", "max_tokens": SLOW_TOKENS, "dllm": {**SLOW, "timeout": 0.1}}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert metrics(server)['dllm_errors_total{kind="deadline"}'] >= 1
    wait_until_idle(server)


def test_full_queue_answers_429_and_serves_the_rest(server):
    async def flood():
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as http:
            body = {"model": MODEL, "prompt": "sort: 4 2", "max_tokens": 8, "dllm": SLOW}
            return await asyncio.gather(*[http.post(f"{server.url}/v1/completions", json=body) for _ in range(12)])

    full = 'dllm_errors_total{kind="queue_full"}'
    before = metrics(server).get(full, 0.0)
    responses = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= MAX_WAITING + SLOTS - 1
    rejected = next(r for r in responses if r.status_code == 429).json()["error"]
    assert rejected["type"] == "rate_limit_error" and str(MAX_WAITING) in rejected["message"]
    assert wait_until_idle(server)[full] - before == codes.count(429)
    want = expected_text(CharTokenizer().encode("sort: 4 2"), 8)
    assert all(r.json()["choices"][0]["text"] == want for r in responses if r.status_code == 200)


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
    models = httpx.get(f"{server.url}/v1/models", headers=HEADERS, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_metrics_count_the_work_of_each_request(server):
    """Counted from this test's own requests (a difference of two scrapes): it holds in any order."""
    before = wait_until_idle(server)
    answers = [
        post(server, "/v1/completions", {"model": MODEL, "prompt": "sort: 3 1 2"}).json(),
        post(server, "/v1/chat/completions", chat_body("sort: 9 8", max_tokens=3)).json(),
    ]
    after = wait_until_idle(server)

    def added(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    reasons = [a["choices"][0]["finish_reason"] for a in answers]
    assert reasons == ["stop", "length"]
    for reason in set(reasons):
        assert added(f'dllm_requests_total{{finish_reason="{reason}"}}') == reasons.count(reason), reason
    assert added("dllm_tokens_generated_total") == sum(a["usage"]["completion_tokens"] for a in answers) > 0
    assert added("dllm_prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers) > 0
    assert added("dllm_steps_total") == sum(a["dllm"]["steps"] for a in answers) > 0
    assert after["dllm_slots_total"] == SLOTS


def test_the_startup_heap_is_frozen_while_serving_and_collections_are_timed(server):
    """The lifespan froze what start-up left (gc.freeze) and times each collection for /metrics."""
    import gc

    assert gc.get_freeze_count() > 0
    gc.collect()
    assert metrics(server)['dllm_gc_pause_seconds_count{generation="2"}'] >= 1


@pytest.mark.parametrize("canvas", [None, {"step": 3, "gen_length": 8, "commits": [], "eos_position": None}])
def test_a_pieces_event_is_the_sse_of_its_whole_chunk(canvas):
    """The chunk's head is encoded once per response; each event is the same bytes as the
    whole chunk encoded at once (non-ASCII text escaped alike, "dllm" last)."""
    from dllm_jax.serve.app import _chunk_prefix, _piece_sse, _sse

    head = {"id": "cmpl-0", "created": 1, "model": 'a "model"'}
    choice = {"index": 2, "text": 'é\n\u2028"', "finish_reason": None, "logprobs": None}
    whole = {**head, "object": "text_completion", "choices": [choice]}
    if canvas is not None:
        whole["dllm"] = canvas
    assert _piece_sse(_chunk_prefix(head, "text_completion"), choice, canvas) == _sse(whole)


def test_streams_of_one_step_each_get_all_their_chunks_in_order():
    """Every slot busy, so each step's events reach all streams at once: each stream still has
    its steps in order, its whole answer, its finish reason on its last piece, then usage and
    [DONE]."""
    slots, gen = 8, 16
    session = FakeSession(num_slots=slots, gen_length=gen, max_prompt_len=gen, step_seconds=0.02)
    running = ThreadedServer({"flash_cache": session}, max_waiting=4 * slots, api_key=None, model=MODEL)
    prompts = [f"{i} abcdefghijk"[: gen - 1] for i in range(2 * slots)]

    async def stream(http: httpx.AsyncClient, prompt: str) -> list[str]:
        body = {"model": MODEL, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
        body["dllm"] = {"canvas": True}
        async with http.stream("POST", "/v1/completions", json=body, timeout=60) as r:
            return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

    async def load() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=running.url, limits=httpx.Limits(max_connections=len(prompts))) as http:
            return await asyncio.gather(*(stream(http, p) for p in prompts))

    try:
        streams = asyncio.run(load())
    finally:
        running.stop()
    for prompt, lines in zip(prompts, streams, strict=True):
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        *pieces, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(prompt)
        steps = [c["dllm"]["step"] for c in pieces if "dllm" in c]
        # one chunk per step: the last step's chunk also ends the answer (no chunk of its own)
        assert steps == list(range(1, gen // 2 + 1)) and len(pieces) == len(steps)
        assert "".join(c["choices"][0]["text"] for c in pieces) == expected_text(CharTokenizer().encode(prompt))
        reasons = [c["choices"][0]["finish_reason"] for c in pieces]
        assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}


class _Handle:
    """The parts of a RequestHandle a ChoiceRun reads, handing out fixed events."""

    def __init__(self, events):
        self.events = list(events)
        self.work = type("Work", (), {"prompt_ids": [1, 2]})()
        self.arrived = time.monotonic()

    def expire_waits_at(self, when):
        pass

    async def next_event(self):
        return self.events.pop(0)

    def close(self):
        pass


@pytest.mark.parametrize("engine_text", [True, False])
def test_the_last_step_is_decoded_once_with_the_engines_text_or_without_it(engine_text):
    """Random-order commits leave the stable prefix short until the last step. When the engine's
    result brings the answer's text, that step's chunk takes the text from it and decodes
    nothing (the whole answer decoded again, on the event loop, for every stream ending
    together); without it, the stream decodes it. The answer is the same."""
    from dllm_jax.engine.results import GenerationResult
    from dllm_jax.engine.session import StepCommits
    from dllm_jax.serve.metrics import ServerMetrics
    from dllm_jax.serve.responses import ChoiceRun
    from dllm_jax.serve.stable_text import StableText
    from dllm_jax.serve.worker import Event

    tokenizer, decoded = CharTokenizer(), []

    def decode(ids):
        decoded.append(len(ids))
        return tokenizer.decode(ids)

    answer = tokenizer.encode("hello")
    order = [4, 2, 3, 1, 0]  # position 0 last: no stable text before the end
    events = [
        Event(commits=(StepCommits(i, (p,), (answer[p],), (False,)),), received=float(i))
        for i, p in enumerate(order[:-1])
    ]
    result = GenerationResult(0, [1, 2], answer, "hello" if engine_text else None, "length", 2, 5, 5, 5, 5, 0, 0, 0.1)
    events.append(Event(commits=(StepCommits(4, (0,), (answer[0],), (False,)),), received=4.0, result=result))
    run = ChoiceRun(
        _Handle(events),
        StableText(decode, len(answer)),
        0,
        token_text=lambda t: tokenizer.decode([t]),
        canvas=True,
        deadline=time.monotonic() + 60,
        metrics=ServerMetrics(),
    )

    async def collect():
        return [piece async for piece, _ in run.pieces()]

    pieces = asyncio.run(collect())
    assert "".join(p.text for p in pieces) == "hello" and pieces[-1].finish_reason == "length"
    assert len(pieces) == len(order) and pieces[-1].canvas["step"] == len(order)  # the last step's chunk ends it
    assert (max(decoded, default=0) == 5) is not engine_text, decoded


def test_streams_ending_at_one_step_send_their_chunks_before_their_answers_are_counted():
    """All slots often end at the same step: each stream's last chunk goes out before the
    counters of the answers that ended with it, so no stream's end waits for the others'
    counting (the counters still come, on the next turn of the event loop)."""
    from dllm_jax.engine.results import GenerationResult
    from dllm_jax.engine.session import StepCommits
    from dllm_jax.serve.metrics import ServerMetrics
    from dllm_jax.serve.responses import ChoiceRun
    from dllm_jax.serve.stable_text import StableText
    from dllm_jax.serve.worker import Event

    tokenizer, log = CharTokenizer(), []
    metrics = ServerMetrics()
    count = metrics.tokens_generated.inc
    metrics.tokens_generated.inc = lambda n: (log.append("counted"), count(n))
    answer = tokenizer.encode("hi")

    def run(index):
        result = GenerationResult(0, [1, 2], answer, "hi", "length", 1, 2, 2, 2, 2, 0, 0, 0.1)
        commits = StepCommits(0, (0, 1), tuple(answer), (False, False))
        return ChoiceRun(
            _Handle([Event(commits=(commits,), received=1.0, result=result)]),
            StableText(tokenizer.decode, len(answer)),
            index,
            token_text=lambda t: tokenizer.decode([t]),
            canvas=False,
            deadline=time.monotonic() + 60,
            metrics=metrics,
        )

    async def stream(r):
        async for piece, _ in r.pieces():
            log.append(f"chunk {piece.index} {piece.text!r} {piece.finish_reason}")

    async def both():
        await asyncio.gather(*(stream(run(i)) for i in range(3)))
        await asyncio.sleep(0)

    asyncio.run(both())
    assert log == [*(f"chunk {i} 'hi' length" for i in range(3)), "counted", "counted", "counted"], log
    assert metrics.tokens_generated._value.get() == 3 * len(answer)
