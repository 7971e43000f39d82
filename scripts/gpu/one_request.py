"""One request at the weight-streaming floor (issue 30), measured in one GPU call.

    PYTHONPATH=. python scripts/gpu/one_request.py                  # H200: every part, about 4 min
    PYTHONPATH=. python scripts/gpu/one_request.py --parts gemm --sweep
    PYTHONPATH=. python scripts/gpu/one_request.py --tiny           # CPU smoke test (tiny shapes, no kernel)

Parts (each writes its rows into one_request.json / .md under --out as it goes, and stops
starting new work once --budget-s is spent):
  gemm     the weight-only 8-bit GEMM (pallas_kernels.matmul.weight_only_matmul) against bf16
           cuBLAS and XLA's int8 fusion at LLaDA-8B's projection shapes for 128 and 1024 rows
           and the LM head for 16 rows; each kernel result checked against the jnp reference;
           --sweep times every tiling of `sweep_configs`.
  flags    which XLA command-buffer flag values this JAX's XLA accepts, in XLA_FLAGS (one
           subprocess each, a small while loop with a conditional) and as compile options.
  steps    the 1-slot flash_cache step at LLaDA-8B shape (random weights, as scripts/bench.py
           builds them) in bf16, with int8 weights through XLA and through the kernel (as
           quantized_matmul routes it, or at every pass up to 1024 rows), each with the
           engine's compiler options (whole-loop command buffers on NVIDIA GPUs) or without
           command buffers ("nocmdbuf"), or with every dot on cuBLAS ("cublas": XLA's Triton
           GEMM fusions off), or with every dot on XLA's Triton GEMM ("triton": every dot a
           Triton GEMM fusion, no cuBLAS fallback in XLA's GEMM autotuner), or with XLA's
           DotMerger off ("nodotmerge": it merges dots that share an input by concatenating
           their weights on every call); the first full pass
           (640 positions) of the first request and later ones (the median of LATER_PASSES),
           against its FLOP floor, each a call of one iteration, also without the engine's
           zero-iteration first execution ("cold": the first run of a fresh executable); the
           same pass inside a call of 9 iterations (less 8 steps), and a steady call of one
           iteration (against the step of a long call: the cost of a call of its own);
           kernels per step, device-busy time and launch gaps (untraced wall time less the
           busy time) from a jax.profiler trace of a few steps and of one full pass.
  env      the bf16 1-slot step with command buffers set through XLA_FLAGS, in a subprocess
           (the same numbers as the compile-option route, or not).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
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
import jax.numpy as jnp  # noqa: E402

import dllm_jax.models.quantization as quantization  # noqa: E402
from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.runtime.compiler_options import default_compiler_options  # noqa: E402
from pallas_kernels.matmul import weight_only_matmul as wo  # noqa: E402

# XLA command-buffer settings tried; the while loop and conditionals of the decode loop only
# become CUDA-graph nodes with WHILE and CONDITIONAL in the list
COMMAND_BUFFERS = {
    "default+while+cond": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "relative +while+cond": "+WHILE,+CONDITIONAL",
}
# later full passes timed (one-iteration calls on fresh states; their median is reported)
LATER_PASSES = 5
# the projections' [K, N] and the LM head's, with the row counts they see (1 and 8 slots)
SHAPES = {
    "qkvo 4096x4096": (4096, 4096, (128, 1024)),
    "gate/up 4096x12288": (4096, 12288, (128, 1024)),
    "down 12288x4096": (12288, 4096, (128, 1024)),
    "lm head 4096x126464": (4096, 126464, (16, 128)),
}
TINY_SHAPES = {"tiny 256x256": (256, 256, (16, 128))}


class Report:
    """Results by part, saved after every row."""

    def __init__(self, out: Path, started: float, budget_s: float):
        self.out, self.started, self.budget_s = out, started, budget_s
        self.data = {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": " ".join(sys.argv),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }
        out.mkdir(parents=True, exist_ok=True)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.budget_s

    def add(self, part: str, row: dict) -> None:
        self.data.setdefault(part, []).append(row)
        print(f"[{time.perf_counter() - self.started:6.1f} s] {part}: {json.dumps(row, default=str)[:400]}", flush=True)
        write_text_atomically(self.out / "one_request.json", json.dumps(self.data, indent=1, default=str))
        write_text_atomically(self.out / "one_request.md", markdown(self.data) + "\n")


# ----------------------------------------------------------------------------- gemm


def sweep_configs(m: int, n: int, k: int) -> list[wo.WeightOnlyConfig]:
    """Tilings worth timing at [m, k] @ [n, k].T: row tiles up to 256, 64 or 128 channels per
    warpgroup (accumulator at most 128 registers a thread), K split while the work units
    stay within two waves, the deepest pipeline that fits, both output layouts."""
    configs = []
    for tm in sorted({t for t in (min(m, 128), 256) if t <= m and m % t == 0}):
        for tn in (64, 128):
            if tn * tm > 64 * 256 or n % (2 * tn):
                continue
            tiles = (m // tm) * (n // (2 * tn))
            for split in (1, 2, 4, 8):
                if split > 1 and (tiles * split > 2 * wo.NUM_SMS or tiles >= wo.NUM_SMS):
                    continue
                for tk in (128, 64):
                    for transposed in (False, True) if split == 1 else (True,):
                        config = best_stages(wo.WeightOnlyConfig(tm, tn, tk, 4, split, transposed))
                        if config is not None and wo.supports(m, n, k, config) and config not in configs:
                            configs.append(config)
                    if configs and configs[-1].tile_k == 128 and configs[-1].max_concurrent_steps >= 3:
                        break  # BK = 64 only where 128 leaves a shallow pipeline
    return configs


def best_stages(config: wo.WeightOnlyConfig) -> wo.WeightOnlyConfig | None:
    for stages in (4, 3, 2):
        c = dataclasses.replace(config, max_concurrent_steps=stages)
        if c.smem_bytes() <= wo._SMEM_LIMIT:
            return c
    return None


def gemm_part(report: Report, tiny: bool, sweep: bool, repeats: int, only: list[str] | None = None) -> None:
    """Every shape and row count with bf16, XLA's int8 and the kernel's default tiling first,
    then (sweep) the other tilings, so that a budget cut leaves every shape measured."""
    from bench_kernels import rel_l2, time_chain

    kernel = wo.runs_here()
    cases = []
    for name, (k, n, rows_list) in (TINY_SHAPES if tiny else SHAPES).items():
        if only and not any(name.startswith(o) for o in only):
            continue
        w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
        q = quantization.quantize_kernel(w, "int8-weights")
        for m in rows_list:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            cases.append(
                {
                    "shape": name,
                    "m": m,
                    "k": k,
                    "n": n,
                    "x": x,
                    "q": q,
                    "w": w.astype(jnp.bfloat16),
                    "exact": x.astype(jnp.float32) @ quantization.dequantize_kernel(q),
                    "bf16_s": None,
                }
            )

    def variants(case, first: bool) -> dict:
        m, n, k, q = case["m"], case["n"], case["k"], case["q"]
        out = {}
        if first:
            out["bf16"] = (lambda x, wt: jnp.dot(x, wt, preferred_element_type=jnp.bfloat16), case["w"])
            out["int8 xla"] = (
                lambda x, qq: quantization.quantized_matmul(
                    x, qq["qkernel"], qq["scale"], jnp.bfloat16, int8_gemm="xla"
                ),
                q,
            )
        if kernel:
            default = wo.default_config(m, n, k)
            configs = [default] if first else [c for c in sweep_configs(m, n, k) if c != default]
            for config in configs:
                label = ("kernel default " if config == default else "kernel ") + config.name
                out[label] = (lambda x, qq, c=config: wo.weight_only_matmul(x, qq["qkernel"], qq["scale"], config=c), q)
            if first:  # the float32 result q and k ask for (written transposed)
                out["kernel default, f32 out"] = (
                    lambda x, qq: wo.weight_only_matmul(x, qq["qkernel"], qq["scale"], out_dtype=jnp.float32).astype(
                        jnp.bfloat16
                    ),
                    q,
                )
        return out

    for first in (True, False) if sweep else (True,):
        for case in cases:
            m, n, k = case["m"], case["n"], case["k"]
            for label, (fn, weight) in variants(case, first).items():
                if report.over_budget():
                    report.add("gemm", {"shape": case["shape"], "rows": m, "variant": label, "skipped": "budget"})
                    continue
                try:
                    error = rel_l2(jax.jit(fn)(case["x"], weight), case["exact"])

                    def step(i, c, wt, fn=fn):
                        y = fn(c, wt)
                        y = y[:, :k] if n >= k else jnp.tile(y, (1, -(-k // n)))[:, :k]
                        return y.astype(jnp.bfloat16)

                    seconds = time_chain(step, jnp.copy(case["x"]), weight, inner=4, repeats=repeats)
                except Exception as e:  # a tiling that does not build is reported; the others still run
                    report.add(
                        "gemm",
                        {
                            "shape": case["shape"],
                            "rows": m,
                            "variant": label,
                            "error": f"{type(e).__name__}: {str(e)[:600]}",
                        },
                    )
                    continue
                case["bf16_s"] = seconds if label == "bf16" else case["bf16_s"]
                weight_bytes = (2 if label == "bf16" else 1) * k * n
                report.add(
                    "gemm",
                    {
                        "shape": case["shape"],
                        "rows": m,
                        "variant": label,
                        "us": 1e6 * seconds,
                        "tflops": 2 * m * k * n / seconds / 1e12,
                        "weight_tbps": weight_bytes / seconds / 1e12,
                        "over_bf16": seconds / case["bf16_s"] if case["bf16_s"] else None,
                        "rel_error": error,
                    },
                )


# ----------------------------------------------------------------------------- flags

# a child process beside this one, which holds JAX's preallocated share of the GPU's memory
_CHILD_MEMORY = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}

_FLAG_PROBE = """
import jax, jax.numpy as jnp
def body(c):
    i, x = c
    x = jax.lax.cond(x.sum() > 0, lambda x: jnp.tanh(x @ x), lambda x: x + 1.0, x)
    return i + 1, x
