"""The server's commit-to-chunk latency on the CPU, with no model: the real app, worker and
HTTP stack over tests/fake_session.py's FakeSession, streaming load from scripts/load_test.py.

    PYTHONPATH=. python scripts/serve_chunk_latency.py                       # 8 and 32 slots, canvas off and on
    PYTHONPATH=. python scripts/serve_chunk_latency.py --configs 32 --repeats 3
    PYTHONPATH=. python scripts/serve_chunk_latency.py --configs 32:canvas --profile 15   # + the event loop's profile
    PYTHONPATH=. python scripts/serve_chunk_latency.py --configs 32 --dispatch-ms 3 --streams-first-ms 0 5
                                      # 3 ms of lock-holding work per call; the engine thread's wait off, on

Each configuration is SLOTS or SLOTS:canvas (the requests ask for the canvas stream). A run
starts the server in this process (uvicorn on 127.0.0.1, a free port) over one FakeSession of
SLOTS slots whose step call first works --dispatch-ms in Python (holding the interpreter lock,
as the engine prepares and dispatches its next call), then takes --step-ms and commits
--per-step positions of every running request, then sends 2 x SLOTS streaming
/v1/completions at once from load_test.py in a subprocess (its own interpreter). Every prompt
is --gen-length characters, so each step adds stable text to every stream: a step's chunks for all its slots reach the event loop together,
as on an engine at full batch. Reported per run: the dllm_commit_to_chunk_seconds samples
(from the engine thread's receipt of a step's commits to their chunk being yielded; the exact
values, not the histogram's buckets): count, mean, p50, p99, max; the event loop thread's CPU
time per chunk over the load (all of its work: requests, chunks, teardown) and within a step's
burst (from its first chunk to its last, per chunk: the median over steps; and the longest
step's, whole): CPU times, which a shared machine's scheduling does not inflate as it does the
latencies; and the load's errors.

--profile N prints the N costliest functions (cumulative) of cProfile on the event loop's
thread during each run. Bounded: --timeout per load; the client is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import math
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from scripts.load_test import percentile  # noqa: E402
from tests.fake_session import FakeSession, ThreadedServer  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["8", "8:canvas", "32", "32:canvas"], help="SLOTS or SLOTS:canvas")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (default 1)")
    p.add_argument("--step-ms", type=float, default=100.0, help="wall time of one fake step (default 100)")
    p.add_argument("--gen-length", type=int, default=32, help="answer positions (default 32)")
    p.add_argument(
        "--dispatch-ms",
        type=float,
        default=0.0,
        help="Python work (holding the interpreter lock) at the start of every step call, as the engine "
        "prepares and dispatches the next call (default 0)",
    )
    p.add_argument(
        "--streams-first-ms",
        type=float,
        nargs="+",
        default=None,
        help="run each configuration once per value of the worker's streams_first_max_seconds, in ms "
        "(0: the engine thread does not wait for the streams; default: the worker's own)",
    )
    p.add_argument("--per-step", type=int, default=2, help="positions committed per step (default 2)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per load (default 120)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the event loop's N costliest functions")
    p.add_argument("--output", type=Path, help="write the report as JSON here")
    opts = p.parse_args(argv)
    if opts.dispatch_ms < 0:
        p.error(f"--dispatch-ms {opts.dispatch_ms:g}: expected >= 0")
    for value in opts.streams_first_ms or ():
        if value < 0:
            p.error(f"--streams-first-ms {value:g}: expected >= 0")
    for config in opts.configs:
        slots, _, canvas = config.partition(":")
        if not slots.isdigit() or int(slots) < 1 or canvas not in ("", "canvas"):
            p.error(f"--configs {config}: expected SLOTS or SLOTS:canvas")
    return opts


class SampleRecorder:
    """Stands in for the commit-to-chunk Histogram: keeps every observed value with the time the
    engine thread received its step (perf_counter) and the observing thread's CPU time then."""

    def __init__(self):
        self.samples: list[float] = []
        self.received: list[float] = []
        self.cpu: list[float] = []

    def observe(self, value: float) -> None:
        self.cpu.append(time.thread_time())
        self.received.append(time.perf_counter() - value)
        self.samples.append(value)

    def step_bursts(self) -> list[tuple[int, float]]:
        """(chunks, the event loop's CPU time from the first to the last) of each step."""
        steps: dict[float, list[float]] = {}
        for received, cpu in zip(self.received, self.cpu):
            key = next((k for k in steps if abs(k - received) < 1e-6), received)
            steps.setdefault(key, []).append(cpu)
        return [(len(c), max(c) - min(c)) for c in steps.values()]


def burst_summary(bursts: list[tuple[int, float]]) -> dict:
    """The median over steps of the CPU per further chunk of a step, and the longest step's CPU
    from its first chunk to its last: what the last stream of a step waits, scheduling aside."""
    per_chunk = [cpu / (n - 1) for n, cpu in bursts if n >= 4]
    return {
        "burst_cpu_us_per_chunk": 1e6 * statistics.median(per_chunk) if per_chunk else math.nan,
        "longest_burst_cpu_ms": 1e3 * max(cpu for _, cpu in bursts),
    }


def summary(samples: list[float]) -> dict:
    ms = [1000 * s for s in samples]
    return {
        "count": len(ms),
        "mean_ms": statistics.fmean(ms),
        "p50_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
    }


