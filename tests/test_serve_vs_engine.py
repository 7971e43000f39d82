"""scripts/gpu/serve_vs_engine.py's own pieces: its arguments and the tail report (which of the
longest commit-to-chunk samples a garbage collection was inside, and when they came)."""

import asyncio
import types

import pytest

from scripts.gpu import serve_vs_engine as script

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--streams-first-ms", "5", "-1"], "--streams-first-ms [5.0, -1.0]: expected numbers >= 0"),
        (["--gc-freeze", "maybe"], "argument --gc-freeze: invalid choice: 'maybe'"),
    ],
)
def test_bad_arguments_are_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def recorded(pairs):
    """An ExactSamples holding (value, time) pairs, as if observed at those times."""
    samples = script.ExactSamples(type("Histogram", (), {"observe": lambda self, v: None})())
    samples.values, samples.times = [v for v, _ in pairs], [t for _, t in pairs]
    return samples


def test_the_longest_samples_carry_the_pauses_that_ended_inside_them_and_their_time():
    # chunks (value s, observed at s): the first is before the range asked for
    chunks = recorded([(0.050, 1.0), (0.001, 10.0), (0.008, 10.5), (0.004, 11.0), (0.002, 12.0)])
    # pauses: 3 ms ending at 10.499 (inside the 8 ms sample), 1 ms ending at 11.5 (inside none)
    pauses = [recorded([(0.003, 10.499)]), recorded([(0.001, 11.5)])]
    longest = script.longest_with_pauses(chunks, 1, pauses, n=3)
    assert [round(c["ms"], 3) for c in longest] == [8.0, 4.0, 2.0]
    assert [round(c["gc_ms"], 3) for c in longest] == [3.0, 0.0, 0.0]
    assert [round(c["at_s"], 3) for c in longest] == [0.5, 1.0, 2.0]
    # a pause that began before the sample counts only for its part inside it
    partial = script.longest_with_pauses(recorded([(0.004, 20.0)]), 0, [recorded([(0.010, 19.998)])])
    assert round(partial[0]["gc_ms"], 3) == 2.0


def test_a_loads_span_runs_from_its_first_admission_to_its_last_result_and_close_restores_the_worker():
    from dllm_jax.serve import worker as serve_worker
    from dllm_jax.serve.worker import Event

    class Worker:
        def __init__(self):
            self.admitted = []

        def _admit(self, arrived):
            self.admitted.append(list(arrived))

    w, deliver_all = Worker(), serve_worker.deliver_all
    closed = asyncio.new_event_loop()
    closed.close()  # the worker's deliver_all skips a closed loop's requests
    handle = types.SimpleNamespace(_loop=closed)
    spans = script.LoadSpans(w)
    try:
        w._admit([])  # a call boundary with nothing new: not the load's start
        assert spans.first_admit is None
        w._admit(["a"])
        first = spans.first_admit
        w._admit(["b"])
        assert spans.first_admit == first and w.admitted == [[], ["a"], ["b"]]
        serve_worker.deliver_all([(handle, Event(commits=()))])  # a step without a result: not the load's end
        assert spans.last_result is None
        assert serve_worker.deliver_all([(handle, Event(result=object()))]) == []  # the worker's own ran
        assert spans.last_result >= first
    finally:
        spans.close()
    assert serve_worker.deliver_all is deliver_all and "_admit" not in vars(w)
    spans.reset()
    assert spans.first_admit is None and spans.last_result is None
