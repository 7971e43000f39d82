"""The server under saturating load against Engine.generate on the same requests, and its
latency-throughput curve, within a time budget.

    PYTHONPATH=.:gpu_serve_deps python scripts/gpu/serve_vs_engine.py --budget-s 450   # H200: the issue's table and curve
    PYTHONPATH=. python scripts/gpu/serve_vs_engine.py --smoke                         # CPU: a tiny random model
    PYTHONPATH=. python scripts/gpu/serve_vs_engine.py --smoke --blocking-calls        # CPU, calls blocking as on XLA:GPU

Each configuration is SLOTS or SLOTS:canvas (the requests ask for the canvas stream); default
1, 1:canvas, 8, 8:canvas, 32, 32:canvas (smoke: 1, 1:canvas, 8, 8:canvas). The weights are made
once; each slot count gets one server (its loop compiled and warmed up) for its configurations,
each of max(4, 2 x SLOTS) requests (--requests overrides), all at once. On the last slot
count's server, --curve-rates then runs open-loop Poisson arrivals at each offered rate
(default 1 1.5 2 3 inf, around LLaDA-8B's 2.4 requests/s at 32 slots on an H200; smoke: 2 8
inf), plain streams, and draws latency against throughput (serve_curve.png, where matplotlib
is installed).

Random weights make confidences meaningless, so every request runs the equal-work schedule of
bench.py ("one": threshold 2, one token per step, flash_cache, one loop iteration per call).
The server runs in this process (uvicorn on 127.0.0.1, its engine thread owning the device);
the load comes from scripts/load_test.py in a subprocess (its own interpreter: the client does
not compete for this one's interpreter lock), streaming with usage. Then Engine.generate
decodes the same token-id prompts with the same DecodeConfig and compiled loop (64 iterations
per call; once per slot count). Reported per configuration: completion tokens/s of both and
their ratio (the issue's target: at least 0.95), the server's step time (dllm_step_seconds),
the engine's time per iteration, the share of the load's wall time the server's loop calls took
(dispatch to return: on XLA:GPU, where a call returns when the device is done, how busy the
server kept the device), and the time from the loop call that returned a commit to the chunk
carrying it (dllm_commit_to_chunk_seconds; target p99 <= 5 ms; every sample is kept, so the
table's mean, p50, p99 and max are exact, not the histogram's buckets), and the part of it
before the event loop starts handing a step's events to their streams ("to the event loop":
from the same receipt to dllm_jax.serve.worker._put_all, once per step and event loop).
--switch-intervals-ms measures each configuration once per interpreter switch interval
(sys.setswitchinterval: how long a thread that wants the interpreter lock waits for the one
holding it; Python's default is 5 ms): the event loop sending a step's chunks and the engine
thread preparing the next call share one interpreter. --streams-first-ms likewise measures each
configuration once per bound of the engine thread's wait for the event loop to send a step's
chunks before it prepares the next call (EngineWorker.streams_first_max_seconds; 0: no
wait), on the same server: an A/B of that wait within one run. --gc-freeze on off measures each
configuration with the startup heap frozen (as the server runs: dllm_jax.serve.heap) and with it
unfrozen for the measurement; every garbage collection's pause is recorded either way. Each
configuration's report also lists its ten longest commit-to-chunk samples, each with the
collection pause inside it and when in the load it came (the tail's cause: a collection, or
the requests that all end at one step).

--budget-s bounds the whole run (weights, compiles, loads): before each configuration and curve
rate the script estimates its time from what it measured so far (compile and warm-up, the
engine's time per iteration against slots) and skips it, saying so, when it would not fit; a
load still running when the budget ends is cut (its server keeps what it counted). The report
(serve_bench.json, serve_bench.md in --out, default $OUT or ./out) is rewritten after each
slot count, so a run cut short keeps what it measured.

--blocking-calls (CPU only) makes every loop call return only when its results are ready
(jax.block_until_ready), as XLA:GPU's do (it reads every while-loop condition back to the host),
for the server and Engine.generate alike: the CPU then shows the host overhead a GPU server
would have. (XLA:CPU's own synchronous dispatch does not do it: it runs parallel computations,
the decode loop's among them, asynchronously still.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import httpx  # noqa: E402
import jax  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.models.config import ModelConfig, llada_8b_config  # noqa: E402
from dllm_jax.models.transformer import init_params, init_params_per_layer  # noqa: E402
from dllm_jax.sampling.params import SamplingParams  # noqa: E402
from dllm_jax.serve import worker as serve_worker  # noqa: E402
from dllm_jax.serve.assemble import ServeOptions, assemble, decode_config, request_defaults  # noqa: E402
from scripts.load_test import percentile  # noqa: E402

METHOD = "flash_cache"


class IdTokenizer:
    """Renders token ids as text ("<id>") for a model without a tokenizer (random weights)."""

    has_chat_template = False

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            if int(i) == self.eos_id:
                break
            out.append(f"<{int(i)}>")
        return "".join(out)


def tiny_config() -> ModelConfig:
    return ModelConfig(
        d_model=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        mlp_hidden_size=256,
        vocab_size=256,
        mask_token_id=255,
        eos_token_id=254,
        pad_token_id=254,
        max_sequence_length=1024,
        dtype="float32",
    )


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny random model, short prompts and answers")
    p.add_argument("--configs", nargs="+", help="SLOTS or SLOTS:canvas, one server each (see the module help)")
    p.add_argument("--requests", type=int, help="requests per configuration (default max(4, 2 x slots))")
    p.add_argument("--gen-length", type=int, help="answer positions (default 128; smoke 32)")
    p.add_argument("--prompt-length", type=int, help="prompt tokens (default 256; smoke 16)")
    p.add_argument("--iterations-per-call", type=int, default=1, help="server loop iterations per device call")
    p.add_argument("--curve-rates", nargs="*", help="offered requests/s for the last server's curve (inf: all at once)")
    p.add_argument("--curve-requests", type=int, help="requests per rate of the curve (default 2 x slots)")
    p.add_argument("--repeats", type=int, default=1, help="loads (and engine runs) per configuration; medians")
    p.add_argument("--budget-s", type=float, default=0.0, help="seconds the whole run may take (0: no bound)")
    p.add_argument("--blocking-calls", action="store_true", help="CPU only: loop calls return when done, as on XLA:GPU")
    p.add_argument(
        "--switch-intervals-ms",
        type=float,
        nargs="+",
        default=[None],
        help="measure each configuration once per interpreter switch interval (sys.setswitchinterval; default Python's)",
    )
    p.add_argument(
        "--streams-first-ms",
        type=float,
        nargs="+",
        default=[None],
        help="measure each configuration once per value of the worker's streams_first_max_seconds, in ms "
        "(0: the engine thread does not wait for the streams; default: the worker's own)",
    )
    p.add_argument(
        "--gc-freeze",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="measure each configuration with the server's startup heap frozen (on: as it serves, "
        "dllm_jax.serve.heap) and/or unfrozen for the measurement (off)",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    defaults = (
        dict(configs=["1", "1:canvas", "8", "8:canvas"], gen_length=32, prompt_length=16, curve_rates=["2", "8", "inf"])
        if opts.smoke
        else dict(
            configs=["1", "1:canvas", "8", "8:canvas", "32", "32:canvas"],
            gen_length=128,
            prompt_length=256,
            curve_rates=["1", "1.5", "2", "3", "inf"],
        )
    )
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    try:
        opts.configs = [(int(c.split(":")[0]), c.endswith(":canvas")) for c in opts.configs]
        opts.curve_rates = [float(r) for r in opts.curve_rates]
    except ValueError:
        p.error(f"--configs {opts.configs} / --curve-rates {opts.curve_rates}: expected SLOTS[:canvas] and numbers")
    if any(s < 1 for s, _ in opts.configs) or any(not r > 0 for r in opts.curve_rates):
        p.error("--configs: slots >= 1; --curve-rates: > 0 (inf: all at once)")
    for name in ("requests", "gen_length", "prompt_length", "iterations_per_call", "curve_requests", "repeats"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}={value}: expected >= 1")
    if opts.budget_s < 0:
        p.error(f"--budget-s={opts.budget_s}: expected >= 0 (0: no bound)")
    if any(ms is not None and not ms >= 0 for ms in opts.streams_first_ms):
        p.error(f"--streams-first-ms {opts.streams_first_ms}: expected numbers >= 0")
    return opts


class Budget:
    """The run's deadline and what it learned about its costs, to skip what would not fit."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds if seconds else math.inf
        self.step_ms: dict[int, float] = {}  # slots -> the engine's ms per iteration
        self.compile_s = 0.0  # the longest compile + warm-up seen

    def left(self) -> float:
        return self.end - time.monotonic()

    def ms_per_iteration(self, slots: int) -> float | None:
        """The engine's ms per iteration at `slots`, from the measured slot counts (a line
        through them; one point: in proportion to the slots, an overestimate); None: none yet."""
        known = sorted(self.step_ms.items())
        if not known:
            return None
        if len(known) == 1:
            ((s0, m0),) = known
            return m0 * max(1.0, slots / s0)
        (s0, m0), (s1, m1) = known[-2], known[-1]
        slope = (m1 - m0) / (s1 - s0)
        return max(m0 + slope * (slots - s0), min(m for _, m in known))

    def load_s(self, slots: int, requests: int, gen_length: int) -> float:
        """Seconds one saturating load (or one Engine.generate) of these requests should take."""
        ms = self.ms_per_iteration(slots)
        return 0.0 if ms is None else 1.3 * math.ceil(requests / slots) * (gen_length + 2) * ms / 1e3 + 5.0

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


