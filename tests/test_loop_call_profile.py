"""scripts/gpu/loop_call_profile.py: its trace and HLO readings, and the tiny run in process."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("loop_call_profile", ROOT / "scripts" / "gpu" / "loop_call_profile.py")
profile = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = profile  # its dataclasses look their module up
_spec.loader.exec_module(profile)


def _kernel(name, ts, dur):
    return {"name": name, "ts": float(ts), "dur": float(dur)}


def _calls(per_call_us, per_iteration_us, calls, iterations_per_call, gap_us, start=0.0):
    """Device events and call windows (start, end, thread) of `calls` calls: each one "pack"
    kernel once per call after `iterations_per_call` "step" kernels, a gap between calls."""
    events, windows, t = [], [], start
    for _ in range(calls):
        begin = t
        for _ in range(iterations_per_call):
            events.append(_kernel("step", t, per_iteration_us))
            t += per_iteration_us
        events.append(_kernel("pack", t, per_call_us))
        t += per_call_us
        windows.append((begin, t, 7))
        t += gap_us
    return events, windows


@pytest.mark.unit
def test_the_device_time_of_a_call_splits_into_once_per_call_and_once_per_iteration():
    events_a, _ = _calls(50, 1000, calls=4, iterations_per_call=1, gap_us=300)
    events_b, _ = _calls(50, 1000, calls=1, iterations_per_call=4, gap_us=0, start=1e6)
    split = profile.kernel_split(events_a, 4, 4, events_b, 1, 4)
    assert split["device_us_fixed_per_call"] == pytest.approx(50)
    assert split["device_us_per_iteration"] == pytest.approx(1000)
    assert split["kernels_fixed_per_call"] == pytest.approx(1)
    assert [(k["name"], k["per_call"], k["per_iteration"]) for k in split["once_per_call"]] == [("pack", 1, 0)]


@pytest.mark.unit
def test_the_calls_timeline_finds_the_idle_between_calls():
    events, windows = _calls(50, 1000, calls=3, iterations_per_call=1, gap_us=300)
    # each call returns 20 us after its last kernel and its first kernel starts 10 us after its start
    windows = [(s - 10, t + 20, tid) for s, t, tid in windows]
    timeline = profile.calls_timeline(events, windows)
    assert timeline["device_busy_ms_per_call"] == pytest.approx(1.05)
    assert timeline["kernels_per_call"] == 2
    assert timeline["between_calls_ms_median"] == pytest.approx(0.3)
    assert timeline["launch_ms_median"] == pytest.approx(0.01)
    assert timeline["tail_ms_median"] == pytest.approx(0.02)
    assert timeline["device_after_return_share"] == 0
    assert [g["where"] for g in timeline["longest_gaps"]] == ["before call 2", "before call 3"]
    assert timeline["longest_gaps"][0]["after"] == "pack" and timeline["longest_gaps"][0]["before"] == "step"


@pytest.mark.unit
def test_the_entry_summary_names_a_state_leaf_that_is_not_donated():
    def call(weights, state):
        new = {"cache": state["cache"] + weights, "count": state["count"] + 1}
        return new, jnp.concatenate([new["count"], new["count"]])

    weights = jnp.ones((64, 32))
    state = {"cache": jnp.zeros((64, 32)), "count": jnp.zeros((1,), jnp.int32)}
    donated = profile.entry_summary(jax.jit(call, donate_argnums=1).lower(weights, state).compile().as_text())
    kept = profile.entry_summary(jax.jit(call).lower(weights, state).compile().as_text())
    assert donated["state_parameters_not_aliased"] == []
    assert {p["bytes"] for p in kept["state_parameters_not_aliased"]} == {64 * 32 * 4, 4}
    assert donated["ops_outside_loop"] >= 1 and donated["whiles_in_module"] == 0


@pytest.mark.unit
def test_the_profiled_loop_is_the_one_the_server_compiles():
    from dllm_jax.serve.assemble import ServeOptions, decode_config, request_defaults

    options = ServeOptions(model_name="random", batch_size=8, gen_length=128, max_model_len=384, threshold=2.0)
    served = decode_config("flash_cache", options)
    assert profile.server_decode_config(128, 8) == served
    assert profile.server_sampling(128).threshold == request_defaults(served, options)["threshold"]


@pytest.mark.engine
@pytest.mark.integration  # full tier: a script's whole run
def test_the_tiny_run_measures_every_part(tmp_path):
    opts = profile.parse_args(["--tiny", "--slots", "1", "--variants", "default", "--out", str(tmp_path)])
    profile.run(opts)
    report = json.loads((tmp_path / "call_profile.json").read_text())
    (row,) = report["configs"]
    assert "error" not in row and not report["skipped"]
    assert row["session"]["iterations_per_call"] == 1
    assert row["iterations"]["iterations"] == opts.iterations
    assert row["hlo"]["state_parameters_not_aliased"] == []
    assert row["trace"]["phase_a"]["calls"] == opts.trace_calls
    assert all(row[part]["ms_per_call"] > 0 for part in ("session", "thread", "back_to_back", "empty"))
    assert "| default | 1 |" in (tmp_path / "call_profile.md").read_text()
