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

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any


class Submitted:
    """A queued call: `started` is set once the thread is about to dispatch it, `result()`
    waits for its report (and raises what the call raised)."""

    __slots__ = ("args", "state", "started", "_done", "_report", "_error")

    def __init__(self, args: tuple, state: Any):
        self.args = args
        self.state = state  # the state to start from (None: the last call's output)
        self.started = threading.Event()
        self._done = threading.Event()
        self._report: Sequence[Any] | None = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = None) -> Sequence[Any]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the loop's call did not return within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._report


class _Chain:
    """What the thread keeps between calls: the last output state, or the failure that lost it,
    and the seconds its calls took (dispatch to return)."""

    def __init__(self):
        self.state: Any = None
        self.failed: BaseException | None = None
        self.seconds = 0.0


def _serve(call: Callable, inbox: queue.SimpleQueue, chain: _Chain) -> None:
    """The thread: runs the queued calls in order until it takes None."""
    while (item := inbox.get()) is not None:
        item.started.set()
        try:
            if chain.failed is not None:
                raise RuntimeError("an earlier call of this loop failed; its state is gone") from chain.failed
            state = chain.state if item.state is None else item.state
            item.state = chain.state = None
            start = time.perf_counter()
            try:
                chain.state, item._report = call(item.args[0], state, *item.args[1:])
            except BaseException as e:
                chain.failed = e
                raise
            finally:
                chain.seconds += time.perf_counter() - start
        except BaseException as e:
            item._error = e
        item._done.set()


def _stop(inbox: queue.SimpleQueue, thread: threading.Thread) -> None:
    """Ends the thread once its queued calls are done: when its DeviceCalls is collected, and at
    exit (a call still inside XLA when the interpreter finalizes would abort the process)."""
    inbox.put(None)
    if thread is not threading.current_thread():
        thread.join()


class DeviceCalls:
    """Runs call(weights, state, *args) -> (state, report) in submission order on one thread,
    each call from the state the one before returned (donated to it).

    The thread ends once this object is collected (or at exit), after its queued calls; a call
    that raises fails every call queued after it (their state is gone) until `drop_state`.
    """

    def __init__(self, call: Callable[..., tuple[Any, Sequence[Any]]]):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._chain = _Chain()
        self._last: Submitted | None = None
        thread = threading.Thread(
            target=_serve, args=(call, self._inbox, self._chain), name="dllm-loop-call", daemon=True
        )
        thread.start()
        weakref.finalize(self, _stop, self._inbox, thread)

    def submit(self, weights: Any, *args: Any, state: Any = None) -> Submitted:
        """Queues a call with these arguments, from `state` (a session's first call) or else
        from the last call's output."""
        self._last = Submitted((weights, *args), state)
        self._inbox.put(self._last)
        return self._last

    def drop_state(self) -> None:
        """Waits for the queued calls (their reports are dropped) and forgets the state and any
        failure: the next call must bring a state."""
        if self._last is not None:
            self._last._done.wait()
        self._last = None
        self._chain.state = None
        self._chain.failed = None

    @property
    def seconds(self) -> float:
        """Seconds the calls took so far, from dispatch to return: on XLA:GPU, where a call
        returns when the device is done, the device's busy time."""
        return self._chain.seconds