def histogram(samples: dict[str, float], name: str, before: dict[str, float] | None = None) -> dict:
    """Mean and bucket quantiles (upper bounds) of a Prometheus histogram from /metrics samples
    (of what it counted since the `before` samples, when given)."""
    before = before or {}
    counts = {k: v - before.get(k, 0.0) for k, v in samples.items() if k.startswith(name)}
    count = counts.get(f"{name}_count", 0.0)
    if not count:
        return {"count": 0}
    buckets = sorted(
        (float(k.split('le="')[1].rstrip('"}')), v) for k, v in counts.items() if k.startswith(f"{name}_bucket")
    )

    def quantile(q):
        return next((le for le, c in buckets if c >= q * count), None)

    return {
        "count": count,
        "mean_s": counts[f"{name}_sum"] / count,
        "p50_le_s": quantile(0.5),
        "p99_le_s": quantile(0.99),
    }


class ExactSamples:
    """Keeps every value a prometheus Histogram observes besides the histogram itself (the
    commit-to-chunk p99 against a 5 ms target needs more than its 2.5 / 5 / 10 ms buckets)."""

    def __init__(self, histogram):
        self.values: list[float] = []
        self.times: list[float] = []  # time.perf_counter() at each observation
        observe = histogram.observe

        def recording(value, *args, **kwargs):
            self.values.append(value)
            self.times.append(time.perf_counter())
            return observe(value, *args, **kwargs)

        histogram.observe = recording

    def summary(self, start: int) -> dict:
        """Mean, p50, p99 and max in seconds of the values observed since index `start`."""
        return summarize(self.values[start:])