f = jax.jit(lambda x, n: jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1])
print("ok", float(f(jnp.ones((64, 64)) * 0.01, 5).sum()))
"""


def flags_part(report: Report) -> None:
    for label, value in COMMAND_BUFFERS.items():
        env = {**os.environ, "XLA_FLAGS": f"--xla_gpu_enable_command_buffer={value}", **_CHILD_MEMORY}
        try:
            done = subprocess.run(
                [sys.executable, "-c", _FLAG_PROBE], env=env, capture_output=True, text=True, timeout=120
            )
            ok = done.returncode == 0 and "ok" in done.stdout
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            ok, tail = False, ["timeout"]
        report.add("flags", {"via": "XLA_FLAGS", "setting": label, "value": value, "accepted": ok, "tail": tail})
    x = jnp.ones((64, 64)) * 0.01
    for label, value in COMMAND_BUFFERS.items():
        try:
            f = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ x), x))
            f.lower(x).compile({"xla_gpu_enable_command_buffer": value})(x).block_until_ready()
            report.add("flags", {"via": "compile options", "setting": label, "value": value, "accepted": True})
        except Exception as e:
            report.add(
                "flags",
                {
                    "via": "compile options",
                    "setting": label,
                    "value": value,
                    "accepted": False,
                    "error": f"{type(e).__name__}: {str(e)[:300]}",
                },
            )


# ----------------------------------------------------------------------------- steps


def device_events(trace_dir: Path) -> list[dict]:
    from profile_step import device_events as events

    return events(trace_dir)


def traced(run, steps: int) -> dict:
    """Runs run() under jax.profiler: device kernels and busy time per step (the traced wall
    time carries the profiler's own overhead: launch gaps are the untraced step time less
    the busy time). Under command buffers the trace holds only part of the steps' kernels."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            run()
        wall = time.perf_counter() - start
        events = device_events(Path(tmp))
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        per_kernel[e["name"]][0] += e["dur"] * 1e-3 / steps
        per_kernel[e["name"]][1] += 1
    busy = sum(t for t, _ in per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "kernels_per_step": sum(n for _, n in per_kernel.values()) / steps,
        "device_busy_ms": busy,
        "wall_ms_profiled": 1e3 * wall / steps,
        "top": [(name[:80], round(t, 3), n / steps) for name, (t, n) in top],
    }


