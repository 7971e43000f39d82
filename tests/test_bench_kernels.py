"""scripts/bench_kernels.py --tiny: the CPU smoke run of the GPU benchmark and its output format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels.attention.cache_attention import AttentionBlockSizes
from pallas_kernels.projection.qkv_rope_cache import QKVBlockSizes

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_prints_the_table_and_writes_adoptable_json(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "scripts/bench_kernels.py", "--tiny", "--inner", "1", "--repeats", "1", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| kernel | slots | keys | path | blocks | us | of roofline")
    paths = {tuple(cell.strip() for cell in line.split("|")[1:5:3]) for line in table[1:]}
    for kernel, path in [
        ("qkv_rope_cache", "xla"),
        ("qkv_rope_cache", "xla_one_layer"),
        ("qkv_rope_cache", "pallas best"),
        ("cache_attention", "xla"),
        ("cache_attention", "cudnn"),
        ("cache_attention", "pallas best"),
    ]:
        assert (kernel, path) in paths

    report = json.loads(out.read_text())
    assert report["all_checks_ok"] is True
    assert report["ceilings"]["matmul_flops"] > 0 and report["ceilings"]["bandwidth_bytes"] > 0
    assert report["checks"]["attention_verify"]["ok"]
    for case in report["qkv"] + report["attention"]:
        assert case["paths"]["xla"] > 0 and case["default_s"] > 0 and case["roofline_s"] > 0
        assert len(case["sweep"]) == 2 and all(entry["check"]["ok"] for entry in case["sweep"])
    # the recommendations are valid tilings, ready to become the defaults
    for blocks in report["recommended"]["qkv"].values():
        QKVBlockSizes(**blocks)
    for blocks in report["recommended"]["attention"].values():
        AttentionBlockSizes(**blocks)