def longest_with_pauses(chunks: ExactSamples, start: int, pauses: list[ExactSamples], n: int = 10) -> list[dict]:
    """The n longest commit-to-chunk samples since index `start`, each with the garbage-collection
    pause time (ms, any generation) that ended inside its interval (which of the tail the
    collector made) and when it was observed (s after the first sample since `start`)."""
    intervals = sorted(zip(chunks.values[start:], chunks.times[start:]), reverse=True)[:n]
    ended = [(t - v, t) for p in pauses for v, t in zip(p.values, p.times)]
    first = chunks.times[start] if len(chunks.times) > start else 0.0
    return [
        {
            "ms": 1e3 * value,
            "gc_ms": 1e3 * sum(end - max(begin, at - value) for begin, end in ended if at - value < end <= at),
            "at_s": at - first,
        }
        for value, at in intervals
    ]


class LoopWakeSamples:
    """For every step's events, the seconds from the engine thread's receipt of the commits
    (Event.received) to the event loop starting to hand them to their streams (worker._put_all,
    which deliver_all schedules with call_soon_threadsafe): the part of commit-to-chunk spent
    before any stream runs, waking the loop and waiting for the interpreter lock. Records until
    close(), which puts the worker's own _put_all back."""

    def __init__(self):
        self.values: list[float] = []
        self._put_all = put_all = serve_worker._put_all

        def recording(loop, items, done):
            received = max((event.received for _, event in items), default=0.0)
            if received:
                self.values.append(time.perf_counter() - received)
            return put_all(loop, items, done)

        serve_worker._put_all = recording

    def close(self) -> None:
        serve_worker._put_all = self._put_all


