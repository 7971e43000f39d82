"""Where the time of a steady-state Flash-Cache step goes: a device trace summed per kernel.

    PYTHONPATH=. python scripts/profile_step.py --slots 1 32          # GPU, LLaDA-8B, random weights
    PYTHONPATH=. python scripts/profile_step.py --tiny --slots 2      # CPU smoke test

Runs a few steps of flash_cache (one token per step, 128 rows per slot) under jax.profiler
with a Perfetto trace, then sums the device events per kernel name and prints the top ones,
the device-busy time per step and the wall time per step (their difference is launch and
host overhead). Writes profile_<slots>.json to --out.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import jax  # noqa: E402
from bench import decode_config, initial_state, quantize_on_device, random_prompts, schedule_sampling, tiny_config  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.models.config import llada_8b_config  # noqa: E402
from dllm_jax.models.quantization import QUANTIZATIONS  # noqa: E402
from dllm_jax.models.transformer import init_params, init_params_per_layer  # noqa: E402


def device_events(trace_dir: Path) -> list[dict]:
    """Complete events on device tracks of the Perfetto trace written by jax.profiler."""
    files = sorted(trace_dir.rglob("*.json.gz"), key=lambda f: f.name != "perfetto_trace.json.gz")
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no trace file written")
    trace = json.loads(gzip.open(files[0]).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process_names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device_pids = {pid for pid, name in process_names.items() if "/device:" in name}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e]


def per_kernel(events: list[dict], steps: int) -> dict[str, tuple[float, float]]:
    """Device events summed per kernel name: name -> (ms per step, calls per step)."""
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        totals[e["name"]][0] += e["dur"] * 1e-3 / steps
        totals[e["name"]][1] += 1 / steps
    return {name: (ms, calls) for name, (ms, calls) in totals.items()}


def is_gemm_kernel(name: str) -> bool:
    """A traced kernel that is a GEMM: cuBLAS (its sm90 "nvjet" kernels included), cuDNN,
    CUTLASS, or one of XLA's Triton GEMM fusions."""
    return bool(re.search(r"gemm|cublas|xmma|cutlass|cudnn|nvjet|sm90_", name, re.IGNORECASE))


def by_kind(kernels: dict[str, tuple[float, float]], kind_of) -> dict[str, dict[str, float]]:
    """per_kernel's table summed per kind_of(name): kind -> {"ms", "calls"} per step."""
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (ms, calls) in kernels.items():
        totals[kind_of(name)][0] += ms
        totals[kind_of(name)][1] += calls
    return {kind: {"ms": ms, "calls": calls} for kind, (ms, calls) in sorted(totals.items())}


def traced_steps(engine: Engine, slots: int, gen_length: int, prompt_len: int, steps: int):
    """The flash_cache one-token-per-step loop compiled for `slots` random prompts, run 3
    iterations, then `steps` more under jax.profiler -> (compiled loop, wall seconds per step,
    the device's kernel events)."""
    decode = decode_config("flash_cache", "one", gen_length, slots)
    prompts = random_prompts(slots, prompt_len, engine.config.vocab_size, seed=slots)
    compiled = engine.compile(decode, prompt_len)
    state = initial_state(compiled, prompts, schedule_sampling("flash_cache", "one"))
    state = jax.block_until_ready(compiled.run(engine.weights, state, 3))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(compiled.run(engine.weights, state, steps))
        wall = (time.perf_counter() - start) / steps
        return compiled, wall, device_events(Path(tmp))


def profile(engine: Engine, slots: int, gen_length: int, prompt_len: int, steps: int, out: Path) -> dict:
    _, wall, events = traced_steps(engine, slots, gen_length, prompt_len, steps)
    kernels = per_kernel(events, steps)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    result = {
        "slots": slots,
        "steps": steps,
        "wall_ms_per_step_profiled": 1e3 * wall,
        "device_busy_ms_per_step": sum(ms for ms, _ in kernels.values()),
        "kernels_per_step": sum(n for _, n in kernels.values()),
        "top": [{"name": name, "ms_per_step": ms, "calls_per_step": n} for name, (ms, n) in top[:40]],
    }
    name = f"profile_{slots}" + ("" if engine.config.quantization == "none" else f"_{engine.config.quantization}")
    write_text_atomically(out / f"{name}.json", json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--slots", nargs="+", type=int, default=[1, 32])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--backend", default="auto")
    p.add_argument("--layers", choices=("stacked", "per_layer"), default="per_layer")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="8-bit projections (made from the random bf16 weights)",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    config = tiny_config() if opts.tiny else llada_8b_config()
    if opts.layers == "per_layer":
        params = jax.block_until_ready(init_params_per_layer(config, jax.random.key(0)))
    else:
        params = jax.block_until_ready(init_params(config, jax.random.key(0)))
    if opts.quantization != "none":
        params = jax.block_until_ready(quantize_on_device(params, opts.quantization))
        config = dataclasses.replace(config, quantization=opts.quantization)
    engine = Engine(config, params, backend=opts.backend, full_pass_lanes=())
    opts.out.mkdir(parents=True, exist_ok=True)
    for slots in opts.slots:
        r = profile(engine, slots, 32 if opts.tiny else 256, 16 if opts.tiny else 256, opts.steps, opts.out)
        print(
            f"\n## {slots} slots, backend {engine.backend}, quantization {opts.quantization}: wall {r['wall_ms_per_step_profiled']:.2f} ms/step, "
            f"device busy {r['device_busy_ms_per_step']:.2f} ms/step, {r['kernels_per_step']:.0f} kernels/step"
        )
        print("| ms/step | calls/step | kernel |\n|---|---|---|")
        for k in r["top"][:25]:
            print(f"| {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} | {k['name'][:90]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