def step_variant(report: Report, label: str, engine, cost, ceilings: dict, profile: bool) -> None:
    from bench import WINDOW, decode_config, initial_state, random_prompts, schedule_sampling

    decode = decode_config("flash_cache", "one", 256, 1)
    prompts = random_prompts(1, 256, engine.config.vocab_size, seed=1)
    start = time.perf_counter()
    compiled = engine.compile(decode, 256)
    compile_s = time.perf_counter() - start
    weights = engine.weights
    row = {
        "variant": label,
        "compile_s": compile_s,
        "compiler_options": engine.compiler_options,
        "weight_only_max_rows": quantization.WEIGHT_ONLY_MAX_ROWS,
    }

    def fresh_state():
        return jax.block_until_ready(initial_state(compiled, prompts, schedule_sampling("flash_cache", "one")))

    def steady_call_s(iterations: int) -> float:
        """Seconds of one call of `iterations` iterations, going on from the current state."""
        nonlocal state
        start = time.perf_counter()
        state = jax.block_until_ready(compiled.run(weights, state, iterations))
        return time.perf_counter() - start

    def fresh_call_s(iterations: int) -> float:
        """Seconds of one call of `iterations` iterations on a fresh request's state."""
        fresh = fresh_state()
        start = time.perf_counter()
        jax.block_until_ready(compiled.run(weights, fresh, iterations))
        return time.perf_counter() - start

    state = fresh_state()
    row["first_request_pass_ms"] = 1e3 * steady_call_s(1)  # the first request's
    steady_call_s(2)
    samples = [steady_call_s(8) / 8 for _ in range(5)]
    row["step_ms"] = 1e3 * statistics.median(samples)
    row["step_samples_ms"] = [round(1e3 * s, 3) for s in samples]
    # a later pass is a call of one iteration: what such a call costs beyond its step's share
    # of a long call (the launch, the host's waits) is in later_pass_ms too
    row["one_step_call_ms"] = 1e3 * statistics.median(steady_call_s(1) for _ in range(5))
    passes = [fresh_call_s(1) for _ in range(LATER_PASSES)]
    row["later_pass_ms"] = 1e3 * statistics.median(passes)
    row["later_pass_samples_ms"] = [round(1e3 * s, 3) for s in passes]
    # the same pass inside a longer call: a fresh request's call of 1 + 8 iterations less 8 steps
    # (what a request admitted into a running loop pays; no call's launch or host wait in it)
    inside = [fresh_call_s(9) - 8e-3 * row["step_ms"] for _ in range(LATER_PASSES)]
    row["pass_inside_call_ms"] = 1e3 * statistics.median(inside)
    key_len = 640
    rows = 128
    step_flops = cost.pass_flops(rows, key_len, WINDOW)
    full_flops = cost.pass_flops(key_len, key_len, WINDOW)
    row["weight_floor_ms"] = 1e3 * cost.weight_bytes / ceilings["bandwidth_bytes"]
    row["step_over_weight_floor"] = row["step_ms"] / row["weight_floor_ms"]
    row["step_flop_floor_ms"] = 1e3 * step_flops / ceilings["matmul_flops"]
    row["full_pass_flop_floor_ms"] = 1e3 * full_flops / ceilings["matmul_flops"]
    row["first_request_pass_over_flop_floor"] = row["first_request_pass_ms"] / row["full_pass_flop_floor_ms"]
    row["later_pass_over_flop_floor"] = row["later_pass_ms"] / row["full_pass_flop_floor_ms"]
    row["pass_inside_call_over_flop_floor"] = row["pass_inside_call_ms"] / row["full_pass_flop_floor_ms"]
    if profile:
        row["profile_step"] = traced(lambda: steady_call_s(4), 4)
        row["profile_step"]["gaps_ms"] = row["step_ms"] - row["profile_step"]["device_busy_ms"]

        fresh = fresh_state()
        row["profile_full_pass"] = traced(lambda: jax.block_until_ready(compiled.run(weights, fresh, 1)), 1)
        row["profile_full_pass"]["gaps_ms"] = row["later_pass_ms"] - row["profile_full_pass"]["device_busy_ms"]
    report.add("steps", row)