class LoadSpans:
    """When the server admitted a load's first request and handed out its last result
    (time.monotonic()), recorded in the worker's own calls: the load's span inside the server,
    without the client's process start and HTTP round trips. reset() before each load; close()
    puts the worker's methods back."""

    def __init__(self, worker):
        self.first_admit: float | None = None
        self.last_result: float | None = None
        self._worker = worker
        admit = worker._admit
        self._deliver_all = deliver_all = serve_worker.deliver_all

        def recording_admit(arrived):
            if arrived and self.first_admit is None:
                self.first_admit = time.monotonic()
            return admit(arrived)

        def recording_deliver(deliveries):
            if any(event.result is not None for _, event in deliveries):
                self.last_result = time.monotonic()
            return deliver_all(deliveries)

        worker._admit = recording_admit
        serve_worker.deliver_all = recording_deliver

    def reset(self) -> None:
        self.first_admit = self.last_result = None

    def close(self) -> None:
        del self._worker._admit  # the instance attribute: the class's method again
        serve_worker.deliver_all = self._deliver_all


def summarize(values: list[float]) -> dict:
    """Count, mean, p50, p99 and max in seconds."""
    if not values:
        return {"count": 0}
    at = functools.partial(percentile, values)
    return {
        "count": len(values),
        "mean_s": statistics.fmean(values),
        "p50_s": at(0.5),
        "p99_s": at(0.99),
        "max_s": max(values),
    }


def heap_state(row: dict) -> str:
    """Whether the row's load ran with the startup heap frozen (the server's default) or not."""
    return "frozen" if row.get("gc_freeze", "on") == "on" else "unfrozen"


def gc_cells(row: dict) -> str:
    """The report's GC cells: frozen or not, then collections (of them generation 2) / the longest pause."""
    pauses = row.get("gc_pauses", [])
    count = sum(p["count"] for p in pauses)
    longest = max((p["max_s"] for p in pauses if p["count"]), default=None)
    full = pauses[-1]["count"] if pauses else 0
    return f"{heap_state(row)} | {count} ({full}) / {ms(longest)}"


