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
from dllm_jax.serve import worker as worker_module
from dllm_jax.serve.errors import APIError
from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serve.worker import EngineWorker, Event, RequestHandle, Work, deliver_all
from tests.fake_session import FakeSession

pytestmark = pytest.mark.unit  # in process: no compiled decode loop, no process


def fake(*, steps: int = 5, step_seconds: float = 0.01, slots: int = 2, fail_step: int | None = None):
    """A fake session whose requests commit one position per step and finish after ``steps``."""
    return FakeSession(num_slots=slots, gen_length=steps, step_seconds=step_seconds, per_step=1, fail_step=fail_step)


def _work(request_id: str, method: str = "a", prompt=(1, 2)) -> Work:
    return Work(request_id, method, list(prompt), SamplingParams(), time.monotonic() + 30)


async def _next_or_none(handle, timeout: float):
    """The handle's next event, or None after `timeout` seconds without one."""
    try:
        return await asyncio.wait_for(handle.next_event(), timeout)
    except TimeoutError:
        return None


async def _events_until_end(handle, timeout: float = 10.0):
    """The handle's events up to its result or error."""
    events = []
    while True:
        event = await _next_or_none(handle, timeout)
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
        assert (await _next_or_none(handle, 10)).commits  # it is in a slot, decoding
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


def test_a_handle_gives_its_events_in_order_and_a_cancelled_wait_loses_none():
    """Events wait in the handle until read (a wait cancelled or timed out loses none)."""

    async def scenario():
        handle = RequestHandle(None, _work("r1"), asyncio.get_running_loop())
        assert await _next_or_none(handle, 0.01) is None
        waiting = asyncio.ensure_future(handle.next_event())
        await asyncio.sleep(0)
        waiting.cancel()
        sent = [Event(received=float(i)) for i in range(3)]
        threading.Thread(target=deliver_all, args=([(handle, e) for e in sent],)).start()
        got = [await _next_or_none(handle, 10) for _ in sent]
        assert [e.received for e in got] == [0.0, 1.0, 2.0]
        assert await _next_or_none(handle, 0.01) is None

    asyncio.run(scenario())


def test_a_handles_expiry_ends_its_wait_after_the_events_before_it_until_it_is_closed():
    """expire_waits_at is the stream's one bound on its waits: the events delivered before it are
    read first, then next_event answers None; closing the handle disarms it."""

    class Worker:
        def release(self, handle):
            pass

    async def scenario():
        loop = asyncio.get_running_loop()
        handle = RequestHandle(Worker(), _work("r1"), loop)
        handle.expire_waits_at(time.monotonic() + 0.05)
        threading.Thread(target=deliver_all, args=([(handle, Event(received=1.0))],)).start()
        assert (await asyncio.wait_for(handle.next_event(), 5)).received == 1.0
        started = time.monotonic()
        assert await asyncio.wait_for(handle.next_event(), 5) is None
        assert time.monotonic() - started < 1.0
        closed = RequestHandle(Worker(), _work("r2"), loop)
        closed.expire_waits_at(time.monotonic() + 0.01)
        closed.close()
        await asyncio.sleep(0.05)
        assert closed._events.empty()  # no None queued: the timer was cancelled

    asyncio.run(scenario())


def test_a_steps_flag_is_set_once_the_requests_it_woke_have_run():
    """deliver_all's flag for an event loop is set after every request its events woke has run up
    to its next wait (a stream: through sending its chunk), so the engine thread can leave the
    interpreter lock to the event loop until then."""
    ran, seen = [], []

    class Flag(threading.Event):
        def set(self):
            seen.append(list(ran))  # what had run when the flag was set
            super().set()

    async def scenario():
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(None, _work(f"r{i}"), loop) for i in range(3)]

        async def stream(handle):
            await handle.next_event()
            ran.append(handle.request_id)
            await asyncio.sleep(0)  # a later part of the stream: the flag does not wait for it
            ran.append(f"{handle.request_id} later")

        tasks = [asyncio.ensure_future(stream(h)) for h in handles]
        await asyncio.sleep(0)  # every stream waits for its event
        flag = Flag()
        worker_module._put_all(loop, [(h, Event(received=1.0)) for h in handles], flag)
        assert not flag.is_set()
        while not flag.is_set():
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert seen == [["r0", "r1", "r2"]]
        # deliver_all, from another thread: one flag for the one loop, set once its streams ran
        more = [RequestHandle(None, _work("r3"), loop)]
        waiting = asyncio.ensure_future(more[0].next_event())
        flags = []
        sender = threading.Thread(target=lambda: flags.extend(deliver_all([(more[0], Event(received=2.0))])))
        sender.start()
        assert (await waiting).received == 2.0
        sender.join()
        assert len(flags) == 1
        while not flags[0].is_set():
            await asyncio.sleep(0)

    async def bounded():  # a flag never set or an event never delivered fails instead of hanging
        await asyncio.wait_for(scenario(), 30)

    asyncio.run(bounded())


def test_the_engine_thread_waits_for_the_streams_at_most_its_bound():
    """_let_streams_run returns when the flags are set, and otherwise after at most the worker's
    streams_first_max_seconds or STREAMS_FIRST_SHARE of the call's time (a busy or stopped event
    loop cannot stall the device)."""
    worker = EngineWorker({"a": fake()}, ServerMetrics())
    never = threading.Event()
    start = time.perf_counter()
    worker._let_streams_run([never], call_seconds=0.008)  # a quarter of an 8 ms call
    assert 0.0015 <= time.perf_counter() - start < 0.05
    start = time.perf_counter()
    worker._let_streams_run([never], call_seconds=10.0)  # capped at 5 ms
    assert 0.0045 <= time.perf_counter() - start < 0.1
    done = threading.Event()
    done.set()
    start = time.perf_counter()
    worker._let_streams_run([done, never], call_seconds=0.0)
    assert time.perf_counter() - start < 0.05
    worker.streams_first_max_seconds = 0.0  # no wait, however long the call
    start = time.perf_counter()
    worker._let_streams_run([never], call_seconds=10.0)
    assert time.perf_counter() - start < 0.0015
    unbound = EngineWorker({"a": fake()}, ServerMetrics(), streams_first_max_seconds=1.0)
    start = time.perf_counter()
    unbound._let_streams_run([never], call_seconds=0.08)  # the share's 20 ms, not 5
    assert 0.019 <= time.perf_counter() - start < 0.5