def steps_part(report: Report, tiny: bool, variants: list[str], profile: bool) -> None:
    from bench import Cost, model_config, quantize_on_device
    from bench_kernels import Shapes, measure_ceilings

    import dllm_jax.engine.engine as engine_module
    from dllm_jax.engine.engine import Engine
    from dllm_jax.models.transformer import init_params_per_layer

    config = model_config("llada-8b", tiny)
    shapes = Shapes(
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        n_layers=1,
        rows_per_slot=128,
        max_len=128,
        cache_slots=1,
        slot_counts=(),
        key_lengths=(),
        verify_rows=32,
        matmul_size=256 if tiny else 8192,
        copy_elements=2**16 if tiny else 2**28,
        sweep_size=0,
    )
    ceilings = measure_ceilings(shapes, repeats=3)
    report.add("ceilings", ceilings)
    start = time.perf_counter()
    params = {"none": jax.block_until_ready(init_params_per_layer(config, jax.random.key(0)))}
    if any(v.startswith("int8") for v in variants):
        params["int8-weights"] = jax.block_until_ready(quantize_on_device(params["none"], "int8-weights"))
    report.add("steps_setup", {"init_s": time.perf_counter() - start})
    for variant in variants:
        if report.over_budget():
            report.add("steps", {"variant": variant, "skipped": "budget"})
            continue
        mode = "int8-weights" if variant.startswith("int8") else "none"
        q_config = dataclasses.replace(config, quantization=mode)
        # the engine's own options (whole-loop command buffers on NVIDIA GPUs), traced as they run
        options = default_compiler_options(mode)
        if "nocmdbuf" in variant:
            options.pop("xla_gpu_enable_command_buffer", None)
        elif "xla_gpu_enable_command_buffer" in options:
            options["xla_enable_command_buffers_during_profiling"] = True
        if "cublas" in variant:  # XLA's Triton GEMM fusions off: every dot to cuBLAS
            options["xla_gpu_enable_triton_gemm"] = False
        if "triton" in variant:  # every dot a Triton GEMM fusion, kept even where cuBLAS measured faster
            options.update(xla_gpu_triton_gemm_any=True, xla_gpu_cublas_fallback=False)
        if "nodotmerge" in variant:  # dots sharing an input kept apart: no per-call copy of their concatenated weights
            options["xla_gpu_dot_merger_threshold_mb"] = 0
        routed = quantization.WEIGHT_ONLY_MAX_ROWS
        limit = 1024 if "kernel 1024" in variant else routed if "kernel" in variant else 0
        first_execution = engine_module._first_execution
        quantization.WEIGHT_ONLY_MAX_ROWS = limit  # the routing is read when the loop is traced
        if "cold" in variant:
            engine_module._first_execution = lambda *args: None
        try:
            engine = Engine(q_config, params[mode], backend="auto", full_pass_lanes=(), compiler_options=options)
            cost = Cost(q_config, params_bytes=quantization.weight_bytes(params[mode]))
            step_variant(report, variant, engine, cost, ceilings, profile)
        except Exception as e:
            report.add("steps", {"variant": variant, "error": f"{type(e).__name__}: {str(e)[:800]}"})
        finally:
            quantization.WEIGHT_ONLY_MAX_ROWS = routed
            engine_module._first_execution = first_execution
            engine = None


