"""scripts/gpu/serve_vs_engine.py's own pieces: its arguments and the tail report (which of the
longest commit-to-chunk samples a garbage collection was inside, and when they came)."""

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
