"""The engine thread: the one owner of the device, stepping the generation sessions.

HTTP handlers (on the asyncio loop) submit work and read its events; the thread, between
short calls of each session's compiled loop, aborts released requests (a client gone: before
the next call), adds arrived requests (in arrival order), aborts expired ones, and hands every
request its step's commits and, at the end, its final answer. Waiting requests are bounded
(`max_waiting`): past it, submit raises a 429. Nothing here blocks the event loop: events
cross threads with call_soon_threadsafe.

One request cannot end the thread: a session that refuses or fails a request fails that
request alone; a session call that raises fails the requests of that session (500, logged)
and the session starts afresh. Every `log_interval` seconds with work done, the thread logs
the throughput.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from dllm_jax.common.errors import GenerationError
from dllm_jax.engine.compiled_loop import CompiledLoop
from dllm_jax.engine.results import GenerationResult
from dllm_jax.engine.session import RequestUpdate, StepCommits
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.params import SamplingParams
from dllm_jax.serve.errors import APIError
from dllm_jax.serve.metrics import ServerMetrics

log = logging.getLogger("dllm_jax.serve")

# How long the engine thread lets the event loop send a step's chunks before it prepares the next
# loop call (EngineWorker._let_streams_run): at most EngineWorker.streams_first_max_seconds (this
# by default), and at most this share of the session call's time, so that the next call is
# still queued before the device finishes the one in flight.
STREAMS_FIRST_MAX_SECONDS = 0.005
STREAMS_FIRST_SHARE = 0.25


class Session(Protocol):
    """What the worker needs of a generation session (dllm_jax.engine.session.GenerationSession)."""

    compiled: CompiledLoop

    @property
    def decode_config(self) -> DecodeConfig: ...
    def check(self, prompt_ids: list[int], sampling: SamplingParams, where: str) -> object: ...
    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None: ...
    def abort(self, request_id: str) -> bool: ...
    def step(self, max_iterations: int) -> list[RequestUpdate]: ...
    def reset(self) -> None: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Work:
    """One generation request as the worker takes it."""

    request_id: str
    method: str
    prompt_ids: list[int]
    sampling: SamplingParams
    deadline: float  # time.monotonic() after which the request is abandoned


@dataclasses.dataclass(frozen=True)
class Event:
    """An event of one request: commits (with the time the host received them), the engine's
    result once it finished, or an error."""

    commits: tuple[StepCommits, ...] = ()
    received: float = 0.0
    result: GenerationResult | None = None
    error: APIError | None = None


class RequestHandle:
    """The asyncio side of one submitted request."""

    def __init__(self, worker: EngineWorker, work: Work, loop: asyncio.AbstractEventLoop):
        self.worker = worker
        self.work = work
        self.arrived = time.monotonic()
        self.started: float | None = None
        self._loop = loop
        self._events: asyncio.Queue[Event | None] = asyncio.Queue()  # None: the handler's wait expired
        self._expiry: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def request_id(self) -> str:
        return self.work.request_id

    def deliver(self, event: Event) -> None:
        """Called from the engine thread (a closed event loop, at shutdown, drops it)."""
        deliver_all([(self, event)])

    def expire_waits_at(self, when: float) -> None:
        """Ends the handler's wait at `when` (time.monotonic()): from then on, once the events
        before it are taken, next_event answers None. One timer for the request's whole life,
        where a timeout per next_event would arm and cancel one per step (called on the loop)."""
        if self._expiry is None:
            self._expiry = self._loop.call_later(max(when - time.monotonic(), 0.0), self._events.put_nowait, None)

    async def next_event(self) -> Event | None:
        """The next event, or None once expire_waits_at's time has passed (its bound on the
        request's waits). An event already queued is taken at once; otherwise the wait is the
        queue's own future (one event-loop hop per event)."""
        if not self._events.empty():
            return self._events.get_nowait()
        return await self._events.get()

    def close(self) -> None:
        """The handler is done with the request: abort it if the engine still holds it."""
        if self._expiry is not None:
            self._expiry.cancel()
        if not self.closed:
            self.closed = True
            self.worker.release(self)


