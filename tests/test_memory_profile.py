"""scripts/memory_profile.py: XLA's memory analysis of the compiled decode loop, abstract params."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_process_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


def test_memory_profile_of_the_tiny_model(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "memory_profile.py"),
            "--model-shape",
            "tiny",
            "--slots",
            "2",
            "--methods",
            "flash_verify",
            "--peak-buffers",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", **child_process_env()},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "memory.json").read_text())
    assert not report["errors"] and report["backend"] == "xla" and report["dtype"] == "float32"
    (run,) = report["runs"]
    assert (run["method"], run["slots"]) == ("flash_verify", 2)
    # the arguments hold the weights and the decode state with its cache
    assert run["argument_size_in_bytes"] > run["weight_bytes"] + run["cache_bytes"] > 0
    assert run["temp_size_in_bytes"] > 0
    assert (
        run["peak_estimate_bytes"]
        >= run["argument_size_in_bytes"] + run["temp_size_in_bytes"] - run["alias_size_in_bytes"]
    )
    sizes = [a["bytes"] for a in run["largest_arrays"]]
    assert len(sizes) == 12 and sizes == sorted(sizes, reverse=True)
    assert "| flash_verify | 2 |" in (tmp_path / "memory.md").read_text()
    # XLA's live ranges at the peak: the largest temporaries, never the parameters; the dump is gone
    peak = run["peak_buffers"]
    assert peak["live_at_peak"] >= len(peak["buffers"]) > 0 and peak["breakdown"]
    assert all(b["op"] != "parameter" for b in peak["buffers"])
    assert peak["bytes_at_peak"] >= peak["temporaries_at_peak"] >= peak["buffers"][0]["bytes"] > 0
    assert sorted(tmp_path.iterdir()) == [tmp_path / "memory.json", tmp_path / "memory.md"]
