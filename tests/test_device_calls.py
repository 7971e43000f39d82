"""dllm_jax.engine.device_calls: a compiled loop's calls run in order on their own thread, each
from the state the one before returned; a failed call fails the calls queued after it."""

import threading

import pytest

from dllm_jax.engine.device_calls import DeviceCalls

pytestmark = pytest.mark.unit


def test_calls_chain_their_states_in_order_and_the_next_starts_while_the_host_reads():
    release = threading.Event()
    seen = []

    def call(weights, state, step):
        if step == 1:
            release.wait(5)  # the first call is still running when the second is queued
        seen.append((threading.current_thread().name, state, step))
        return state + [step], (f"report {step}",)

    calls = DeviceCalls(call)
    first = calls.submit("w", 1, state=[0])
    second = calls.submit("w", 2)
    assert not second.started.is_set()
    release.set()
    assert first.result(5) == ("report 1",)
    assert second.started.wait(5) and second.result(5) == ("report 2",)
    assert [s[1:] for s in seen] == [([0], 1), ([0, 1], 2)]
    assert all(name.startswith("dllm-loop-call") for name, _, _ in seen)
    assert calls.seconds > 0  # the first call's wait is part of its time


def test_a_failed_call_fails_the_calls_after_it_until_the_state_is_dropped():
    def call(weights, state, step):
        if step == 2:
            raise ValueError("device error")
        return state + 1, (step, state)

    calls = DeviceCalls(call)
    calls.submit("w", 1, state=0)
    failed, after = calls.submit("w", 2), calls.submit("w", 3)
    with pytest.raises(ValueError, match="device error"):
        failed.result(5)
    with pytest.raises(RuntimeError, match="earlier call of this loop failed"):
        after.result(5)
    calls.drop_state()
    assert calls.submit("w", 4, state=10).result(5) == (4, 10)
    assert calls.submit("w", 5).result(5) == (5, 11)


SLOW_CALL_AT_EXIT = """
import jax, jax.numpy as jnp
from dllm_jax.engine.device_calls import DeviceCalls

@jax.jit
def slow(x):  # about a second of XLA:CPU work
    return jax.lax.fori_loop(0, 3000, lambda i, y: jnp.sin(y @ y.T), x)

calls = DeviceCalls(lambda weights, state, _: (slow(state).block_until_ready(), ()))
calls.submit(None, 0, state=jnp.ones((64, 64)))
calls.submit(None, 1).started.wait()
print("exiting with a call inside XLA", flush=True)
"""


@pytest.mark.integration
def test_the_process_exits_cleanly_with_a_call_inside_xla(tmp_path):
    """The thread is joined at exit: a daemon thread still inside XLA when the interpreter
    finalizes aborts the process ("terminate called ... exception not rethrown")."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(SLOW_CALL_AT_EXIT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting with a call inside XLA" in done.stdout