def read_metrics(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def start_server(server):
    import uvicorn

    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    return uv, thread, f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"


def load(url: str, opts, config, requests: int, rates: list[float], out: Path, canvas: bool, timeout: float, plot=None):
    """scripts/load_test.py in its own interpreter (never this one's): its report's runs, or
    None when the budget cut it."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parents[1] / "load_test.py"),
        "--url",
        url,
        "--rate",
        *[str(r) for r in rates],
        "--requests",
        str(requests),
        "--prompt-ids",
        str(opts.prompt_length),
        "--vocab",
        str(config.vocab_size - 2),
        "--max-tokens",
        str(opts.gen_length),
        "--seed",
        "7",
        "--output",
        str(out),
    ]
    cmd += ["--dllm", '{"canvas": true}'] if canvas else []
    cmd += ["--plot", str(plot)] if plot is not None else []
    try:
        subprocess.run(cmd, check=True, timeout=max(timeout, 1.0), env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.read_text())["runs"]


def same_prompts(config, opts, requests: int) -> list[list[int]]:
    """The token-id prompts load_test.py --prompt-ids --seed 7 sends."""
    rng = random.Random(7)
    return [[rng.randrange(config.vocab_size - 2) for _ in range(opts.prompt_length)] for _ in range(requests)]


def engine_run(engine, config, opts, options: ServeOptions, requests: int) -> dict:
    decode = decode_config(METHOD, options)
    prompts = same_prompts(config, opts, requests)
    out = engine.generate(prompts, SamplingParams(**request_defaults(decode, options)), decode_config=decode)
    rate = out.stats.completion_tokens / out.stats.wall_seconds
    return {
        "tokens": out.stats.completion_tokens,
        "wall_s": out.stats.wall_seconds,
        "tokens_per_s": rate,
        "iterations": out.stats.iterations,
        "ms_per_iteration": 1e3 * out.stats.wall_seconds / max(out.stats.iterations, 1),
    }


def serve_options(opts, slots: int) -> ServeOptions:
    return ServeOptions(
        model_name="random",
        batch_size=slots,
        gen_length=opts.gen_length,
        max_model_len=opts.prompt_length + opts.gen_length,
        threshold=2.0,
        max_waiting=4096,
        iterations_per_call=opts.iterations_per_call,
        log_interval=0,
    )


def serve_slots(engine, config, opts, budget: Budget, engines: dict, slots: int, canvases: list[bool], curve: bool):
    """One server of `slots` slots (compiled and warmed up if new) for every configuration of
    that slot count, then the curve on it when asked: (rows, the curve's runs or None, skipped)."""
    start = time.monotonic()
    server = assemble(engine, engine.tokenizer, serve_options(opts, slots))
    budget.compile_s = max(budget.compile_s, time.monotonic() - start)
    print(f"[{slots} slots] server warm-up {server.warmup_seconds:.1f} s", flush=True)
    uv, thread, url = start_server(server)
    exact = ExactSamples(server.metrics.commit_to_chunk_seconds)
    # the lifespan's frozen_startup_heap observes into these children (labels() returns the same one)
    gc_pauses = [ExactSamples(server.metrics.gc_pause_seconds.labels(str(g))) for g in range(len(gc.get_count()))]
    wakes = LoopWakeSamples()
    rows, skipped, curve_runs = [], [], None
    default_interval = sys.getswitchinterval()
    default_wait = server.worker.streams_first_max_seconds
    spans = LoadSpans(server.worker)
    try:
        for canvas in canvases:
            for interval, streams_first, frozen in itertools.product(
                opts.switch_intervals_ms, opts.streams_first_ms, opts.gc_freeze
            ):
                requests = opts.requests or max(4, 2 * slots)
                needed = budget.load_s(slots, requests, opts.gen_length) * opts.repeats * 2
                if not budget.fits(needed):
                    skipped.append(
                        f"{slots}{':canvas' if canvas else ''} (about {needed:.0f} s, {budget.left():.0f} s left)"
                    )
                    continue
                sys.setswitchinterval(default_interval if interval is None else interval / 1e3)
                start, wakes_start = len(exact.values), len(wakes.values)
                gc_start = [len(p.values) for p in gc_pauses]
                if frozen == "off":  # the lifespan froze the startup heap: undone for this measurement
                    gc.unfreeze()
                server.worker.streams_first_max_seconds = default_wait if streams_first is None else streams_first / 1e3
                try:
                    rows.append(measure(engine, config, opts, budget, engines, server, url, slots, canvas, spans))
                finally:
                    server.worker.streams_first_max_seconds = default_wait
                    if frozen == "off":
                        gc.freeze()
                rows[-1]["gc_freeze"] = frozen
                rows[-1]["gc_pauses"] = [summarize(p.values[i:]) for p, i in zip(gc_pauses, gc_start)]
                rows[-1]["longest_chunks"] = longest_with_pauses(exact, start, gc_pauses)
                rows[-1]["warmup_s"] = server.warmup_seconds
                rows[-1]["switch_interval_ms"] = 1e3 * sys.getswitchinterval()
                rows[-1]["streams_first_ms"] = 1e3 * default_wait if streams_first is None else streams_first
                if "server" in rows[-1]:
                    rows[-1]["server"]["commit_to_chunk_exact"] = exact.summary(start)
                    rows[-1]["server"]["receipt_to_event_loop"] = summarize(wakes.values[wakes_start:])
        sys.setswitchinterval(default_interval)
        if curve:
            curve_runs = _curve_loads(url, opts, config, budget, slots, opts.curve_requests or 2 * slots)
    finally:
        wakes.close()  # the next slot count's server records into its own samples, not through this wrapper
        spans.close()
        uv.should_exit = True
        thread.join(60)
    return rows, curve_runs, skipped


def measure(
    engine, config, opts, budget: Budget, engines: dict, server, url: str, slots: int, canvas: bool, spans: LoadSpans
) -> dict:
    """One configuration: --repeats saturating loads on the server, each followed (while the
    slot count has fewer) by an Engine.generate of the same requests right away, and by one
    after the device idled as long as it did before the load (from the load's start to the
    server's first admission: the client's process start); medians of each. A device that
    slows down when idle (clocks) then costs both sides alike."""
    options = serve_options(opts, slots)
    requests = opts.requests or max(4, 2 * slots)
    name = f"{slots}{'-canvas' if canvas else ''}"
    row: dict = {"slots": slots, "canvas": canvas, "requests": requests, "server_runs": []}
    session = server.worker.sessions[METHOD]
    runs = engines.setdefault(slots, [])
    idle_runs = engines.setdefault((slots, "after idle"), [])
    before = read_metrics(url)
    for repeat in range(opts.repeats):
        if repeat and not budget.fits(budget.load_s(slots, requests, opts.gen_length) * 2):
            break
        calls_before = session.call_seconds
        spans.reset()
        spawned = time.monotonic()
        got = load(url, opts, config, requests, [math.inf], opts.out / f"load_{name}.json", canvas, budget.left())
        if got is None:
            row["cut"] = "the budget ended during a load"
            break
        run = got[0]
        if spans.first_admit is not None and spans.last_result is not None:
            run["idle_before_s"] = spans.first_admit - spawned
            run["span_s"] = spans.last_result - spans.first_admit  # first admission to last result, in the server
        # the loop calls' share of the load's wall (from its first request to its last answer)
        run["calls_share_of_wall"] = (session.call_seconds - calls_before) / run["wall_s"]
        row["server_runs"].append(run)
        print(f"[{name}] load {repeat + 1}: {run['tokens_per_s']:.1f} tokens/s", flush=True)
        if len(runs) < opts.repeats and budget.fits(budget.load_s(slots, requests, opts.gen_length)):
            runs.append(engine_run(engine, config, opts, options, requests))
            budget.step_ms[slots] = statistics.median(e["ms_per_iteration"] for e in runs)
        idle = run.get("idle_before_s")
        if (
            idle is not None
            and len(idle_runs) < opts.repeats
            and budget.fits(idle + budget.load_s(slots, requests, opts.gen_length))
        ):
            time.sleep(idle)
            idle_runs.append(engine_run(engine, config, opts, options, requests) | {"idle_s": idle})
    samples = read_metrics(url)
    if not row["server_runs"] or not runs:
        row.setdefault("cut", "no budget left for Engine.generate")
        return row
    served = row["server_runs"]
    row["server"] = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in served),
        "calls_share_of_wall": statistics.median(r["calls_share_of_wall"] for r in served),
        "tokens": served[-1]["tokens"],
        "errors": {k: v for r in served for k, v in r["errors"].items()},
        "compilations_after_warmup": samples.get("dllm_compilations_after_warmup"),
        "step": histogram(samples, "dllm_step_seconds", before),
        "commit_to_chunk": histogram(samples, "dllm_commit_to_chunk_seconds", before),
    }
    row["engine_runs"] = runs
    row["engine"] = {
        "tokens_per_s": statistics.median(e["tokens_per_s"] for e in runs),
        "ms_per_iteration": statistics.median(e["ms_per_iteration"] for e in runs),
        "tokens": runs[-1]["tokens"],
    }
    row["server_over_engine"] = row["server"]["tokens_per_s"] / row["engine"]["tokens_per_s"]
    spanned = [r for r in served if "span_s" in r]
    if spanned:
        # the server's own rate: its tokens over its span (no client process, no HTTP)
        row["server"]["span_tokens_per_s"] = statistics.median(r["tokens"] / r["span_s"] for r in spanned)
        row["server"]["idle_before_s"] = statistics.median(r["idle_before_s"] for r in spanned)
    if idle_runs:
        row["engine_after_idle_runs"] = idle_runs
        row["engine_after_idle"] = {
            "tokens_per_s": statistics.median(e["tokens_per_s"] for e in idle_runs),
            "idle_s": statistics.median(e["idle_s"] for e in idle_runs),
        }
        row["server_over_engine_after_idle"] = row["server"]["tokens_per_s"] / row["engine_after_idle"]["tokens_per_s"]
    row["same_tokens"] = all(r["tokens"] == runs[0]["tokens"] for r in served + runs + idle_runs)
    return row


