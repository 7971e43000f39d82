"""scripts/serve_chunk_latency.py: its arguments, and one small run of each engine-thread setting
(a server in its process over the fake session, load_test.py in another)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import serve_chunk_latency as script

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dispatch-ms", "-1"], "--dispatch-ms -1: expected >= 0"),
        (["--streams-first-ms", "0", "-2"], "--streams-first-ms -2: expected >= 0"),
        (["--configs", "0"], "--configs 0: expected SLOTS or SLOTS:canvas"),
    ],
)
def test_bad_arguments_are_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_run_with_and_without_the_wait_streams_every_request(tmp_path):
    out = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "serve_chunk_latency.py"),
            *("--configs", "2", "--step-ms", "5", "--gen-length", "8", "--dispatch-ms", "1"),
            *("--streams-first-ms", "0", "5", "--timeout", "60", "--output", str(out)),
        ],
        check=True,
        capture_output=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    runs = json.loads(out.read_text())["runs"]
    assert [r["streams_first_ms"] for r in runs] == [0.0, 5.0]
    for run in runs:
        assert run["ok"] == run["requests"] == 4 and not run["errors"]
        # 4 streams of 8 positions, 2 committed per step: a chunk per step (the last one ends it)
        assert run["count"] == 4 * 4 and 0 < run["p50_ms"] <= run["p99_ms"] <= run["max_ms"]
