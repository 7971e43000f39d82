"""scripts/load_test.py's request mix and its latency-throughput plot (no server needed)."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import load_test  # noqa: E402

pytestmark = pytest.mark.unit  # in process: no compiled decode loop, no process


def test_the_mix_draws_each_requests_fields_once_for_every_rate():
    opts = load_test.parse_args(["--requests", "40", "--max-tokens", "8", "32", "--methods", "a", "b", "--seed", "3"])
    mix = load_test.request_mix(opts)
    assert mix == load_test.request_mix(opts), "the same draws at every rate"
    assert {m["max_tokens"] for m in mix} == {8, 32} and {m["dllm"]["method"] for m in mix} == {"a", "b"}
    ids = load_test.load_prompts(load_test.parse_args(["--requests", "30", "--prompt-ids", "4", "9"]))
    assert {len(p) for p in ids} == {4, 9}


@pytest.mark.parametrize("argv", [["--plot", "curve.svg"], ["--prompt-ids", "0"], ["--max-tokens", "-1"]])
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        load_test.parse_args(argv)
    assert e.value.code == 2 and "error: --" in capsys.readouterr().err


def test_the_plot_is_a_png_of_every_rate(tmp_path):
    runs = [
        dict(rate=r, ok=8, tokens_per_s=t, latency_p50_s=a, latency_p99_s=b, first_text_p50_s=c)
        for r, t, a, b, c in [
            (1.0, 10.0, 0.5, 0.8, 0.1),
            (4.0, 35.0, 0.7, 1.2, 0.15),
            (float("inf"), 60.0, 2.0, 4.0, 1.0),
        ]
    ]
    path = tmp_path / "curve.png"
    load_test.plot_curve(runs, path, "a test curve")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert not list(tmp_path.glob(".curve.png.*")), "written atomically: no temporary left"
    assert isinstance(load_test.parse_args([]), argparse.Namespace)


def test_replot_draws_an_earlier_report_and_refuses_a_bad_one(tmp_path, capsys):
    """--replot: the curve of a report written where matplotlib was missing (the GPU image)."""
    import json

    runs = [
        dict(rate=r, ok=4, requests=4, tokens_per_s=t, latency_p50_s=1.0, latency_p99_s=2.0, first_text_p50_s=0.5)
        for r, t in [(2.0, 20.0), (float("inf"), 50.0)]
    ]
    report = tmp_path / "load.json"
    report.write_text(json.dumps({"url": "http://x", "model": "m", "runs": runs}))
    png = tmp_path / "again.png"
    assert load_test.main(["--replot", str(report), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    report.write_text("{not json")
    assert load_test.main(["--replot", str(report), "--plot", str(png)]) == 2
    assert f"--replot {report}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        load_test.parse_args(["--replot", str(report)])
    assert e.value.code == 2
