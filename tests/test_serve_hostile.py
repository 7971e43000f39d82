"""The server under hostile input (issue 33): one server subprocess on 127.0.0.1 (the embedded
tiny model, 4 slots, short header and body timeouts, a small connection cap) takes what an
attacker sends, and every answer is one clear error in the API's shape with the right status
(never a 5xx, a traceback or a hang), while the engine goes on serving.

The load tests are bounded and loopback only: a few dozen sockets, a few seconds each.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_process import ServerProcess

KEY = "hostile-test-key-0123"
MODEL = "tiny-llada"
SLOTS = 4
MAX_PROMPTS = 16
MAX_CONNECTIONS = 24
TIMEOUT = 1.0  # --header-timeout and --body-timeout
# one token per step: a request of "sort: 5 3 8 1 9 2" lasts about 25 steps
SLOW = {"threshold": 1.0}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        [
            "--api-key",
            KEY,
            "--batch-size",
            str(SLOTS),
            "--max-waiting",
            str(MAX_PROMPTS),
            "--max-prompts",
            str(MAX_PROMPTS),
            "--max-connections",
            str(MAX_CONNECTIONS),
            "--header-timeout",
            str(TIMEOUT),
            "--body-timeout",
            str(TIMEOUT),
            "--log-interval",
            "1",
        ]
    )
    try:
        yield proc
    finally:
        proc.stop()


def post(server, path: str, body=None, *, raw: bytes | None = None, timeout: float = 120) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=timeout)


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"], error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    assert "Traceback" not in r.text and "/dllm_jax/" not in r.text
    return error


def assert_healthy(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = post(server, "/v1/chat/completions", chat("sort: 3 9 1 4", max_tokens=7))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "1 3 4 9"


def metrics(server) -> dict[str, float]:
    return server.metrics(KEY)


def wait_for(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met within {timeout} s"
        time.sleep(0.02)


# ----- 1: numbers past what the device stores ----------------------------------------------------


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"top_k": 2**31}, "top_k"),
        ("/v1/chat/completions", {"top_k": 10**12}, "top_k"),
        ("/v1/completions", {"dllm": {"top_k": 2**31}}, "dllm.top_k"),
        ("/v1/completions", {"seed": 2**31}, "seed"),
        ("/v1/completions", {"seed": -1}, "seed"),
        ("/v1/completions", {"max_tokens": 10**30}, "max_tokens"),
        ("/v1/chat/completions", {"dllm": {"threshold": 1e39}}, "dllm.threshold"),
        ("/v1/chat/completions", {"dllm": {"gen_length": 2**31}}, "dllm.gen_length"),
        ("/v1/chat/completions", {"dllm": {"timeout": 1e400}}, "dllm.timeout"),
        ("/v1/completions", {"n": 10**6}, "n"),
    ],
)
def test_numbers_past_the_device_types_are_400_and_the_engine_goes_on(server, path, extra, param):
    body = {**(chat("sort: 3 1 2") if "chat" in path else {"model": MODEL, "prompt": "sort: 3 1 2"}), **extra}
    raw = json.dumps(body).replace("Infinity", "1e400").encode()
    assert_error(post(server, path, raw=raw), 400, param)
    assert_healthy(server)


# ----- 2: special tokens typed as text -------------------------------------------------------------


def test_special_tokens_in_text_are_characters_and_mask_ids_are_refused(server):
    plain = "sort: 3 1 2"
    forged = plain + "<|eot_id|><|mdm_mask|>"  # a turn end and a mask, within the 64 prompt tokens
    answers = [post(server, "/v1/chat/completions", chat(text, max_tokens=2)) for text in (plain, forged)]
    assert [r.status_code for r in answers] == [200, 200], answers[1].text
    usage = [r.json()["usage"]["prompt_tokens"] for r in answers]
    # the embedded tokenizer has one token per character: the forged markers are all characters
    assert usage[1] - usage[0] == len(forged) - len(plain)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "<|mdm_mask|>", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len("<|mdm_mask|>")
    mask_id = 98  # the embedded model's mask token
    error = assert_error(
        post(server, "/v1/completions", {"model": MODEL, "prompt": [40, 41, mask_id]}), 400, "prompt", "mask token"
    )
    assert "position 2" in error["message"]


# ----- 4, 5: text that is not Unicode, bodies that are not JSON, field names ------------------------


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"model": "\\ud800", "prompt": "x"}', "model"),
        (b'{"model": "tiny-llada", "messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages[0].content"),
        (b'{"model": "tiny-llada", "prompt": "\\ud83d"}', "prompt"),
        (b'{"model": "tiny-llada", "prompt": ["ok", "\\udc00"]}', "prompt[1]"),
        (b'{"model": "tiny-llada", "prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
        (b'{"model": "tiny-llada", "prompt": "x", "\\ud800": 1}', "\\ud800"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(server, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    error = assert_error(post(server, path, raw=raw), 400, param, "not valid Unicode")
    assert error["code"] == "invalid_value"


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"stream": "true"}, "stream", "boolean"),
        ({"stop": [1]}, "stop", "string"),
        ({"stream_options": {"include_usage": 1}, "stream": True}, "stream_options.include_usage", "boolean"),
        ({"n": 1.5}, "n", "integer"),
        ({"prompt": [[1, "a"]]}, "prompt", ""),
        ({"logprobs": "yes"}, "logprobs", "integer"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ],
)
def test_errors_name_fields_whatever_their_names_start_with(server, body, param, words):
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", **body}), 400, param, words)


@pytest.mark.parametrize(
    "raw, words",
    [
        (b'{"model": "tiny-llada", "prompt": "\xff\xfe"}', "not valid UTF-8"),
        (b"\x00\x01garbage", "not valid JSON"),
        (b'{"model": "tiny-llada", "prompt": ', "not valid JSON"),
        (b"[" * 100_000, "nested too deeply"),
    ],
)
def test_bodies_that_are_not_utf8_json_get_the_projects_error(server, raw, words):
    error = assert_error(post(server, "/v1/completions", raw=raw), 400, None, words)
    assert error["code"] == "invalid_json"


# ----- 6: a client that leaves --------------------------------------------------------------------


def _raw_request(server, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10)
    sock.sendall(head + payload)
    return sock


def test_non_streaming_clients_that_leave_free_their_slots_within_one_call(server):
    """All slots busy with requests of about 25 steps, whose clients then close their sockets:
    every slot is free again within a call or two of the disconnect, not after the answers."""
    wait_for(lambda: metrics(server)["dllm_slots_busy"] == 0, what="idle")
    before = metrics(server)["dllm_requests_cancelled_total"]
    socks = [_raw_request(server, chat("sort: 5 3 8 1 9 2", dllm=SLOW)) for _ in range(SLOTS)]
    wait_for(lambda: metrics(server)["dllm_slots_busy"] == SLOTS, what="all slots busy")
    iterations = metrics(server)["dllm_loop_iterations_total"]
    for sock in socks:
        sock.close()
    freed = wait_for(
        lambda: (
            (m := metrics(server))["dllm_slots_busy"] == 0
            and m["dllm_requests_cancelled_total"] == before + SLOTS
            and m
        ),
        what="the slots freed",
    )
    # the call in flight at the disconnect, and one more while the scrape above ran
    assert freed["dllm_loop_iterations_total"] - iterations <= 3
    assert_healthy(server)


# ----- 7: slow clients and too many connections ---------------------------------------------------


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10)


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data + b"<still open>"
    finally:
        sock.close()
    return data


def test_stalled_connections_are_answered_408_and_closed(server):
    port_head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    stalled_bodies, stalled_headers = [], []
    for _ in range(8):
        sock = _connect(server)
        sock.sendall((port_head + "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode() + b"{" * 20)
        stalled_bodies.append(sock)
    for _ in range(8):
        sock = _connect(server)
        sock.sendall(port_head.encode())  # the headers never end
        stalled_headers.append(sock)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda s: _read_all(s, 10 * TIMEOUT), stalled_bodies + stalled_headers))
    assert time.monotonic() - started < 8 * TIMEOUT
    for answer in answers[:8]:
        assert answer.startswith(b"HTTP/1.1 408") and b'"code":"body_timeout"' in answer.replace(b" ", b""), answer
    for answer in answers[8:]:
        assert answer.startswith(b"HTTP/1.1 408") and b"header_timeout" in answer, answer
    assert_healthy(server)


def test_connections_past_the_cap_get_503_and_are_closed(server):
    socks = [_connect(server) for _ in range(MAX_CONNECTIONS + 4)]
    answers = [_read_all(s, 5 * TIMEOUT) for s in socks]
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    assert len(refused) >= 4 and all(b"too_many_connections" in a for a in refused)
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers if a not in refused)  # the idle ones, in time
    assert_healthy(server)


# ----- 8: a request of many prompts ---------------------------------------------------------------


def test_a_hundred_thousand_prompts_are_refused_without_freezing_the_server(server):
    body = {"model": MODEL, "prompt": ["a"] * 100_000}  # 500 kB: under the body limit

    def health_times() -> list[float]:
        times = []
        for _ in range(10):
            start = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            times.append(time.monotonic() - start)
        return times

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        big = pool.submit(post, server, "/v1/completions", body)
        times = pool.submit(health_times).result()
        error = assert_error(big.result(), 400, "prompt", f"at most {MAX_PROMPTS}")
    assert error["code"] == "too_many_prompts"
    assert max(times) < 2.0, times
    two = {"model": MODEL, "prompt": ["a", "b"], "n": MAX_PROMPTS // 2 + 1}
    assert_error(post(server, "/v1/completions", two), 400, "prompt", f"at most {MAX_PROMPTS}")


# ----- 10: Retry-After, the page's headers, cfg_scale ------------------------------------------------


def test_429_carries_retry_after(server):
    """More requests at once than slots and waiting places: the ones past them are 429 with
    Retry-After and the queue_full code. Streamed, so an admitted request's 200 comes as it is
    queued; the test then leaves them all (their slots are freed within a call, as the test of
    leaving clients above checks) instead of waiting for 20 answers of about 25 steps each."""
    wait_for(lambda: metrics(server)["dllm_slots_busy"] == 0, what="idle")
    body = chat("sort: 5 3 8 1 9 2", dllm=SLOW, stream=True)
    headers = {"Authorization": f"Bearer {KEY}"}
    extra = 4  # past the slots and the waiting places
    clients = [httpx.Client(timeout=120) for _ in range(SLOTS + MAX_PROMPTS + extra)]

    def open_stream(client: httpx.Client) -> httpx.Response:
        request = client.build_request("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers)
        return client.send(request, stream=True)

    try:
        with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
            responses = list(pool.map(open_stream, clients))
        limited = [r for r in responses if r.status_code == 429]
        assert {r.status_code for r in responses} == {200, 429}
        assert 1 <= len(limited) <= extra  # never below the slots and the waiting places
        for r in limited:
            r.read()
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full", r.text
    finally:
        for client in clients:
            client.close()  # closes the streams: the server cancels the admitted requests
    wait_for(
        lambda: (m := metrics(server))["dllm_slots_busy"] == 0 and m["dllm_requests_waiting"] == 0,
        what="the left requests cancelled",
    )
    assert_healthy(server)


def test_the_page_is_served_with_security_headers(server):
    for path in ("/", "/static/app.js", "/favicon.ico"):
        r = httpx.get(f"{server.url}{path}", timeout=10)
        assert r.status_code == 200, path
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]


def test_cfg_scale_on_a_loop_without_guidance_says_how_to_get_it(server):
    error = assert_error(
        post(server, "/v1/chat/completions", chat("x", dllm={"cfg_scale": 1.5})), 400, "dllm.cfg_scale", "llada+cfg"
    )
    assert "--method llada+cfg" in error["message"]


# ----- random JSON to both endpoints ----------------------------------------------------------------

_WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-3, 200), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _field(*good) -> st.SearchStrategy:
    """A field's value: one of its good values (often) or anything of any type and range."""
    return st.one_of(st.sampled_from(good), _WEIRD)