def _curve_loads(url: str, opts, config, budget: Budget, slots: int, requests: int) -> list[dict]:
    runs = []
    for rate in opts.curve_rates:
        saturated = budget.load_s(slots, requests, opts.gen_length)
        needed = (
            max(saturated, requests / rate + saturated / math.ceil(requests / slots)) if rate < math.inf else saturated
        )
        if not budget.fits(needed):
            print(f"[curve] rate {rate:g}/s skipped: about {needed:.0f} s, {budget.left():.0f} s left", flush=True)
            continue
        out = opts.out / f"serve_curve_{rate:g}.json"
        got = load(url, opts, config, requests, [rate], out, False, budget.left())
        if got is None:
            break
        runs += got
    if runs:
        model = f"{'tiny' if opts.smoke else 'LLaDA-8B'} shape (random weights), {slots} slots, {jax.devices()[0].device_kind}"
        write_text_atomically(opts.out / "serve_curve.json", json.dumps({"model": model, "runs": runs}, indent=1))
        if importlib.util.find_spec("matplotlib"):  # the GPU image has none: load_test.py --replot draws it later
            subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve().parents[1] / "load_test.py"),
                    "--replot",
                    str(opts.out / "serve_curve.json"),
                    "--plot",
                    str(opts.out / "serve_curve.png"),
                ],
                check=False,
                timeout=120,
            )
    return runs