def deliver_all(deliveries: list[tuple[RequestHandle, Event]]) -> list[threading.Event]:
    """Hands events to their requests from the engine thread: one wake-up of each event loop
    for all of them (a loop step's events for every slot), in order. Returns, per event loop, a
    flag set once that loop has run every request the events woke (each up to its next wait:
    a stream, through sending its chunk)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, Event]]] = {}
    for handle, event in deliveries:
        by_loop.setdefault(handle._loop, []).append((handle, event))
    woken = []
    for loop, items in by_loop.items():
        done = threading.Event()
        try:
            loop.call_soon_threadsafe(_put_all, loop, items, done)
        except RuntimeError:  # a closed event loop, at shutdown
            continue
        woken.append(done)
    return woken


def _put_all(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestHandle, Event]], done: threading.Event) -> None:
    for handle, event in items:
        handle._events.put_nowait(event)
    # the puts scheduled the woken tasks' next steps on this loop: this callback runs after them
    loop.call_soon(done.set)


class EngineWorker:
    """Runs the sessions on a thread of its own.

    Args:
      sessions: method name -> session (the first is the default method).
      metrics: where the counters go.
      max_waiting: requests that may wait for a slot; one more is a 429.
      max_iterations: loop iterations per session call (a chunk leaves at most this many
        steps after its commit; 1 = every step).
      log_interval: seconds between throughput lines in the log (0: none).
      streams_first_max_seconds: the longest the engine thread waits, after a call, for the
        event loops to send that step's chunks before it prepares the next call (0: no wait).
    """

    def __init__(
        self,
        sessions: Mapping[str, Session],
        metrics: ServerMetrics,
        *,
        max_waiting: int = 256,
        max_iterations: int = 1,
        log_interval: float = 10.0,
        streams_first_max_seconds: float = STREAMS_FIRST_MAX_SECONDS,
    ):
        if not sessions:
            raise ValueError("no sessions")
        self.sessions = dict(sessions)
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_iterations = max_iterations
        self.streams_first_max_seconds = streams_first_max_seconds
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: collections.deque[RequestHandle] = collections.deque()
        self._aborts: list[tuple[RequestHandle, APIError | None]] = []
        self._live: dict[str, RequestHandle] = {}  # submitted and not yet released
        self._in_engine: dict[str, RequestHandle] = {}  # added to a session and not finished
        self._waiting = 0  # submitted, no step yet
        self._accepting = True
        self._stopping: str | None = None
        self._thread = threading.Thread(target=self._run, name="dllm-engine", daemon=True)
        self.failure: BaseException | None = None
        self._num_slots = sum(s.compiled.loop.num_slots for s in self.sessions.values())
        metrics.slots_total.set(self._num_slots)
        self.log_interval = log_interval
        self._throughput = _Throughput()

    @property
    def default_method(self) -> str:
        return next(iter(self.sessions))

    def start(self) -> None:
        self._thread.start()

    # ----- asyncio side ------------------------------------------------------------------

    def submit(self, work: Work) -> RequestHandle:
        """Queues a request; raises APIError 400 for parameters its method cannot take, 429 when
        the waiting queue is full, 503 when stopping."""
        session = self.sessions[work.method]
        try:  # what session.add would refuse, refused here with the request's own status
            session.check(work.prompt_ids, work.sampling, "this request")
        except GenerationError as e:
            raise APIError(400, f"{e} (method {work.method})", code="invalid_value") from None
        handle = RequestHandle(self, work, asyncio.get_running_loop())
        with self._lock:
            if not self._accepting or self.failure is not None:
                raise APIError(
                    503,
                    "the server is shutting down"
                    if self.failure is None
                    else "the engine has failed; restart the server",
                    code="unavailable",
                )
            # beyond the slots, at most max_waiting requests wait
            if len(self._live) - self._num_slots >= self.max_waiting:
                self.metrics.errors.labels("queue_full").inc()
                raise APIError(
                    429,
                    f"too many requests waiting (the server's limit is {self.max_waiting}); retry later",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            if work.request_id in self._live:
                raise APIError(400, f"request id {work.request_id} is already in use", code="duplicate_id")
            self._waiting += 1
            self._live[work.request_id] = handle
            self._inbox.append(handle)
            self._wake.notify()
        self.metrics.requests_running.inc()
        self.metrics.requests_waiting.set(self._waiting)
        return handle

    def release(self, handle: RequestHandle) -> None:
        """The handler finished (answered, failed, cancelled or disconnected)."""
        with self._lock:
            if self._live.pop(handle.request_id, None) is None:
                return
            if handle.started is None:
                handle.started = -1.0  # counted out of the waiting requests here, not when it steps
                self._waiting -= 1
            self._aborts.append((handle, None))
            self._wake.notify()
        self.metrics.requests_running.dec()
        self.metrics.requests_waiting.set(self._waiting)

    # ----- lifecycle ----------------------------------------------------------------------

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def stop(self, reason: str = "the server is shutting down", timeout: float = 30.0) -> None:
        """Fails every request still held with `reason` (503) and ends the thread."""
        with self._lock:
            self._accepting = False
            self._stopping = reason
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ----- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while self._stopping is None and not self._inbox and not self._aborts and not self._in_engine:
                        self._log_throughput()  # the last busy interval's line, once idle
                        self._wake.wait(timeout=0.5)
                    if self._stopping is not None:
                        break
                    arrived, self._inbox = list(self._inbox), collections.deque()
                    aborts, self._aborts = self._aborts, []
                self._abort(aborts)
                self._admit(arrived)
                self._expire()
                self._step_sessions()
                self._update_gauges()
                self._log_throughput()
        except BaseException as e:  # the engine failed: every request learns it, the server stays up
            log.exception("the engine thread failed")
            self.failure = e
            reason = f"the engine failed ({type(e).__name__}); restart the server"
            self.metrics.errors.labels("engine").inc()
        else:
            reason = self._stopping or "stopped"
        self._fail_all(APIError(503, reason, code="unavailable"))

    def _admit(self, arrived: list[RequestHandle]) -> None:
        for handle in arrived:
            if handle.closed:
                continue
            work = handle.work
            try:
                self.sessions[work.method].add(work.request_id, work.prompt_ids, work.sampling)
            except GenerationError as e:  # a request the session refuses fails alone
                self.metrics.errors.labels("rejected").inc()
                handle.deliver(
                    Event(error=APIError(400, f"request rejected by the engine: {e}", code="invalid_request"))
                )
                continue
            except Exception as e:  # so does one the session fails on
                log.exception("adding request %s failed", work.request_id)
                self.metrics.errors.labels("engine").inc()
                handle.deliver(
                    Event(error=APIError(500, f"internal error ({type(e).__name__})", code="internal_error"))
                )
                continue
            self._in_engine[work.request_id] = handle

    def _abort(self, aborts: list[tuple[RequestHandle, APIError | None]]) -> None:
        for handle, error in aborts:
            if self._in_engine.pop(handle.request_id, None) is not None:
                try:
                    self.sessions[handle.work.method].abort(handle.request_id)
                except Exception:  # the request is gone from the worker either way
                    log.exception("aborting request %s failed", handle.request_id)
                self.metrics.cancelled.inc()
            if error is not None:
                handle.deliver(Event(error=error))

    def _expire(self) -> None:
        now = time.monotonic()
        expired = [h for h in self._in_engine.values() if h.work.deadline <= now]
        for handle in expired:
            self.metrics.errors.labels("deadline").inc()
            self._abort(
                [(handle, APIError(504, "the request's deadline passed before it finished", code="deadline_exceeded"))]
            )

    def _step_sessions(self) -> None:
        for method, session in self.sessions.items():
            if not (session.num_running or session.num_waiting):
                continue
            start = time.perf_counter()
            try:
                updates = session.step(self.max_iterations)
            except Exception as e:
                self._session_failed(method, session, e)
                continue
            received = time.perf_counter()
            now = time.monotonic()
            steps = max((len(u.commits) for u in updates), default=0)
            if steps:
                self.metrics.step_seconds.observe((received - start) / steps)
                self.metrics.loop_iterations.inc(steps)
            deliveries = []
            for update in updates:
                handle = self._in_engine.get(update.request_id)
                if handle is None:
                    continue  # aborted while its step ran
                if update.commits or update.result is not None:
                    with self._lock:
                        first = handle.started is None
                        if first:
                            handle.started = now
                            self._waiting -= 1
                    if first:
                        self.metrics.queue_wait_seconds.observe(now - handle.arrived)
                if update.result is not None:
                    del self._in_engine[update.request_id]
                    self._throughput.finished(update.result)
                deliveries.append((handle, Event(commits=update.commits, received=received, result=update.result)))
            self._let_streams_run(deliver_all(deliveries), received - start)
            self._throughput.steps += steps

    def _let_streams_run(self, woken: list[threading.Event], call_seconds: float) -> None:
        """Waits until the event loops have run the requests a step's events woke, for at most
        streams_first_max_seconds or STREAMS_FIRST_SHARE of the session call's time, before this
        thread prepares the next call. That work holds the interpreter lock, which the event
        loop needs to send the step's chunks; the device meanwhile runs the call dispatched
        before these events were read."""
        deadline = time.perf_counter() + min(self.streams_first_max_seconds, STREAMS_FIRST_SHARE * call_seconds)
        for done in woken:
            done.wait(max(0.0, deadline - time.perf_counter()))

    def _session_failed(self, method: str, session: Session, error: Exception) -> None:
        """A session call raised: its requests fail (500), the session starts afresh."""
        log.exception("the %s session failed; its requests end with an error and it starts afresh", method)
        self.metrics.errors.labels("engine").inc()
        failed = [h for h in self._in_engine.values() if h.work.method == method]
        for handle in failed:
            del self._in_engine[handle.request_id]
            handle.deliver(
                Event(
                    error=APIError(
                        500, f"internal error while decoding ({type(error).__name__})", code="internal_error"
                    )
                )
            )
        with self._lock:
            for handle in failed:
                if handle.started is None:
                    handle.started = -1.0
                    self._waiting -= 1
        session.reset()

    def _log_throughput(self) -> None:
        t = self._throughput
        now = time.monotonic()
        elapsed = now - t.since
        if not self.log_interval or elapsed < self.log_interval:
            return
        if t.requests or t.steps:
            log.info(
                "throughput: %.2f requests/s, %.1f tokens/s (%.1f reference tokens/s), %.1f steps/s; "
                "running %d, waiting %d, slots busy %d/%d",
                t.requests / elapsed,
                t.tokens / elapsed,
                t.reference_tokens / elapsed,
                t.steps / elapsed,
                len(self._in_engine),
                self._waiting,
                sum(s.num_running for s in self.sessions.values()),
                self._num_slots,
            )
        self._throughput = _Throughput(since=now)

    def _update_gauges(self) -> None:
        self.metrics.requests_waiting.set(self._waiting)
        self.metrics.slots_busy.set(sum(s.num_running for s in self.sessions.values()))

    def _fail_all(self, error: APIError) -> None:
        with self._lock:
            handles = list(self._live.values())
        for handle in handles:
            handle.deliver(Event(error=error))
        self._in_engine.clear()


@dataclasses.dataclass
class _Throughput:
    """What the engine did since `since` (time.monotonic()): answers, their completion and
    reference tokens (docs/counters.md), loop iterations."""

    since: float = dataclasses.field(default_factory=time.monotonic)
    requests: int = 0
    tokens: int = 0
    reference_tokens: int = 0
    steps: int = 0

    def finished(self, result: GenerationResult) -> None:
        self.requests += 1
        self.tokens += result.completion_tokens
        self.reference_tokens += result.reference_num_tokens
