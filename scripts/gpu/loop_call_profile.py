"""Where a server's one-iteration loop call spends its time, against Engine.generate's long calls.

    PYTHONPATH=. python3 scripts/gpu/loop_call_profile.py --budget-s 200 --out $OUT/call_profile   # H200, LLaDA-8B shape
    PYTHONPATH=. python scripts/gpu/loop_call_profile.py --tiny                                   # CPU smoke test

The server (scripts/gpu/serve_vs_engine.py) runs one loop iteration per call and Engine.generate
64; on the H200 at one slot a server call took 10.5 ms against the engine's 6.9 ms per
iteration. This script measures, for each variant and slot count (default 1 and 8), the
decode loop the server compiles (random LLaDA-8B-shape weights, flash_cache, one token per
step, prompts of 256 tokens, 128 generated), every slot decoding and nothing admitted:

  session       GenerationSession(stream=True).step(1) back to back, as the server's engine
                thread calls it: ms per call, and the calls' own time (dispatch to return, on the
                session's DeviceCalls thread);
  thread        the same calls queued on a DeviceCalls thread, nothing done between them;
  back_to_back  the compiled call with one iteration, called in a loop on this thread;
  iterations    one call of --iterations iterations (Engine.generate's way): ms per iteration;
  empty         an executable with the loop call's arguments and donation that does nothing (the
                dispatch of some 400 buffers);
  hlo           the compiled call's entry computation: the ops that run once per call outside
                the while loop and their bytes, the state leaves not aliased to an output, and
                the module's while loops and conditionals (each a host readback on XLA:GPU);
  trace         a jax.profiler trace of --trace-calls server-style calls (phase A), then one call
                of as many iterations (phase B): device busy, kernels and idle per call, the
                device time and kernels that run once per call rather than once per iteration
                (solved from the two phases), the longest device-idle gaps and the host events
                per call on the calls' thread.

Variants compile the same loop call with other XLA options, per executable
(Engine(compiler_options=...)): default (the engine's own), cmdbuf_off (no command buffers:
a CUDA graph's nodes are updated at a call whose buffers moved), cmdbuf_while (while loops and
conditionals in command buffers too: no host readback of their predicates). The empty call and
the entry computation are measured for the first variant only. An option that needs XLA_FLAGS
before jax starts (xla_gpu_command_buffer_update_mode, which switches the allocator) is a run
of its own: `XLA_FLAGS=... python3 scripts/gpu/loop_call_profile.py --variants default`.

--budget-s bounds the whole run: a part starts only when what was measured so far says it
fits (each compile is estimated from the last), and the report (call_profile.json,
call_profile.md in --out) is rewritten after each part.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench import random_prompts, tiny_config  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.engine.device_calls import DeviceCalls  # noqa: E402
from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.engine.session import GenerationSession  # noqa: E402
from dllm_jax.models.config import llada_8b_config  # noqa: E402
from dllm_jax.models.transformer import init_params_per_layer  # noqa: E402
from dllm_jax.runtime.decode_config import DecodeConfig  # noqa: E402
from dllm_jax.sampling.params import SamplingParams  # noqa: E402

_ALL_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
# name -> the XLA options the loop call is compiled with (None: the engine's own)
VARIANTS: dict[str, dict | None] = {
    "default": None,
    "cmdbuf_off": {"xla_gpu_enable_command_buffer": ""},
    "cmdbuf_while": {"xla_gpu_enable_command_buffer": _ALL_COMMANDS},
}
PARTS = ("session", "thread", "back_to_back", "iterations", "empty", "hlo", "trace")
# parts measured for the first variant only (the empty call is compiled with no options; the
# entry computation is the same program)
ONCE = ("empty", "hlo")
CALL_ANNOTATION = "dllm_loop_call"
PHASE_CALLS = "dllm_phase_calls"
PHASE_ITERATIONS = "dllm_phase_iterations"


@dataclasses.dataclass(frozen=True)
class Shape:
    """Sizes of one run: prompt and answer lengths, calls timed per part, the iterations of the
    long call, the calls traced, and the iterations before a state is steady."""

    prompt_len: int
    gen_length: int
    calls: int
    iterations: int
    trace_calls: int
    warm: int = 3

    def __post_init__(self):
        # a state serves warm + 2 long calls, a session warm + its calls (+ 2: the lag of its
        # reads), the trace a session's calls and a long call: every request must still be running
        longest = self.warm + max(2 * self.iterations, self.calls + 2, self.trace_calls + 2)
        if longest >= self.gen_length:
            raise ValueError(f"{self} needs {longest} iterations of a request of {self.gen_length} positions")


def server_decode_config(gen_length: int, slots: int) -> DecodeConfig:
    """The DecodeConfig dllm-serve compiles for flash_cache (dllm_jax.serve.assemble.decode_config
    with serve_vs_engine.py's ServeOptions; a test checks they agree). Not imported: the serve
    package needs the server's wheels, which the GPU image lacks."""
    return DecodeConfig(method="flash_cache", gen_length=gen_length, batch_size=slots, max_logprobs=0)


def server_sampling(gen_length: int) -> SamplingParams:
    """What serve_vs_engine.py's requests ask: threshold 2 (one token per step), gen_length tokens."""
    return SamplingParams(threshold=2.0, max_new_tokens=gen_length)


class Budget:
    """The run's deadline and the last compile's seconds, to skip a part that would not fit."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds if seconds else math.inf
        self.compile_s: float | None = None
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, what: str, seconds: float) -> bool:
        if seconds <= self.left():
            return True
        self.skipped.append(f"{what} (about {seconds:.0f} s, {max(self.left(), 0):.0f} s left)")
        print(f"skipped {self.skipped[-1]}", flush=True)
        return False


# ----------------------------------------------------------------------------- the timed parts


class AnnotatedCall:
    """A compiled loop call inside a profiler annotation (the trace finds each call's window)."""

    def __init__(self, call):
        self.call = call
        self.input_shardings = call.input_shardings

    def __call__(self, *args):
        with jax.profiler.TraceAnnotation(CALL_ANNOTATION):
            return self.call(*args)


def steady_state(compiled, weights, prompts, shape: Shape):
    """A state with every slot holding a request, after its first full pass and a few steps."""
    state = compiled.initial_state(prompts, server_sampling(shape.gen_length))
    return jax.block_until_ready(compiled.run(weights, state, shape.warm))


def fixed_inputs(compiled, iterations: int):
    """(control, ring ints, ring floats) on the device for calls that change nothing."""
    ring = compiled.packings.ring
    control = compiled.put_control(compiled.packings.control_vector(iterations, False, count=0))
    return (control, *compiled.put_ring(np.zeros((ring.num_ints,), np.int32), np.zeros((ring.num_floats,), np.float32)))


def started_session(engine, compiled, weights, prompts, shape: Shape) -> GenerationSession:
    """A server's session (stream=True) over `compiled` with every slot decoding."""
    session = GenerationSession(
        compiled, weights, max_prompt_len=shape.prompt_len, stream=True, defaults=engine.generation_defaults
    )
    for i, ids in enumerate(prompts):
        session.add(f"r{i}", ids, server_sampling(shape.gen_length))
    for _ in range(shape.warm):
        session.step(1)
    return session


def time_session(engine, compiled, weights, prompts, shape: Shape) -> dict:
    session = started_session(engine, compiled, weights, prompts, shape)
    seconds, before, first = [], session.call_seconds, session.timeline[-1][0]
    for _ in range(shape.calls):
        start = time.perf_counter()
        session.step(1)
        seconds.append(time.perf_counter() - start)
    calls_s, iterations = session.call_seconds - before, session.timeline[-1][0] - first
    session.reset()
    return {
        "ms_per_call": 1e3 * sum(seconds) / shape.calls,
        "ms_per_call_median": 1e3 * statistics.median(seconds),
        "ms_per_call_p90": 1e3 * float(np.percentile(seconds, 90)),
        "call_dispatch_to_return_ms": 1e3 * calls_s / shape.calls,
        "iterations_per_call": iterations / shape.calls,
    }


def time_thread(compiled, weights, prompts, shape: Shape) -> dict:
    inputs = fixed_inputs(compiled, 1)
    calls = DeviceCalls(compiled.call)
    jax.block_until_ready(
        calls.submit(weights, *inputs, state=steady_state(compiled, weights, prompts, shape)).result()
    )
    start, before = time.perf_counter(), calls.seconds
    queued = [calls.submit(weights, *inputs) for _ in range(shape.calls)]
    jax.block_until_ready(queued[-1].result())
    wall = time.perf_counter() - start
    out = {
        "ms_per_call": 1e3 * wall / shape.calls,
        "call_dispatch_to_return_ms": 1e3 * (calls.seconds - before) / shape.calls,
    }
    calls.drop_state()
    return out


def time_back_to_back(call, compiled, weights, prompts, shape: Shape, iterations: int = 1) -> dict:
    """`call` (the loop's, or one with its signature) back to back on this thread, each waited
    for: ms per call and the median dispatch (to return, before the wait)."""
    inputs = fixed_inputs(compiled, iterations)
    state = steady_state(compiled, weights, prompts, shape)
    state, report = call(weights, state, *inputs)
    jax.block_until_ready(report)
    dispatch = []
    start = time.perf_counter()
    for _ in range(shape.calls):
        t = time.perf_counter()
        state, report = call(weights, state, *inputs)
        dispatch.append(time.perf_counter() - t)
        jax.block_until_ready(report)
    wall = time.perf_counter() - start
    del state
    return {"ms_per_call": 1e3 * wall / shape.calls, "dispatch_ms_median": 1e3 * statistics.median(dispatch)}


def time_iterations(compiled, weights, prompts, shape: Shape) -> dict:
    """Two calls of shape.iterations iterations from a steady state: the faster's ms per iteration."""
    inputs = fixed_inputs(compiled, shape.iterations)
    state = steady_state(compiled, weights, prompts, shape)
    runs = []
    for _ in range(2):
        first = int(state.iteration)
        start = time.perf_counter()
        state, report = compiled.call(weights, state, *inputs)
        jax.block_until_ready(report)
        runs.append((time.perf_counter() - start, int(state.iteration) - first))
    seconds, iterations = min(runs, key=lambda r: r[0] / max(r[1], 1))
    return {"ms_per_iteration": 1e3 * seconds / max(iterations, 1), "iterations": iterations}


def empty_call(weights, state, control, ring_ints, ring_floats):
    """The loop call's signature, doing nothing: the state back (donated, so aliased) and a
    report of slices."""
    return state, (control[:1], ring_floats[:1], ring_ints[:1], ring_floats[:1])


def time_empty(compiled, weights, prompts, shape: Shape) -> dict:
    state = steady_state(compiled, weights, prompts, shape)
    start = time.perf_counter()
    call = (
        jax.jit(empty_call, donate_argnums=1, keep_unused=True)
        .lower(weights, state, *fixed_inputs(compiled, 1))
        .compile()
    )
    compile_s = time.perf_counter() - start
    del state
    return {**time_back_to_back(call, compiled, weights, prompts, shape), "compile_s": compile_s}


# ----------------------------------------------------------------------------- the entry computation

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES.update({"s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1})
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*)$")
_ALIAS = re.compile(r"\{[\d,]*\}: \((\d+), \{[\d,]*\}, (?:may|must)-alias\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NOT_WORK = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while"}


def type_bytes(hlo_type: str) -> int:
    """Bytes of an HLO type's arrays (a tuple's summed)."""
    return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(hlo_type))


def entry_summary(hlo: str, top: int = 12) -> dict:
    """What the entry computation of an optimized HLO module does once per call: its ops other
    than the while loop (count by opcode, bytes out, the largest), the 'state*' parameters not
    aliased to an output, and the module's while loops and conditionals."""
    header = hlo.split("\n", 1)[0]
    aliased = {int(p) for p in _ALIAS.findall(header)}
    lines = hlo.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("}"))
    ops, params = [], {}
    for line in lines[start + 1 : end]:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, hlo_type, opcode, rest = m.groups()
        if opcode == "parameter":
            params[int(rest.split(")", 1)[0])] = (name, type_bytes(hlo_type))
        elif opcode not in _NOT_WORK:
            op_name = _OP_NAME.search(rest)
            ops.append(
                {
                    "name": name,
                    "opcode": opcode,
                    "bytes": type_bytes(hlo_type),
                    "op_name": op_name.group(1)[-120:] if op_name else "",
                }
            )
    not_aliased = [
        {"name": n, "bytes": b}
        for i, (n, b) in sorted(params.items())
        if n.startswith("state") and b and i not in aliased
    ]
    return {
        "ops_outside_loop": len(ops),
        "by_opcode": dict(collections.Counter(op["opcode"] for op in ops).most_common()),
        "bytes_outside_loop": sum(op["bytes"] for op in ops),
        "largest_outside_loop": sorted(ops, key=lambda op: -op["bytes"])[:top],
        "state_parameters_not_aliased": not_aliased,
        "whiles_in_module": hlo.count(" while("),
        "conditionals_in_module": hlo.count(" conditional("),
    }


# ----------------------------------------------------------------------------- the trace


# Device tracks that summarize the streams' events (a module's or an op's span) instead of
# being kernels and copies themselves, where a trace has them.
_DERIVED_TRACKS = re.compile(r"XLA Modules|XLA Ops|Steps|Framework|Source|TensorFlow|Launch Stats")


@dataclasses.dataclass
class Trace:
    """A Perfetto trace's complete events: on device tracks (kernels and copies), on the host,
    and the device tracks' names with their event counts (derived ones included)."""

    device: list[dict]
    host: list[dict]
    device_tracks: dict[str, int]


def read_trace(trace_dir: Path) -> Trace:
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz written")
    trace = json.loads(gzip.open(files[0]).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    device_pids = {pid for pid, name in processes.items() if "/device:" in name}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device, tracks = [], collections.Counter()
    for e in complete:
        if e["pid"] in device_pids:
            track = f"{processes[e['pid']]} {threads.get((e['pid'], e.get('tid')), e.get('tid'))}"
            tracks[track] += 1
            if not _DERIVED_TRACKS.search(track):
                device.append(e)
    return Trace(
        device=sorted(device, key=lambda e: e["ts"]),
        host=sorted((e for e in complete if e["pid"] not in device_pids), key=lambda e: e["ts"]),
        device_tracks=dict(tracks),
    )


def busy_intervals(events: list[dict]) -> list[tuple[float, float, str, str]]:
    """The union of events' [ts, ts + dur) (µs) as (start, end, first name, last name), in order."""
    merged: list[list] = []
    for e in sorted(events, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if merged and s <= merged[-1][1]:
            if t > merged[-1][1]:
                merged[-1][1], merged[-1][3] = t, e["name"]
        else:
            merged.append([s, t, e["name"], e["name"]])
    return [tuple(m) for m in merged]


def solve_per_call(phase_a: tuple[float, float, float], phase_b: tuple[float, float, float]) -> tuple[float, float]:
    """(per call, per iteration) of a quantity measured as (calls, iterations, total) in two
    phases: total = calls * per_call + iterations * per_iteration."""
    (ca, ia, ta), (cb, ib, tb) = phase_a, phase_b
    det = ca * ib - ia * cb
    if not det:
        return math.nan, math.nan
    return (ta * ib - ia * tb) / det, (ca * tb - cb * ta) / det


def kernel_split(events_a, calls_a, iterations_a, events_b, calls_b, iterations_b, top: int = 15) -> dict:
    """Per kernel name, its launches and µs per call and per iteration, solved from phase A
    (many short calls) and phase B (few long ones); the kernels that run once per call."""
    stats = {}
    for key, events in (("a", events_a), ("b", events_b)):
        for e in events:
            s = stats.setdefault(e["name"], {"a": [0, 0.0], "b": [0, 0.0]})
            s[key][0] += 1
            s[key][1] += e["dur"]
    rows = []
    for name, s in stats.items():
        count = solve_per_call((calls_a, iterations_a, s["a"][0]), (calls_b, iterations_b, s["b"][0]))
        us = solve_per_call((calls_a, iterations_a, s["a"][1]), (calls_b, iterations_b, s["b"][1]))
        rows.append(
            {
                "name": name,
                "per_call": round(count[0], 2),
                "per_iteration": round(count[1], 2),
                "us_per_call": us[0],
                "us_per_iteration": us[1],
            }
        )
    total = solve_per_call(
        (calls_a, iterations_a, sum(e["dur"] for e in events_a)),
        (calls_b, iterations_b, sum(e["dur"] for e in events_b)),
    )
    launches = solve_per_call((calls_a, iterations_a, len(events_a)), (calls_b, iterations_b, len(events_b)))
    once = [r for r in rows if r["per_call"] >= 0.5]
    return {
        "device_us_fixed_per_call": total[0],
        "device_us_per_iteration": total[1],
        "kernels_fixed_per_call": launches[0],
        "kernels_per_iteration": launches[1],
        "once_per_call": sorted(once, key=lambda r: -r["us_per_call"])[:top],
        "once_per_call_count": len(once),
    }


def call_windows(host: list[dict], start: float, end: float) -> list[tuple[float, float, int]]:
    """(start, end, thread) of the annotated loop calls that start in [start, end)."""
    return [
        (e["ts"], e["ts"] + e["dur"], e["tid"]) for e in host if e["name"] == CALL_ANNOTATION and start <= e["ts"] < end
    ]


def phase(host: list[dict], name: str) -> tuple[float, float]:
    e = next(e for e in host if e["name"] == name)
    return e["ts"], e["ts"] + e["dur"]


_TIMELINE_FIELDS = (
    "device_busy_ms_per_call",
    "device_span_ms_per_call",
    "device_idle_ms_per_call",
    "kernels_per_call",
    "launch_ms_median",
    "tail_ms_median",
    "between_calls_ms_median",
    "device_after_return_share",
    "gaps_over_20us_per_call",
)


def calls_timeline(device: list[dict], calls: list[tuple[float, float, int]], top_gaps: int = 12) -> dict:
    """Device time around the calls of phase A: busy and idle per call, each call's launch (host
    start to its first kernel) and tail (last kernel to host return), the idle between calls,
    the share of device time after its call returned (a call that returns early: its events
    are then assigned to the call dispatched last before them), and the longest idle gaps."""
    n = len(calls)
    if not n or not device:  # no device tracks (the CPU)
        return {"calls": n, "longest_gaps": [], **dict.fromkeys(_TIMELINE_FIELDS)}
    intervals = busy_intervals(device)
    busy = sum(t - s for s, t, _, _ in intervals)
    span = intervals[-1][1] - intervals[0][0]
    owner = [[] for _ in calls]
    starts = [c[0] for c in calls]
    for e in device:
        i = max(0, np.searchsorted(starts, e["ts"], side="right") - 1)
        owner[i].append(e)
    after_return = sum(
        max(0.0, e["ts"] + e["dur"] - max(e["ts"], c[1])) for c, events in zip(calls, owner) for e in events
    )
    launch = [events[0]["ts"] - c[0] for c, events in zip(calls, owner) if events]
    tail = [c[1] - max(e["ts"] + e["dur"] for e in events) for c, events in zip(calls, owner) if events]
    between = [
        owner[i + 1][0]["ts"] - max(e["ts"] + e["dur"] for e in owner[i])
        for i in range(n - 1)
        if owner[i] and owner[i + 1]
    ]
    gaps = []
    for (_, t0, _, last), (s1, _, first, _) in zip(intervals, intervals[1:]):
        i = int(np.searchsorted(starts, s1, side="right")) - 1
        where = f"before call {i + 1}" if t0 <= starts[i] <= s1 else f"inside call {i + 1}"
        gaps.append({"us": s1 - t0, "where": where, "after": last[:80], "before": first[:80]})
    gaps.sort(key=lambda g: -g["us"])

    def median(values):
        return statistics.median(values) / 1e3 if values else None

    timeline = {
        "device_busy_ms_per_call": busy / 1e3 / n,
        "device_span_ms_per_call": span / 1e3 / n,
        "device_idle_ms_per_call": (span - busy) / 1e3 / n,
        "kernels_per_call": len(device) / n,
        "launch_ms_median": median(launch),
        "tail_ms_median": median(tail),
        "between_calls_ms_median": median(between),
        "device_after_return_share": after_return / max(sum(e["dur"] for e in device), 1e-9),
        "gaps_over_20us_per_call": sum(g["us"] > 20 for g in gaps) / n,
    }
    return {"calls": n, "longest_gaps": gaps[:top_gaps], **timeline}


def host_events_per_call(host: list[dict], calls: list[tuple[float, float, int]], top: int = 15) -> list[dict]:
    """Host events on the calls' thread inside the calls (inclusive µs per call), the largest."""
    if not calls:
        return []
    thread = calls[0][2]
    totals = collections.defaultdict(lambda: [0, 0.0])
    for e in host:
        if e["tid"] != thread or e["name"] == CALL_ANNOTATION:
            continue
        if any(s <= e["ts"] < t for s, t, _ in calls):
            totals[e["name"]][0] += 1
            totals[e["name"]][1] += e["dur"]
    rows = [
        {"name": k[:100], "per_call": n / len(calls), "us_per_call": us / len(calls)} for k, (n, us) in totals.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_call"])[:top]


def analyse_trace(trace: Trace, iterations_b: int) -> dict:
    a0, a1 = phase(trace.host, PHASE_CALLS)
    b0, b1 = phase(trace.host, PHASE_ITERATIONS)
    calls_a = call_windows(trace.host, a0, a1)
    calls_b = call_windows(trace.host, b0, b1)
    if not calls_a or not calls_b:
        raise RuntimeError(f"the trace holds {len(calls_a)} and {len(calls_b)} annotated calls in its two phases")
    # phase A's device events from its first call on (the warm-up's last call may still run at
    # the phase's start) up to phase B; phase B's from its call on
    device_a = [e for e in trace.device if calls_a[0][0] <= e["ts"] < b0]
    device_b = [e for e in trace.device if calls_b[0][0] <= e["ts"] <= b1]
    out = {
        "device_tracks": trace.device_tracks,
        "phase_a": calls_timeline(device_a, calls_a),
        "host_per_call": host_events_per_call(trace.host, calls_a),
    }
    if trace.device:
        out["split"] = kernel_split(device_a, len(calls_a), len(calls_a), device_b, len(calls_b), iterations_b)
    return out


def trace_calls(engine, compiled, weights, prompts, shape: Shape) -> dict:
    """Phase A: shape.trace_calls server-style calls; phase B: one call of as many iterations."""
    annotated = dataclasses.replace(compiled, call=AnnotatedCall(compiled.call))
    session = started_session(engine, annotated, weights, prompts, shape)
    inputs = fixed_inputs(compiled, shape.trace_calls)
    state = steady_state(compiled, weights, prompts, shape)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's own events would slow the host work measured
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True, profiler_options=options):
            with jax.profiler.TraceAnnotation(PHASE_CALLS):
                for _ in range(shape.trace_calls):
                    session.step(1)
                session.reset()  # waits for the last call
            first = int(state.iteration)
            with jax.profiler.TraceAnnotation(PHASE_ITERATIONS):
                state, report = annotated.call(weights, state, *inputs)
                jax.block_until_ready(report)
        start = time.perf_counter()
        trace = read_trace(Path(tmp))
    out = analyse_trace(trace, int(state.iteration) - first)
    out["read_s"] = time.perf_counter() - start
    return out


# ----------------------------------------------------------------------------- the run


def measure_config(engine, weights, config, slots: int, shape: Shape, parts, budget: Budget, report: dict, save):
    """Every part for one engine (a variant) and slot count, each only if it fits the budget;
    `report` is filled as parts finish and `save()` called after each."""
    guess = budget.compile_s * (1 + 0.1 * (slots - 1)) if budget.compile_s else 0.0
    if not budget.fits(f"{report['variant']} {slots} slots: compile", guess):
        report["skipped"] = "no budget for the compile"
        return
    start = time.perf_counter()
    compiled = engine.compile(server_decode_config(shape.gen_length, slots), shape.prompt_len)
    report["compile_s"] = budget.compile_s = time.perf_counter() - start
    print(f"  compiled in {report['compile_s']:.1f} s", flush=True)
    prompts = random_prompts(slots, shape.prompt_len, config.vocab_size, seed=slots)
    memory = compiled.call.memory_analysis() if hasattr(compiled.call, "memory_analysis") else None
    if memory is not None:
        report["memory_bytes"] = {
            k: getattr(memory, f"{k}_size_in_bytes", None) for k in ("argument", "output", "alias", "temp")
        }
    save()
    step_s = None  # seconds of one loop iteration, learned from the first part
    for part in parts:
        if part in ONCE and not report["first_variant"]:
            continue
        guess = 5.0 if step_s is None else (2 * shape.calls + 3 * shape.iterations + 10) * step_s
        guess += {"trace": 15.0, "empty": 5.0, "hlo": 5.0}.get(part, 0.0)
        if not budget.fits(f"{report['variant']} {slots} slots: {part}", guess):
            continue
        start = time.perf_counter()
        if part == "session":
            result = time_session(engine, compiled, weights, prompts, shape)
        elif part == "thread":
            result = time_thread(compiled, weights, prompts, shape)
        elif part == "back_to_back":
            result = time_back_to_back(compiled.call, compiled, weights, prompts, shape)
        elif part == "iterations":
            result = time_iterations(compiled, weights, prompts, shape)
        elif part == "empty":
            result = time_empty(compiled, weights, prompts, shape)
        elif part == "hlo":
            result = entry_summary(compiled.call.as_text())
        else:
            result = trace_calls(engine, compiled, weights, prompts, shape)
        result["seconds"] = time.perf_counter() - start
        report[part] = result
        timing = ", ".join(f"{k} {result[k]:.3f}" for k in ("ms_per_call", "ms_per_iteration") if k in result)
        print(f"  {part}: {timing or 'done'} ({result['seconds']:.1f} s)", flush=True)
        if step_s is None and part in ("session", "back_to_back", "iterations"):
            step_s = result.get("ms_per_call", result.get("ms_per_iteration")) / 1e3
        save()


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    lines = [
        f"# Loop call profile: {report['model']} on {report['device']}, {report['date']}",
        "",
        f"flash_cache, one token per step, prompts of {report['prompt_len']}, {report['gen_length']} generated, "
        "every slot decoding. ms per call (ms per iteration for the long call); fixed = back-to-back call - "
        "long call's iteration.",
        "",
        "| variant | slots | session | its calls | thread | back to back | long call /it | fixed | empty call | "
        "device busy /call | kernels /call | device idle /call | between calls | device fixed /call | kernels fixed /call |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["configs"]:
        s, b = r.get("session", {}), r.get("back_to_back", {})
        it, tr = r.get("iterations", {}), r.get("trace", {})
        a, split = tr.get("phase_a", {}), tr.get("split", {})
        fixed = b["ms_per_call"] - it["ms_per_iteration"] if b and it else None
        fixed_us = split.get("device_us_fixed_per_call")
        lines.append(
            f"| {r['variant']} | {r['slots']} | {fmt(s.get('ms_per_call'))} | {fmt(s.get('call_dispatch_to_return_ms'))} | "
            f"{fmt(r.get('thread', {}).get('ms_per_call'))} | {fmt(b.get('ms_per_call'))} | "
            f"{fmt(it.get('ms_per_iteration'))} | {fmt(fixed)} | {fmt(r.get('empty', {}).get('ms_per_call'), 3)} | "
            f"{fmt(a.get('device_busy_ms_per_call'))} | {fmt(a.get('kernels_per_call'), 0)} | "
            f"{fmt(a.get('device_idle_ms_per_call'))} | {fmt(a.get('between_calls_ms_median'), 3)} | "
            f"{fmt(None if fixed_us is None else fixed_us / 1e3, 3)} | {fmt(split.get('kernels_fixed_per_call'), 0)} |"
        )
    for r in report["configs"]:
        name = f"{r['variant']}, {r['slots']} slots"
        hlo = r.get("hlo")
        if hlo:
            lines += [
                "",
                f"## {name}: the entry computation (once per call, outside the while loop)",
                "",
                f"{hlo['ops_outside_loop']} ops ({', '.join(f'{k} {v}' for k, v in hlo['by_opcode'].items())}), "
                f"{hlo['bytes_outside_loop'] / 2**20:.2f} MiB written; while loops in the module "
                f"{hlo['whiles_in_module']}, conditionals {hlo['conditionals_in_module']}; state parameters not "
                f"aliased: {[p['name'] for p in hlo['state_parameters_not_aliased']] or 'none'}.",
                "",
                "| MiB | opcode | name | op_name |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {op['bytes'] / 2**20:.3f} | {op['opcode']} | {op['name']} | {op['op_name']} |"
                for op in hlo["largest_outside_loop"][:8]
            ]
        tr = r.get("trace")
        if not tr:
            continue
        a = tr["phase_a"]
        lines += [
            "",
            f"## {name}: trace of {a['calls']} server-style calls",
            "",
            f"launch (call start to first kernel) {fmt(a['launch_ms_median'], 3)} ms, tail (last kernel to return) "
            f"{fmt(a['tail_ms_median'], 3)} ms, device idle gaps over 20 us per call {fmt(a['gaps_over_20us_per_call'], 1)}, "
            f"device time after its call returned {fmt(a['device_after_return_share'], 3)}.",
        ]
        if tr.get("split"):
            lines += ["", "| once per call: kernel | per call | per iteration | us per call |", "|---|---|---|---|"]
            lines += [
                f"| {k['name'][:90]} | {k['per_call']} | {k['per_iteration']} | {fmt(k['us_per_call'], 1)} |"
                for k in tr["split"]["once_per_call"][:10]
            ]
        lines += ["", "| longest device-idle gaps: us | where | after | before |", "|---|---|---|---|"]
        lines += [f"| {g['us']:.0f} | {g['where']} | {g['after']} | {g['before']} |" for g in a["longest_gaps"][:8]]
        lines += ["", "| host events on the calls' thread | per call | us per call |", "|---|---|---|"]
        lines += [f"| {h['name']} | {h['per_call']:.1f} | {h['us_per_call']:.0f} |" for h in tr["host_per_call"][:10]]
    if report["skipped"]:
        lines += ["", f"Skipped: {'; '.join(report['skipped'])}."]
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny random model, short prompts")
    p.add_argument("--slots", nargs="+", type=int, default=[1, 8])
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--calls", type=int, help="calls timed per part (default 30; tiny 8)")
    p.add_argument("--iterations", type=int, help="iterations of the long call (default 32; tiny 8)")
    p.add_argument(
        "--trace-calls", type=int, help="calls traced, and the long traced call's iterations (default 10; tiny 4)"
    )
    p.add_argument("--budget-s", type=float, default=0.0, help="seconds the whole run may take (0: no bound)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "call_profile")
    opts = p.parse_args(argv)
    tiny = opts.tiny
    opts.calls = opts.calls or (8 if tiny else 30)
    opts.iterations = opts.iterations or (8 if tiny else 32)
    opts.trace_calls = opts.trace_calls or (4 if tiny else 10)
    if min(opts.calls, opts.iterations - 1, opts.trace_calls - 1, *opts.slots) < 1:
        p.error("--calls, --slots >= 1; --iterations, --trace-calls >= 2")
    return opts


def run(opts) -> dict:
    """Measures every variant and slot count of `opts` (parse_args) and writes the report."""
    budget = Budget(opts.budget_s)
    config = tiny_config() if opts.tiny else llada_8b_config()
    shape = (
        Shape(16, 32, opts.calls, opts.iterations, opts.trace_calls)
        if opts.tiny
        else Shape(256, 128, opts.calls, opts.iterations, opts.trace_calls)
    )
    start = time.perf_counter()
    weights = jax.block_until_ready(init_params_per_layer(config, jax.random.key(0)))
    report = {
        "model": "tiny" if opts.tiny else "LLaDA-8B",
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "weights_s": time.perf_counter() - start,
        "prompt_len": shape.prompt_len,
        "gen_length": shape.gen_length,
        "shape": dataclasses.asdict(shape),
        "configs": [],
        "skipped": budget.skipped,
    }
    print(f"random weights on {jax.devices()[0]} in {report['weights_s']:.1f} s", flush=True)

    def save():
        write_text_atomically(opts.out / "call_profile.json", json.dumps(report, indent=1))
        write_text_atomically(opts.out / "call_profile.md", markdown(report) + "\n")

    # the default variant at every slot count first, then the others one slot count at a time
    order = [(v, s) for s in opts.slots for v in opts.variants[:1]] + [
        (v, s) for s in opts.slots for v in opts.variants[1:]
    ]
    for variant, slots in order:
        # an engine per configuration: its compiled loop goes with it, before the next compile
        engine = Engine(config, weights, backend="auto", compiler_options=VARIANTS[variant])
        row = {"variant": variant, "slots": slots, "compiler_options": VARIANTS[variant]}
        row["first_variant"] = variant == opts.variants[0]
        report["configs"].append(row)
        print(f"[{variant}, {slots} slots]", flush=True)
        try:
            measure_config(engine, weights, config, slots, shape, opts.parts, budget, row, save)
        except Exception as e:  # a variant XLA refuses fails alone
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[{variant}, {slots} slots] failed: {row['error'][:300]}", flush=True)
        del engine
        save()
    report["total_s"] = time.perf_counter() - start
    save()
    print(markdown(report), flush=True)
    return report


def main(argv=None) -> int:
    opts = parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    report = run(opts)
    return 0 if not any("error" in r for r in report["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
