"""The server's engine thread (dllm_jax.serve.worker) against the fake session
(tests/fake_session.py): no engine, no compilation. What a request may do to the thread: leave
(its slot is freed before the next call), fail inside the session (it fails alone; a failed call
fails its session's requests and the session starts afresh), overflow the queue (429 with
Retry-After)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from dllm_jax.sampling.params import SamplingParams
from dllm_jax.serve.errors import APIError
from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serve.worker import EngineWorker, Event, RequestHandle, Work, deliver_all
from tests.fake_session import FakeSession


def fake(*, steps: int = 5, step_seconds: float = 0.01, slots: int = 2, fail_step: int | None = None):
    """A fake session whose requests commit one position per step and finish after ``steps``."""
    return FakeSession(num_slots=slots, gen_length=steps, step_seconds=step_seconds, per_step=1, fail_step=fail_step)


def _work(request_id: str, method: str = "a", prompt=(1, 2)) -> Work:
    return Work(request_id, method, list(prompt), SamplingParams(), time.monotonic() + 30)


async def _events_until_end(handle, timeout: float = 10.0):
    """The handle's events up to its result or error."""
    events = []
    while True:
        event = await handle.next_event(timeout)
        assert event is not None, "no event in time"
        events.append(event)
        if event.result is not None or event.error is not None:
            return events


def _run(sessions, scenario, **options):
    worker = EngineWorker(sessions, ServerMetrics(), **options)
    worker.start()
    try:
        return asyncio.run(scenario(worker))
    finally:
        worker.stop()


def test_a_released_request_is_aborted_before_the_next_device_call():
    session = fake(steps=1000, step_seconds=0.02)

    async def scenario(worker):
        handle = worker.submit(_work("r1"))
        assert (await handle.next_event(10)).commits  # it is in a slot, decoding
        mark = len(session.calls)
        handle.close()  # the client went away
        deadline = time.monotonic() + 10
        while ("abort", "r1") not in session.calls[mark:]:
            assert time.monotonic() < deadline, "the request was never aborted"
            await asyncio.sleep(0.005)
        return session.calls[mark:]

    after = _run({"a": session}, scenario)
    steps_before_abort = [c for c in after[: after.index(("abort", "r1"))] if c[0] == "step"]
    assert len(steps_before_abort) <= 1, f"calls after the release: {after[:5]}"  # at most the one in flight


def test_a_failing_call_fails_its_sessions_requests_and_the_thread_goes_on():
    failing, other = fake(steps=50, fail_step=3), fake(steps=4)

    async def scenario(worker):
        doomed = [worker.submit(_work(f"a{i}")) for i in range(2)]
        bystander = worker.submit(_work("b0", method="b"))
        for handle in doomed:
            error = (await _events_until_end(handle))[-1].error
            assert error is not None and error.status == 500 and error.code == "internal_error"
        assert (await _events_until_end(bystander))[-1].result is not None
        again = worker.submit(_work("a-after"))  # the session starts afresh
        assert (await _events_until_end(again))[-1].result is not None
        assert worker.failure is None
        return worker

    worker = _run({"a": failing, "b": other}, scenario)
    assert ("reset", None) in failing.calls and ("reset", None) not in other.calls
    assert worker._in_engine == {}


def test_a_request_the_session_fails_to_add_fails_alone():
    session = fake(steps=3)
    session.fail_add.add((9, 9))

    async def scenario(worker):
        bad = worker.submit(_work("bad", prompt=(9, 9)))
        refused = worker.submit(_work("refused", prompt=()))
        good = worker.submit(_work("good"))
        assert (await _events_until_end(bad))[-1].error.status == 500
        assert (await _events_until_end(refused))[-1].error.status == 400
        assert (await _events_until_end(good))[-1].result is not None
        assert worker.failure is None

    _run({"a": session}, scenario)


def test_a_full_queue_answers_429_with_retry_after():
    session = fake(steps=1000, slots=1)

    async def scenario(worker):
        held = [worker.submit(_work(f"r{i}")) for i in range(3)]  # 1 slot + 2 waiting
        with pytest.raises(APIError) as e:
            worker.submit(_work("one-too-many"))
        for handle in held:
            handle.close()
        return e.value

    error = _run({"a": session}, scenario, max_waiting=2)
    assert error.status == 429 and error.headers == {"Retry-After": "1"}
    assert error.response().headers["retry-after"] == "1"


def test_the_thread_logs_its_throughput(caplog):
    session = fake(steps=3)

    async def scenario(worker):
        for i in range(3):
            await _events_until_end(worker.submit(_work(f"r{i}")))
        await asyncio.sleep(0.2)

    with caplog.at_level(logging.INFO, logger="dllm_jax.serve"):
        _run({"a": session}, scenario, log_interval=0.05)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("throughput:")]
    assert lines and "requests/s" in lines[0] and "tokens/s" in lines[0] and "slots busy" in lines[0]


def test_a_handle_gives_its_events_in_order_and_none_after_its_timeout():
    """Events wait in the handle until read (a wait cancelled or timed out loses none)."""

    async def scenario():
        handle = RequestHandle(None, _work("r1"), asyncio.get_running_loop())
        assert await handle.next_event(0.01) is None
        waiting = asyncio.ensure_future(handle.next_event(10))
        await asyncio.sleep(0)
        waiting.cancel()
        sent = [Event(received=float(i)) for i in range(3)]
        threading.Thread(target=deliver_all, args=([(handle, e) for e in sent],)).start()
        got = [await handle.next_event(10) for _ in sent]
        assert [e.received for e in got] == [0.0, 1.0, 2.0]
        assert await handle.next_event(0) is None

    asyncio.run(scenario())
