"""Event loops that drop callbacks a TensorStore thread hands them after they closed."""

import asyncio
import threading

import pytest

from dllm_jax.common.late_callbacks import LateCallbackTolerantLoop, tolerant_event_loops

pytestmark = pytest.mark.unit


def _call_after_close() -> list[str]:
    """asyncio.run's loop, closed, then called from another thread as TensorStore calls it
    when a read finishes after a failed restore; the errors that thread met."""
    holder = {}

    async def main():
        holder["loop"] = asyncio.get_running_loop()

    asyncio.run(main())
    errors = []

    def late():
        try:
            holder["loop"].call_soon_threadsafe(lambda: None)
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=late)
    thread.start()
    thread.join()
    return errors


def test_a_callback_after_the_loop_closed_is_dropped_only_for_loops_made_in_the_block():
    assert _call_after_close() == ["Event loop is closed"]  # what the TensorStore thread would print
    with tolerant_event_loops():
        assert _call_after_close() == []
    assert _call_after_close() == ["Event loop is closed"]  # the previous policy is back


def test_a_loop_made_in_the_block_runs_callbacks_while_open_and_drops_them_once_closed():
    with tolerant_event_loops():
        loop = asyncio.new_event_loop()
    assert isinstance(loop, LateCallbackTolerantLoop)
    ran = []

    async def main():
        done = asyncio.Event()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(lambda: (ran.append(1), done.set()))).start()
        await asyncio.wait_for(done.wait(), 10)

    loop.run_until_complete(main())
    loop.close()
    assert ran == [1]
    assert loop.call_soon_threadsafe(lambda: None) is None
