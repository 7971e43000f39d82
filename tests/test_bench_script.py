"""scripts/bench.py --tiny: the benchmark script itself runs and reports what it promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_process_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


def test_bench_tiny_reports_steps_and_comparisons(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench.py"),
            "--tiny",
            "--out",
            str(tmp_path),
            "--schedules",
            "one",
            "--slots",
            "1",
            "2",
            "--iterations",
            "2",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", **child_process_env()},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["ceilings"]["matmul_flops"] > 0 and report["ceilings"]["bandwidth_bytes"] > 0
    assert not report["errors"]
    steps = [r for r in report["runs"] if r["preset"] == "steps"]
    assert [r["slots"] for r in steps] == [1, 2]
    for r in steps:
        assert r["step_s"] > 0 and r["compile_s"] > 0 and r["flop_floor_s"] > 0
        assert r["step_over_flop_floor"] == r["step_s"] / r["flop_floor_s"]
    compare = [r for r in report["runs"] if r["preset"] == "compare"]
    assert {r["method"] for r in compare} == {"llada", "fast_dllm", "flash_cache", "flash_verify"}
    for r in compare:
        # one token per step: every method commits exactly one token per step
        assert r["tokens_per_step"] == 1.0
        assert r["tokens"] == 2 * 32 and r["tokens_per_s"] > 0
    verify = next(r for r in compare if r["method"] == "flash_verify")
    assert verify["forward_passes"] == 2 * verify["steps"]
    checks = {r["method"]: r for r in report["flop_ratio_checks"]}
    assert set(checks) == {"llada", "fast_dllm", "flash_verify"}
    table = (tmp_path / "bench.md").read_text()
    assert "| backend | slots | rows/slot |" in table and "| method | schedule | backend |" in table
    assert "speed-up / floor ratio" in table


def test_bench_gemm_tiny_times_every_variant_and_the_int8_kernel_tilings(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_gemm.py"),
            "--tiny",
            "--rows",
            "24",
            "--sweep",
            "--variants",
            "fp8",
            "fp8 f32 product",
            "int8 xla",
            "int8 pallas",
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
    results = json.loads((tmp_path / "bench_gemm.json").read_text())["results"]
    assert not [r for r in results if "error" in r]
    variants = [r["variant"] for r in results]
    assert (
        variants[:5] == ["bf16", "fp8", "fp8 f32 product", "int8 xla", "int8 pallas"] and len(variants) > 7
    )  # + the sweep's tilings
    for r in results:
        assert r["seconds"] > 0 and r["weight_gbps"] > 0 and r["rel_error_vs_f32"] < 0.05
        assert ("pallas int8_weight_matmul" in r["gemm"]) == (
            r["variant"] not in ("bf16", "fp8", "fp8 f32 product", "int8 xla")
        )
    assert "Fastest int8 variant" in (tmp_path / "bench_gemm.md").read_text()


def test_bench_tiny_runs_both_families_in_one_report(tmp_path):
    """--model-shape llada-8b dream-7b: each family's runs in one report, Dream's sparse steps
    with a predictor row per candidate more (its shifted logits)."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench.py"),
            "--tiny",
            "--model-shape",
            "llada-8b",
            "dream-7b",
            "--out",
            str(tmp_path),
            "--schedules",
            "one",
            "--methods",
            "flash_cache",
            "--slots",
            "1",
            "--iterations",
            "2",
            "--repeats",
            "1",
            "--ceiling-repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", **child_process_env()},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert not report["errors"] and set(report["weight_bytes"]) == {"llada-8b", "dream-7b"}
    steps = {r["model"]: r for r in report["runs"] if r["preset"] == "steps"}
    assert steps["dream-7b"]["rows_per_slot"] == steps["llada-8b"]["rows_per_slot"] + 16  # W = 16 predictor rows
    assert all(r["step_over_flop_floor"] > 0 for r in steps.values())
    compare = [r for r in report["runs"] if r["preset"] == "compare"]
    assert sorted(r["model"] for r in compare) == ["dream-7b", "llada-8b"]
    assert all(r["tokens_per_step"] == 1.0 and r["time_over_floor"] > 0 for r in compare)
    assert "dream-7b xla" in (tmp_path / "bench.md").read_text()