def run_load(url: str, requests: int, prompt_length: int, canvas: bool, timeout: float, workdir: Path) -> dict:
    """load_test.py in a subprocess: `requests` streams at once; its report."""
    prompts = workdir / "prompts.jsonl"
    letters = "abcdefghijklmnopqrstuvwxyz"
    prompts.write_text(
        "".join(json.dumps({"prompt": (letters[i % 26] * prompt_length)}) + "\n" for i in range(requests))
    )
    report = workdir / "load.json"
    command = [
        sys.executable,
        str(ROOT / "scripts" / "load_test.py"),
        "--url",
        url,
        "--rate",
        "inf",
        "--requests",
        str(requests),
        "--prompts-file",
        str(prompts),
        "--timeout",
        str(timeout),
        "--output",
        str(report),
    ]
    if canvas:
        command += ["--dllm", json.dumps({"canvas": True})]
    client = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = client.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        client.kill()  # this PID only
        client.wait()
        raise RuntimeError("the load did not finish in time") from None
    if client.returncode != 0:
        raise RuntimeError(f"load_test.py exited with {client.returncode}: {err[-2000:]}")
    return json.loads(report.read_text())["runs"][0]


def on_loop(loop, fn):
    """fn() run on the event loop's thread; its value."""
    return asyncio.run_coroutine_threadsafe(_call(fn), loop).result(timeout=30)


async def _call(fn):
    return fn()


def one_run(opts, slots: int, canvas: bool, streams_first_ms: float | None = None) -> dict:
    """One load on a fake-session server; streams_first_ms sets its worker's wait for the streams
    after each call (None: the worker's default)."""
    session = FakeSession(
        num_slots=slots,
        gen_length=opts.gen_length,
        max_prompt_len=opts.gen_length,
        step_seconds=opts.step_ms / 1000,
        per_step=opts.per_step,
        dispatch_seconds=opts.dispatch_ms / 1000,
    )
    server = ThreadedServer({"fake": session}, max_waiting=4 * slots, api_key=None, model="fake")
    if streams_first_ms is not None:
        server.worker.streams_first_max_seconds = streams_first_ms / 1000
    recorder = SampleRecorder()
    server.metrics.commit_to_chunk_seconds = recorder
    loop = server.server.servers[0].get_loop()
    profiler = cProfile.Profile() if opts.profile else None
    try:
        if profiler is not None:
            loop.call_soon_threadsafe(profiler.enable)  # profiles the thread that runs it
        loop_cpu_before = on_loop(loop, time.thread_time)
        with tempfile.TemporaryDirectory(prefix="chunk-latency-") as workdir:
            load = run_load(server.url, 2 * slots, opts.gen_length - 1, canvas, opts.timeout, Path(workdir))
        loop_cpu = on_loop(loop, time.thread_time) - loop_cpu_before
        if profiler is not None:
            on_loop(loop, profiler.disable)
    finally:
        server.stop()
    result = {
        "slots": slots,
        "canvas": canvas,
        "streams_first_ms": 1e3 * server.worker.streams_first_max_seconds,
        "requests": load["requests"],
        "ok": load["ok"],
        "errors": load["errors"],
        "wall_s": load["wall_s"],
        **summary(recorder.samples),
        "loop_cpu_us_per_chunk": 1e6 * loop_cpu / max(len(recorder.samples), 1),
        **burst_summary(recorder.step_bursts()),
    }
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(opts.profile)
        stats.sort_stats("tottime").print_stats(opts.profile)
    return result


COLUMNS = (
    "slots",
    "canvas",
    "streams first ms",
    "chunks",
    "mean ms",
    "p50 ms",
    "p99 ms",
    "max ms",
    "loop CPU us/chunk",
    "burst CPU us/chunk",
    "longest burst CPU ms",
    "ok",
    "wall s",
)


def row(r: dict) -> str:
    cells = (
        r["slots"],
        "on" if r["canvas"] else "off",
        f"{r['streams_first_ms']:g}",
        r["count"],
        *(f"{r[k]:.2f}" for k in ("mean_ms", "p50_ms", "p99_ms", "max_ms")),
        *(f"{r[k]:.0f}" for k in ("loop_cpu_us_per_chunk", "burst_cpu_us_per_chunk")),
        f"{r['longest_burst_cpu_ms']:.2f}",
        f"{r['ok']}/{r['requests']}",
        f"{r['wall_s']:.1f}",
    )
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv=None) -> int:
    opts = parse_args(argv)
    runs = []
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    with tempfile.TemporaryDirectory(prefix="chunk-latency-log-") as logs:
        # as dllm-serve logs (a line per request), into a file
        with open(Path(logs) / "server.log", "w") as log_file:
            logging.basicConfig(level=logging.INFO, stream=log_file, force=True)
            for config in opts.configs:
                slots, _, canvas = config.partition(":")
                for _ in range(opts.repeats):
                    for value in opts.streams_first_ms or [None]:
                        runs.append(one_run(opts, int(slots), bool(canvas), value))
                        print(row(runs[-1]), flush=True)
            logging.getLogger().handlers.clear()
    if opts.output is not None:
        write_text_atomically(
            opts.output, json.dumps({"options": vars(opts) | {"output": str(opts.output)}, "runs": runs})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