def write_report(opts, rows: list[dict], skipped: list[str], curve: dict | None = None) -> None:
    """serve_bench.json and serve_bench.md of the configurations measured so far (and printed)."""
    report = {
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "model": "tiny" if opts.smoke else "LLaDA-8B",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "gen_length": opts.gen_length,
        "prompt_length": opts.prompt_length,
        "iterations_per_call": opts.iterations_per_call,
        "blocking_calls": opts.blocking_calls,
        "repeats": opts.repeats,
        "configs": rows,
        "skipped": skipped,
        "curve": curve,
    }
    lines = [
        f"# serve bench: {report['model']} on {report['device']}, {report['date']}",
        "",
        f"Prompts of {opts.prompt_length} tokens, {opts.gen_length} generated, one token per step, "
        f"{opts.iterations_per_call} iteration(s) per call, all requests at once, "
        f"{opts.repeats} load(s) and Engine.generate run(s) per configuration (medians)"
        f"{'; every loop call blocking until its results are ready' if opts.blocking_calls else ''}.",
        "",
        "| slots | requests | canvas | switch interval ms | streams-first wait ms | server tokens/s | engine tokens/s | server / engine | "
        "server step ms | engine ms/iteration | calls' share of wall | commit-to-chunk mean / p50 / p99 / max ms | "
        "to the event loop p50 / p99 / max ms | GC heap | GC pauses (gen 2) / max ms | same tokens | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "server" not in r or "engine" not in r:
            lines.append(f"| {r['slots']} | {r['requests']} | {'on' if r['canvas'] else 'off'} | {r.get('cut')} |")
            continue
        s, e, c = r["server"], r["engine"], r["server"].get("commit_to_chunk_exact", {})
        w = s.get("receipt_to_event_loop", {})
        lines.append(
            f"| {r['slots']} | {r['requests']} | {'on' if r['canvas'] else 'off'} | "
            f"{r.get('switch_interval_ms', 5.0):g} | {r.get('streams_first_ms', 5.0):g} | {s['tokens_per_s']:.1f} | "
            f"{e['tokens_per_s']:.1f} | **{r['server_over_engine']:.3f}** | {ms(s['step'].get('mean_s'))} | "
            f"{e['ms_per_iteration']:.2f} | {s['calls_share_of_wall']:.2f} | {ms(c.get('mean_s'))} / "
            f"{ms(c.get('p50_s'))} / {ms(c.get('p99_s'))} / {ms(c.get('max_s'))} | "
            f"{ms(w.get('p50_s'))} / {ms(w.get('p99_s'))} / {ms(w.get('max_s'))} | {gc_cells(r)} | {r['same_tokens']} | "
            f"{s['errors'] or 'none'} |"
        )
    idled = [r for r in rows if "engine_after_idle" in r]
    if idled:
        lines += [
            "",
            "The same loads against Engine.generate after the device idled as long as before each load (the "
            "client's process start, to the server's first admission), and the server's own rate (its tokens over "
            "its first admission to its last result, without the client's start and HTTP):",
            "",
            "| slots | canvas | idle s | server tokens/s | engine after idle tokens/s | server / engine after idle | "
            "server span tokens/s | span / engine (right away) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in idled:
            s, e, i = r["server"], r["engine"], r["engine_after_idle"]
            span = s.get("span_tokens_per_s")
            span_cells = "- | -" if span is None else f"{span:.1f} | {span / e['tokens_per_s']:.3f}"
            lines.append(
                f"| {r['slots']} | {'on' if r['canvas'] else 'off'} | {i['idle_s']:.2f} | {s['tokens_per_s']:.1f} | "
                f"{i['tokens_per_s']:.1f} | **{r['server_over_engine_after_idle']:.3f}** | "
                f"{span_cells} |"
            )
    lines += [f"\nSkipped: {'; '.join(skipped)}."] if skipped else []
    longest = [r for r in rows if r.get("longest_chunks")]
    lines += (
        ["\nThe longest commit-to-chunk samples, ms (of them in garbage collection) @ s into the load:\n"]
        if longest
        else []
    )
    lines += [
        f"- {r['slots']}{':canvas' if r['canvas'] else ''}, {heap_state(r)} heap: "
        + ", ".join(f"{c['ms']:.2f} ({c['gc_ms']:.2f}) @ {c['at_s']:.2f}" for c in r["longest_chunks"])
        for r in longest
    ]
    if curve and curve["runs"]:
        lines += [
            "",
            f"Latency-throughput curve, {curve['slots']} slots, {curve['requests']} requests per rate (serve_curve.png):",
            "",
            "| offered req/s | ok | req/s | tokens/s | first text p50 / p99 s | latency p50 / p90 / p99 s |",
            "|---|---|---|---|---|---|",
        ]
        for c in curve["runs"]:
            lines.append(
                f"| {c['rate']:g} | {c['ok']}/{c['requests']} | {c['requests_per_s']:.2f} | {c['tokens_per_s']:.1f} | "
                f"{c['first_text_p50_s']:.3f} / {c['first_text_p99_s']:.3f} | {c['latency_p50_s']:.3f} / "
                f"{c['latency_p90_s']:.3f} / {c['latency_p99_s']:.3f} |"
            )
    md = "\n".join(lines)
    write_text_atomically(opts.out / "serve_bench.json", json.dumps(report, indent=1))
    write_text_atomically(opts.out / "serve_bench.md", md + "\n")
    print(md, flush=True)


class BlockingCall:
    """A compiled loop's call that returns when its outputs are ready (--blocking-calls)."""

    def __init__(self, call):
        self.call = call
        self.input_shardings = call.input_shardings

    def __call__(self, *args):
        return jax.block_until_ready(self.call(*args))


def blocking(compiled):
    return dataclasses.replace(compiled, call=BlockingCall(compiled.call))


def ms(value) -> str:
    return "-" if value is None else f"{1e3 * value:.2f}"


def main(argv=None) -> int:
    opts = parse_args(argv)
    budget = Budget(opts.budget_s)
    if opts.blocking_calls and jax.devices()[0].platform != "cpu":
        print("serve_vs_engine: --blocking-calls is for the CPU (XLA:GPU's calls block already)", file=sys.stderr)
        return 2
    config = tiny_config() if opts.smoke else llada_8b_config()
    t = time.perf_counter()
    if opts.smoke:
        weights = init_params(config, jax.random.key(0))
    else:
        weights = jax.block_until_ready(init_params_per_layer(config, jax.random.key(0)))
    print(f"random weights on {jax.devices()[0]} in {time.perf_counter() - t:.1f} s", flush=True)
    # as dllm-serve's engine, it decodes each answer's text once it finishes (on its thread)
    engine = Engine(config, weights, backend="auto", tokenizer=IdTokenizer(config.eos_token_id))
    if opts.blocking_calls:
        compile_loop = engine.compile
        engine.compile = lambda *a, **k: blocking(compile_loop(*a, **k))
    opts.out.mkdir(parents=True, exist_ok=True)
    rows, skipped, engines = [], [], {}
    groups: dict[int, list[bool]] = {}  # slots -> canvas settings, in the order given
    for slots, canvas in opts.configs:
        groups.setdefault(slots, []).append(canvas)
    curve = None
    for i, (slots, canvases) in enumerate(groups.items()):
        last = i == len(groups) - 1
        requests = opts.requests or max(4, 2 * slots)
        needed = 1.5 * budget.compile_s + budget.load_s(slots, requests, opts.gen_length) * opts.repeats * 2
        if not budget.fits(needed):
            skipped += [
                f"{slots}{':canvas' if c else ''} (about {needed:.0f} s, {budget.left():.0f} s left)" for c in canvases
            ]
            continue
        served, curve_runs, missed = serve_slots(
            engine, config, opts, budget, engines, slots, canvases, curve=last and bool(opts.curve_rates)
        )
        rows += served
        skipped += missed
        if curve_runs is not None:
            curve = {"slots": slots, "requests": opts.curve_requests or 2 * slots, "runs": curve_runs}
        write_report(opts, rows, skipped, curve)  # after each slot count: a run cut short keeps what it measured
    write_report(opts, rows, skipped, curve)
    ok = all(r.get("server") and not r["server"]["errors"] and r.get("same_tokens") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