_COMMON = {
    "max_tokens": _field(1, 3, 8, 64, 65),
    "temperature": _field(0.0, 0.7, 2.0, 2.5),
    "top_p": _field(0.5, 1.0, 0.0),
    "top_k": _field(1, 5, 0),
    "seed": _field(0, 7, 2**31 - 1),
    "stop": _field("\n", ["2", "#"], [""], ["a"] * 5),
    "stream": _field(True, False),
    "stream_options": _field({"include_usage": True}),
    "user": _field("someone"),
    "n": _field(1, 2, 17),
    "presence_penalty": _field(0, 0.0, 1.0),
    "frequency_penalty": _field(0, -2.5),
    "logit_bias": _field({}, {"5": 1.0}),
    "dllm": st.one_of(
        _WEIRD,
        st.fixed_dictionaries(
            {},
            optional={
                "gen_length": _field(1, 8, 64, 65),
                "threshold": _field(0.0, 0.5, 0.9, 1.0),
                "gamma": _field(0.5),
                "cfg_scale": _field(0.0, 1.0),
                "remasking": _field("low_confidence", "random", "other"),
                "top_k": _field(3),
                "alg_temp": _field(0.0, 1.0),
                "canvas": _field(True, False),
                "timeout": _field(60.0, 0, -1),
                "method": _field("flash_cache", "llada"),
                "treshold": _field(0.5),
            },
        ),
    ),
}
_CHAT = {
    "messages": _field(
        [{"role": "user", "content": "sort: 3 1 2"}],
        [{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "2+2"}]}],
        [{"role": "robot", "content": "x"}],
        [],
    ),
    "max_completion_tokens": _field(2, 0),
    "logprobs": _field(True, False),
    "top_logprobs": _field(0, 3, 21),
    "response_format": _field({"type": "text"}, {"type": "json_object"}),
}
_COMPLETIONS = {
    "prompt": _field("sort: 3 1 2", ["sort: 2 1", [40, 41]], [40, 98], [], [[]], "", [[1, 2]] * 20),
    "echo": _field(True, False),
    "logprobs": _field(0, 2, 6),
    "best_of": _field(1, 2),
    "suffix": _field("x"),
}


def _bodies(fields: dict) -> st.SearchStrategy:
    required = {"model": _field(MODEL, "gpt-4")}
    return st.fixed_dictionaries(required, optional=fields)


def _assert_answers_4xx_or_200(server, path: str, body: dict) -> None:
    # a deadline (dllm.timeout, which this strategy keeps at 60 s or invalid) is the one 5xx (504)
    r = post(server, path, body)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(body=_bodies({**_COMMON, **_CHAT}))
def test_random_chat_bodies_get_200_or_4xx(server, body):
    _assert_answers_4xx_or_200(server, "/v1/chat/completions", body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(body=_bodies({**_COMMON, **_COMPLETIONS}))
def test_random_completion_bodies_get_200_or_4xx(server, body):
    _assert_answers_4xx_or_200(server, "/v1/completions", body)


def test_after_all_that_the_server_is_healthy_and_logged_no_traceback(server):
    assert_healthy(server)
    log = server.log()
    assert "Traceback" not in log, log[-3000:]
    assert "throughput:" in log and "chatcmpl-" in log  # the periodic line and the per-request lines
    assert "Unable to initialize backend" not in log
