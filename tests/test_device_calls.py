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
    assert calls.state() == [0, 1, 2]


def test_a_failed_call_fails_the_calls_after_it_until_the_state_is_dropped():
    def call(weights, state, step):
        if step == 2:
            raise ValueError("device error")
        return state + 1, (step,)

    calls = DeviceCalls(call)
    calls.submit("w", 1, state=0)
    failed, after = calls.submit("w", 2), calls.submit("w", 3)
    with pytest.raises(ValueError, match="device error"):
        failed.result(5)
    with pytest.raises(RuntimeError, match="earlier call of this loop failed"):
        after.result(5)
    calls.drop_state()
    assert calls.submit("w", 4, state=10).result(5) == (4,) and calls.state() == 11
