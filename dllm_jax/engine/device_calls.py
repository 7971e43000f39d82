"""The calls of one compiled loop, run in order on a thread of their own that keeps the state.

A session queues call k while call k-1 still runs, then reads call k-1's report: the thread
starts call k the moment call k-1 returns, with no other thread in between, so the device's
idle time between calls is this thread's own dispatch overhead. That matters on XLA:GPU,
where a call's dispatch returns only when the device is done (every while-loop condition is
read back to the host): had the session's thread dispatched, the device would idle while it
read the last report, built events and came back. The host's work overlaps the device's
whatever the platform (on the CPU, dispatch is asynchronous anyway).

    calls = DeviceCalls(compiled.call)
    first = calls.submit(weights, control, ring, state=initial_state)
    second = calls.submit(weights, control, ring)   # from the first call's output
    report = first.result(); second.started.wait()   # read the first while the second runs
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Submitted:
    """A queued call: `report` gives its report (or raises what it raised); `started` is set
    once the thread is about to dispatch it."""

    report: concurrent.futures.Future
    started: threading.Event


class DeviceCalls:
    """Runs call(weights, state, *args) -> (state, report) in submission order on one thread,
    each call from the state the one before returned (donated to it).

    The thread ends once this object is collected; a call that raises fails every call queued
    after it (their state is gone) until `drop_state`.
    """

    def __init__(self, call: Callable[..., tuple[Any, Sequence[Any]]]):
        self._call = call
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dllm-loop-call")
        self._state = None  # the last call's output: only the thread touches it while calls are queued
        self._failed: BaseException | None = None
        self._last: Submitted | None = None

    def submit(self, weights: Any, *args: Any, state: Any = None) -> Submitted:
        """Queues a call with these arguments, from `state` (a session's first call) or else
        from the last call's output."""
        started = threading.Event()

        def run():
            started.set()
            if self._failed is not None:
                raise RuntimeError("an earlier call of this loop failed; its state is gone") from self._failed
            current = self._state if state is None else state
            self._state = None
            try:
                self._state, report = self._call(weights, current, *args)
            except BaseException as e:
                self._failed = e
                raise
            return report

        self._last = Submitted(self._thread.submit(run), started)
        return self._last

    def drop_state(self) -> None:
        """Waits for the queued calls (their reports are dropped) and forgets the state and any
        failure: the next call must bring a state."""
        if self._last is not None:
            concurrent.futures.wait([self._last.report])
        self._last = None
        self._state = None
        self._failed = None

    def state(self) -> Any:
        """The last call's output state, once every queued call has returned (tests and
        benchmarks look into it; a session never does)."""
        if self._last is not None:
            concurrent.futures.wait([self._last.report])
        return self._state