def env_part(report: Report, tiny: bool, budget_s: float) -> None:
    """The bf16 step with command buffers set by XLA_FLAGS, in a child process of this script."""
    flags = (
        f"--xla_gpu_enable_command_buffer={COMMAND_BUFFERS['default+while+cond']} "
        "--xla_enable_command_buffers_during_profiling=true"
    )
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip(), **_CHILD_MEMORY}
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            sys.executable,
            __file__,
            "--parts",
            "steps",
            "--variants",
            "bf16",
            "--out",
            tmp,
            "--budget-s",
            str(budget_s),
        ]
        done = subprocess.run(
            args + (["--tiny"] if tiny else []), env=env, capture_output=True, text=True, timeout=budget_s + 120
        )
        path = Path(tmp) / "one_request.json"
        child = json.loads(path.read_text()) if path.exists() else {}
    for row in child.get("steps", []):
        report.add("env", {**row, "xla_flags": flags})
    if not child.get("steps"):
        report.add("env", {"error": (done.stdout + done.stderr)[-800:], "xla_flags": flags})


# ----------------------------------------------------------------------------- report


def markdown(data: dict) -> str:
    lines = [f"Device: {data['device']} | jax {data['jax']} | {data['date']} | XLA_FLAGS={data['xla_flags']!r}", ""]
    if data.get("gemm"):
        lines += [
            "| shape [K x N] | rows | variant | us | TFLOP/s | weight TB/s | time / bf16 | rel. error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in data["gemm"]:
            if "us" not in r:
                lines.append(
                    f"| {r['shape']} | {r['rows']} | {r.get('variant', '')} | {r.get('error', r.get('skipped', ''))[:150]} | | | | |"
                )
                continue
            ratio = f"{r['over_bf16']:.2f}" if r["over_bf16"] else ""
            lines.append(
                f"| {r['shape']} | {r['rows']} | {r['variant']} | {r['us']:.1f} | {r['tflops']:.0f} | "
                f"{r['weight_tbps']:.2f} | {ratio} | {r['rel_error']:.1e} |"
            )
        lines.append("")
    if data.get("flags"):
        lines += ["| via | setting | value | accepted |", "|---|---|---|---|"]
        lines += [f"| {r['via']} | {r['setting']} | `{r['value']}` | {r['accepted']} |" for r in data["flags"]]
        lines.append("")
    rows = data.get("steps", []) + [{**r, "variant": "env: " + r.get("variant", "")} for r in data.get("env", [])]
    if rows:
        lines += [
            "| 1-slot variant | step ms | one-step call ms | step / weight floor | kernels/step | device busy ms | "
            "gaps ms | first request's full pass ms (/ FLOP floor) | later full pass ms (/ FLOP floor) | "
            "the pass inside a 9-iteration call ms (/ FLOP floor) | full pass device busy ms | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "step_ms" not in r:
                lines.append(
                    f"| {r.get('variant')} | {r.get('error', r.get('skipped', ''))[:200]} | | | | | | | | | | |"
                )
                continue
            p, f = r.get("profile_step"), r.get("profile_full_pass")
            prof = f"{p['kernels_per_step']:.0f} | {p['device_busy_ms']:.2f} | {p['gaps_ms']:.2f}" if p else " | | "
            lines.append(
                f"| {r['variant']} | {r['step_ms']:.2f} | {r.get('one_step_call_ms', float('nan')):.2f} | "
                f"{r['step_over_weight_floor']:.2f} | {prof} | "
                f"{r['first_request_pass_ms']:.1f} ({r['first_request_pass_over_flop_floor']:.2f}) | "
                f"{r['later_pass_ms']:.1f} ({r['later_pass_over_flop_floor']:.2f}) | "
                f"{r['pass_inside_call_ms']:.1f} ({r['pass_inside_call_over_flop_floor']:.2f}) | "
                f"{f['device_busy_ms'] if f else float('nan'):.2f} | {r['compile_s']:.1f} |"
            )
        lines.append("")
        for r in rows:
            for key in ("profile_step", "profile_full_pass"):
                if key in r:
                    p = r[key]
                    lines += [
                        f"{r['variant']}, {key}: {p['kernels_per_step']:.0f} kernels, busy {p['device_busy_ms']:.2f} ms, "
                        f"untraced wall - busy {p['gaps_ms']:.2f} ms; top: "
                        + "; ".join(f"{n} {t} ms x{c:.0f}" for n, t, c in p["top"][:8]),
                        "",
                    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--parts", nargs="+", choices=("gemm", "flags", "steps", "env"), default=["gemm", "flags", "steps", "env"]
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=["bf16 cold", "bf16", "int8 xla", "int8 kernel"],
        help="1-slot step variants: bf16 | int8 xla | int8 kernel | int8 kernel 1024, each optionally + "
        "' nocmdbuf' (without the engine's default whole-loop command buffers) / ' cublas' (no XLA Triton "
        "GEMM fusions) / ' triton' (no cuBLAS fallback) / ' nodotmerge' (XLA's DotMerger off) / ' cold' (no zero-iteration first execution at compile time)",
    )
    p.add_argument("--sweep", action="store_true", help="time every tiling of sweep_configs, not only the default")
    p.add_argument(
        "--shapes", nargs="+", default=None, help="gemm: only the shapes whose name starts with one of these"
    )
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true")
    p.add_argument(
        "--budget-s",
        type=float,
        default=210.0,
        help="no new measurement starts after this (one started runs to its end: ~30 s)",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    started = time.perf_counter()
    report = Report(opts.out, started, opts.budget_s)
    if "gemm" in opts.parts:
        gemm_part(report, opts.tiny, opts.sweep, opts.repeats, opts.shapes)
    if "flags" in opts.parts:
        flags_part(report)
    if "steps" in opts.parts:
        steps_part(report, opts.tiny, opts.variants, not opts.no_profile)
    if "env" in opts.parts and not report.over_budget():
        env_part(report, opts.tiny, max(30.0, opts.budget_s - (time.perf_counter() - started)))
    print(markdown(report.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
