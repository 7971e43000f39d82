"""Event loops that drop callbacks handed to them after they closed.

TensorStore resolves each read it started by calling its asyncio loop's
``call_soon_threadsafe`` from its own threads. When a damaged file fails an orbax restore,
orbax's ``asyncio.run`` closes that loop while other reads are still in flight; each of those,
finishing later, raises "RuntimeError: Event loop is closed" on a TensorStore thread, which
prints its traceback to stderr at some moment after (or while) we report the failure in one
line. Nothing waits for such a read any more, so dropping its callback loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class LateCallbackTolerantLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``call_soon_threadsafe`` returns None once it is closed."""

    def call_soon_threadsafe(self, callback, *args, context=None):  # type: ignore[override]
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():
                return None
            raise


class _TolerantLoopPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return LateCallbackTolerantLoop()


@contextlib.contextmanager
def tolerant_event_loops() -> Iterator[None]:
    """Within the block, new event loops (``asyncio.run``'s and ``asyncio.new_event_loop()``'s)
    are LateCallbackTolerantLoop; they stay so after the block, when the late callbacks come.
    The previous event loop policy is restored on leaving."""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_TolerantLoopPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)
