"""fp8 without standalone quantization passes (issue 29, item 2), measured in one GPU call: the
Flash-Cache step in bf16, in fp8 as backend "auto" runs it (each projection quantizes its input
in XLA) and in fp8 with the producers (they quantize; at one slot's sparse step q/k/v run the
fused Mosaic GPU kernel), side by side.

    PYTHONPATH=. python scripts/gpu/fp8_step.py --out $OUT/fp8_step          # H200: about 5 min
    PYTHONPATH=. python scripts/gpu/fp8_step.py --tiny --out /tmp/fp8_step   # CPU smoke test

LLaDA-8B shape, random weights (bf16, and fp8 made from them on the device), per-layer weights
as on a GPU, flash_cache with one token per step (128 recomputed rows per slot, prompt 256,
generation 256, full_pass_lanes=()). The variants (one Engine each, sharing the weights):
  bf16             backend auto;
  fp8 xla-quant    what auto runs: every projection quantizes its input in XLA (per-row abs-max,
                   then scale and convert);
  fp8 fused        auto with Kernels.fp8_producers: the producers (RMSNorm + quantize, SwiGLU +
                   quantize) and, for passes of at most FP8_FUSED_QKV_ROWS rows on Hopper, the
                   fused q/k/v kernel (named "fp8 auto" in the 2026-12-03 report, when auto ran it);
  fp8 producers    fp8 fused without the fused kernel (timed where the two differ: 1 slot).
Parts, in this order, each saving fp8_step.json and fp8_step.md under --out as it goes; no new
measurement starts after --budget-s (one started runs to its end, up to ~30 s at 32 slots):
  checks     one cached pass over random tokens through the first 4 layers, 1 slot x 128 rows
             (the fused kernel's route) and 8 slots (the producers alone): relative L2 of the
             logits and of the written cache rows, each new fp8 variant against fp8 xla-quant,
             and every fp8 variant against bf16 (fp8's own error: the new ones should not add to
             it). In bfloat16 two fp8 paths differ by more than rounding: a last-bit difference
             of an activation (XLA keeps excess precision inside a fusion, a kernel rounds where
             it writes) moves some float8 elements a whole e4m3 step (6-12%);
  steps      the step at each --slots (largest first) for each variant: ms, ratio to bf16;
  profile    the fp8 step at the largest slot count (fused, then xla-quant) under jax.profiler:
             every kernel by name with calls and ms per step, by kind: XLA's quantization
             fusions (those that convert to float8 or reduce |x| to a per-row max over the
             quantized widths, read from the compiled HLO), the producers, the fused kernel,
             the GEMMs; and their counts in the compiled loop (its full pass and its step: with
             the producers only attn_out's input, the attention kernel's output, is quantized
             by XLA);
  producers  the two producer kernels alone at the largest slot count's rows, at a few
             tilings, against XLA's norm / SwiGLU + quantization.
Prints the tables at the end. --tiny: a tiny bf16 model the kernels take, the producers
interpreted (auto on a CPU is plain XLA), 2 and 1 slots; no fused kernel where this JAX's
Mosaic GPU interpreter cannot run it (jax 0.10).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench import (  # noqa: E402
    decode_config,
    model_config,
    quantize_on_device,
    random_prompts,
    steady_step_time,
)
from bench_kernels import rel_l2, time_chain  # noqa: E402
from profile_step import by_kind, is_gemm_kernel, per_kernel, traced_steps  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.models.quantization import compiler_options  # noqa: E402
from dllm_jax.models.transformer import init_params_per_layer  # noqa: E402
from dllm_jax.runtime.cached_forward import PassSpec, cached_forward  # noqa: E402
from dllm_jax.runtime.flat_cache import allocate_cache  # noqa: E402
from dllm_jax.runtime.kernel_routing import FP8_FUSED_QKV_ROWS, Kernels, resolve_kernels  # noqa: E402
from pallas_kernels.projection.quantize_rows import (  # noqa: E402
    QuantizeBlockSizes,
    rms_norm_quantize,
    rms_norm_quantize_reference,
    swiglu_quantize,
    swiglu_quantize_reference,
)

ROWS_PER_SLOT = 128
CHECK_LAYERS = 4
PRODUCER_TILINGS = (
    QuantizeBlockSizes(),  # the default
    QuantizeBlockSizes(block_rows=1, block_cols=4096),
    QuantizeBlockSizes(block_rows=2, block_cols=2048),
    QuantizeBlockSizes(block_rows=8, block_cols=512),
    QuantizeBlockSizes(block_rows=16, block_cols=1024, num_warps=8),
)


class Report:
    """Rows by part, saved after every row."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.started, self.budget_s = out, time.perf_counter(), budget_s
        self.data = {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": " ".join(sys.argv),
        }
        out.mkdir(parents=True, exist_ok=True)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.budget_s

    def add(self, part: str, row: dict) -> None:
        self.data.setdefault(part, []).append(row)
        line = json.dumps({k: v for k, v in row.items() if k != "kernels"}, default=str)[:300]
        print(f"[{time.perf_counter() - self.started:6.1f} s] {part}: {line}", flush=True)
        write_text_atomically(self.out / "fp8_step.json", json.dumps(self.data, indent=1, default=str))
        write_text_atomically(self.out / "fp8_step.md", markdown(self.data) + "\n")


def variants(tiny: bool) -> dict[str, tuple[str, Kernels]]:
    """Variant name -> (quantization, kernels)."""
    auto = resolve_kernels("auto")
    if tiny:  # auto on a CPU is plain XLA: the producers interpreted, the fused kernel where it runs
        runs = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
        fused = dataclasses.replace(auto, interpret=True, fp8_producers=True)
        fused = dataclasses.replace(fused, fp8_fused_qkv_rows=FP8_FUSED_QKV_ROWS if runs else 0)
    else:
        from pallas_kernels.matmul.weight_only_matmul import on_hopper_gpu

        fused_rows = FP8_FUSED_QKV_ROWS if on_hopper_gpu() else 0
        fused = dataclasses.replace(auto, fp8_producers=True, fp8_fused_qkv_rows=fused_rows)
    return {
        "bf16": ("none", auto),
        "fp8 xla-quant": ("fp8", auto),
        "fp8 fused": ("fp8", fused),
        "fp8 producers": ("fp8", dataclasses.replace(fused, fp8_fused_qkv_rows=0)),
    }


def timed_variants(kinds: dict, slots: int) -> list[str]:
    """The variants worth timing at this slot count (fp8 producers only where auto fuses)."""
    fused = kinds["fp8 fused"][1].fp8_fused_qkv_rows >= slots * ROWS_PER_SLOT
    return [name for name in kinds if name != "fp8 producers" or fused]


# ----------------------------------------------------------------------------- checks


def checks_part(report: Report, config, weights: dict, kinds: dict, slot_counts: list[int]) -> None:
    """One pass through the first CHECK_LAYERS layers per slot count and variant."""
    n_layers = min(CHECK_LAYERS, config.n_layers)
    for slots in slot_counts:
        if report.over_budget():
            report.add("checks", {"slots": slots, "skipped": "budget"})
            continue
        keys = jax.random.split(jax.random.key(slots), 2)
        tokens = jax.random.randint(keys[0], (slots, ROWS_PER_SLOT), 0, config.vocab_size - 2)
        positions = jnp.broadcast_to(jnp.arange(ROWS_PER_SLOT, dtype=jnp.int32), tokens.shape)
        key_len = jnp.full((slots,), ROWS_PER_SLOT, jnp.int32)
        candidates = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (slots, 16))

        def run(name):
            mode, kernels = kinds[name]
            cfg = dataclasses.replace(config, n_layers=n_layers, quantization=mode)
            w = {**weights[mode], "layers": weights[mode]["layers"][:n_layers]}
            spec = PassSpec(max_len=ROWS_PER_SLOT + 1, kernels=kernels)

            def one_pass(w, cache):
                valid = jnp.ones(tokens.shape, bool)
                logits, _, cache = cached_forward(
                    cfg, spec, w, cache, tokens, positions, valid, None, key_len, candidates
                )
                return logits, cache

            cache = allocate_cache(cfg, slots, ROWS_PER_SLOT + 1)
            # the engine's compile options (fp8 on a GPU: no Triton GEMM autotuning)
            logits, cache = jax.jit(one_pass).lower(w, cache).compile(compiler_options(mode) or None)(w, cache)
            # the rows the pass wrote (each slot's last row is its trash row)
            rows = cache.k.shape[1]
            written = jnp.arange(rows) % (ROWS_PER_SLOT + 1) < ROWS_PER_SLOT
            return logits, cache.k[:, written], cache.v[:, written]

        # (variant, against): each new fp8 variant against the fp8 path before, and every fp8
        # variant against bf16 (fp8's own error: the new ones should not add to it)
        new = [n for n in timed_variants(kinds, slots) if n not in ("bf16", "fp8 xla-quant")]
        pairs = [(n, "fp8 xla-quant") for n in new] + [(n, "bf16") for n in ["fp8 xla-quant", *new]]
        results = {}
        for variant, against in pairs:
            row = {"slots": slots, "rows": slots * ROWS_PER_SLOT, "layers": n_layers, "variant": variant}
            try:
                a, b = (results.setdefault(n, run(n)) for n in (variant, against))
            except Exception as e:  # a failing variant is reported; the others still run
                report.add("checks", {**row, "error": f"{type(e).__name__}: {str(e)[:800]}"})
                continue
            report.add(
                "checks",
                {
                    **row,
                    "against": against,
                    "logits_rel_l2": rel_l2(a[0], b[0]),
                    "argmax_agreement": float(jnp.mean(a[0].argmax(-1) == b[0].argmax(-1))),
                    "k_rows_rel_l2": rel_l2(a[1], b[1]),
                    "v_rows_rel_l2": rel_l2(a[2], b[2]),
                    "finite": bool(jnp.isfinite(a[0]).all() and jnp.isfinite(a[1]).all()),
                },
            )


# ----------------------------------------------------------------------------- steps


def steps_part(report: Report, engines, kinds, slot_counts, gen_length, prompt_len, iterations, repeats) -> None:
    for slots in slot_counts:
        decode = decode_config("flash_cache", "one", gen_length, slots)
        prompts = random_prompts(slots, prompt_len, engines("bf16").config.vocab_size, seed=slots)
        for name in timed_variants(kinds, slots):
            if report.over_budget():
                report.add("steps", {"slots": slots, "variant": name, "skipped": "budget"})
                continue
            try:
                timing = steady_step_time(engines(name), decode, prompts, iterations, repeats)
            except Exception as e:
                report.add("steps", {"slots": slots, "variant": name, "error": f"{type(e).__name__}: {str(e)[:800]}"})
                continue
            report.add(
                "steps",
                {
                    "slots": slots,
                    "variant": name,
                    "step_ms": 1e3 * timing["step_s"],
                    "step_samples_ms": [round(1e3 * s, 3) for s in timing["step_samples_s"]],
                    "compile_s": timing["compile_s"],
                    "first_pass_ms": 1e3 * timing["prefill_s"],
                    "rows_per_slot": timing["rows_per_slot"],
                    "active_slots_at_end": timing["active_slots_at_end"],
                },
            )


# ----------------------------------------------------------------------------- profile

_FUSION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = .*\bfusion\(.*\bcalls=%?([\w.\-]+)")
_HEADER = re.compile(r"^%?([\w.\-]+) .*\{\s*$")
_TO_FP8 = re.compile(r"= f8e4m3fn\[[^\]]*\]\S* convert\(")


def kernel_name(name: str) -> str:
    """An HLO instruction name as XLA:GPU names its kernel."""
    return re.sub(r"[.\-]", "_", name)


def quantization_fusions(hlo: str, widths: set[int]) -> dict[str, str]:
    """XLA's fusions in a compiled program's HLO text that quantize activations, by kernel name:
    "convert" (the fusion converts to float8_e4m3fn) or "abs-max" (it reduces |x| to a per-row
    max over rows of one of `widths`; no subtraction, which the step's row-drift statistic has)."""
    bodies, current = {}, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    width = re.compile(r"\[[0-9,]*,(" + "|".join(str(w) for w in widths) + r")\]")
    found = {}
    for line in hlo.splitlines():
        fusion = _FUSION.match(line)
        if not fusion:
            continue
        body = "\n".join(bodies.get(fusion.group(2), []))
        if _TO_FP8.search(body):
            found[kernel_name(fusion.group(1))] = "convert"
        elif " abs(" in body and " reduce(" in body and " subtract(" not in body and width.search(body):
            found[kernel_name(fusion.group(1))] = "abs-max"
    return found


def profile_part(report: Report, engines, names, config, slots, gen_length, prompt_len, steps: int = 4) -> None:
    for name in names:
        if report.over_budget():
            report.add("profile", {"slots": slots, "variant": name, "skipped": "budget"})
            continue
        try:
            compiled, wall, events = traced_steps(engines(name), slots, gen_length, prompt_len, steps)
            hlo = compiled.call.as_text()
            quantizing = quantization_fusions(hlo, {config.d_model, config.mlp_hidden_size})
        except Exception as e:
            report.add("profile", {"slots": slots, "variant": name, "error": f"{type(e).__name__}: {str(e)[:800]}"})
            continue
        table = per_kernel(events, steps)
        kind = functools.partial(kind_of, quantizing=quantizing)
        kernels = sorted(
            ({"name": k, "ms": t, "calls": n, "kind": kind(k)} for k, (t, n) in table.items()), key=lambda k: -k["ms"]
        )
        report.add(
            "profile",
            {
                "slots": slots,
                "variant": name,
                "wall_ms_profiled": 1e3 * wall,
                "device_busy_ms": sum(k["ms"] for k in kernels),
                "kernels_per_step": sum(k["calls"] for k in kernels),
                "by_kind": by_kind(table, kind),
                "hlo_quantization_fusions": dict(collections.Counter(quantizing.values())),
                "hlo_gemms": dict(collections.Counter(re.findall(r'custom_call_target="(__cublas[^"]*)"', hlo))),
                "hlo_kernel_calls": {
                    k: sum(1 for line in hlo.splitlines() if k in line and "custom-call(" in line)
                    for k in ("rms_norm_quantize", "swiglu_quantize", "qkv_rope_cache_mosaic")
                },
                "kernels": kernels,
            },
        )


def kind_of(name: str, quantizing: dict[str, str]) -> str:
    """What a traced kernel is: XLA quantization, a producer, the fused projection, a GEMM, other."""
    if name in quantizing:
        return f"xla quantization ({quantizing[name]})"
    for producer in ("rms_norm_quantize", "swiglu_quantize", "qkv_rope_cache_mosaic"):
        if producer in name:
            return producer
    return "gemm" if is_gemm_kernel(name) else "other"


# ----------------------------------------------------------------------------- producers


def producers_part(report: Report, config, rows: int, interpret: bool) -> None:
    """The producers against XLA's path (their jnp references: the op, then the quantization,
    which XLA fuses as it did in the engine), as chains whose next input is the dequantized
    output (the same elementwise pass in every variant). SwiGLU as the engine runs it: on the
    gate and up GEMMs' products, scaled by row x column inside."""
    keys = jax.random.split(jax.random.key(7), 7)
    d, f = config.d_model, config.mlp_hidden_size
    x = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
    weight = (1 + 0.1 * jax.random.normal(keys[1], (d,), jnp.float32)).astype(jnp.bfloat16)
    gate = jax.random.normal(keys[2], (rows, f), jnp.bfloat16)
    up = jax.random.normal(keys[3], (rows, f), jnp.bfloat16)
    scales = tuple(jax.random.uniform(k, (n,), jnp.float32, 0.5, 2.0) for k, n in zip(keys[4:], (rows, f, f)))
    eps = config.rms_norm_eps

    def dequantized(q, scale, dtype):
        return (q.astype(jnp.float32) * scale[:, None]).astype(dtype)

    def norm(fn, **kw):
        return lambda i, c, w: dequantized(*fn(c, w, eps, **kw), c.dtype)

    def swiglu(fn, **kw):
        return lambda i, c, consts: dequantized(*fn(c, *consts, **kw), c.dtype)

    cases = [
        ("rms_norm + quantize", "xla", norm(rms_norm_quantize_reference), x, weight),
        ("swiglu + quantize", "xla", swiglu(swiglu_quantize_reference), gate, (up, scales)),
    ]
    for blocks in PRODUCER_TILINGS[: 2 if interpret else None]:
        label = f"kernel {blocks.block_rows}x{blocks.block_cols} w{blocks.num_warps}"
        kw = dict(interpret=interpret, block_sizes=blocks)
        cases.append(("rms_norm + quantize", label, norm(rms_norm_quantize, **kw), x, weight))
        cases.append(("swiglu + quantize", label, swiglu(swiglu_quantize, **kw), gate, (up, scales)))
    for op, label, step, carry, consts in cases:
        if report.over_budget():
            report.add("producers", {"op": op, "variant": label, "skipped": "budget"})
            continue
        try:
            seconds = time_chain(
                step, jnp.array(carry, copy=True), consts, inner=2 if interpret else 8, repeats=1 if interpret else 5
            )
        except Exception as e:  # a tiling that does not build is reported; the others still run
            report.add("producers", {"op": op, "variant": label, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            continue
        report.add("producers", {"op": op, "variant": label, "rows": rows, "us": 1e6 * seconds})


# ----------------------------------------------------------------------------- report


def markdown(data: dict) -> str:
    lines = [f"Device: {data['device']} | jax {data['jax']} | {data['date']} | `{data['command']}`", ""]
    if data.get("checks"):
        lines += [
            "| slots | rows | variant | against | logits rel. L2 | argmax agreement | k rows rel. L2 | v rows rel. L2 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in data["checks"]:
            if "logits_rel_l2" not in r:
                what = r.get("error", r.get("skipped", ""))[:200]
                lines.append(f"| {r['slots']} | | {r.get('variant', '')} | {what} | | | | |")
                continue
            lines.append(
                f"| {r['slots']} | {r['rows']} | {r['variant']} | {r['against']} | {r['logits_rel_l2']:.2e} | "
                f"{r['argmax_agreement']:.3f} | {r['k_rows_rel_l2']:.2e} | {r['v_rows_rel_l2']:.2e} |"
            )
        lines.append("")
    if data.get("steps"):
        bf16 = {r["slots"]: r["step_ms"] for r in data["steps"] if r.get("variant") == "bf16" and "step_ms" in r}
        lines += ["| slots | variant | step ms | / bf16 | compile s |", "|---|---|---|---|---|"]
        for r in data["steps"]:
            if "step_ms" not in r:
                lines.append(f"| {r['slots']} | {r['variant']} | {r.get('error', r.get('skipped', ''))[:200]} | | |")
                continue
            ratio = f"{r['step_ms'] / bf16[r['slots']]:.3f}" if r["slots"] in bf16 else ""
            lines.append(f"| {r['slots']} | {r['variant']} | {r['step_ms']:.2f} | {ratio} | {r['compile_s']:.1f} |")
        lines.append("")
    for r in data.get("profile", []):
        if "kernels" not in r:
            lines += [f"profile {r['slots']} slots, {r['variant']}: {r.get('error', r.get('skipped', ''))[:300]}", ""]
            continue
        lines += [
            f"profile {r['slots']} slots, {r['variant']}: busy {r['device_busy_ms']:.2f} ms/step, "
            f"{r['kernels_per_step']:.0f} kernels/step (profiled wall {r['wall_ms_profiled']:.2f} ms); compiled loop: "
            f"XLA quantization fusions {r['hlo_quantization_fusions']}, GEMM custom calls {r['hlo_gemms']}, "
            f"kernel custom calls {r['hlo_kernel_calls']}",
            "",
            "| kind | ms/step | calls/step |",
            "|---|---|---|",
        ]
        lines += [f"| {kind} | {v['ms']:.3f} | {v['calls']:.0f} |" for kind, v in r["by_kind"].items()]
        lines += ["", "| ms/step | calls/step | kind | kernel |", "|---|---|---|---|"]
        lines += [f"| {k['ms']:.3f} | {k['calls']:.0f} | {k['kind']} | {k['name'][:100]} |" for k in r["kernels"][:60]]
        if len(r["kernels"]) > 60:
            lines.append(f"| ... | | | {len(r['kernels']) - 60} more kernels in fp8_step.json |")
        lines.append("")
    if data.get("producers"):
        lines += ["| op | variant | rows | us |", "|---|---|---|---|"]
        for r in data["producers"]:
            us = f"{r['us']:.1f}" if "us" in r else r.get("error", r.get("skipped", ""))[:200]
            lines.append(f"| {r['op']} | {r['variant']} | {r.get('rows', '')} | {us} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", nargs="+", type=int, default=None, help="default: 32 8 1 (--tiny: 2 1)")
    p.add_argument("--parts", nargs="+", choices=("checks", "steps", "profile", "producers"), default=None)
    p.add_argument("--iterations", type=int, default=4, help="steps per timed sample")
    p.add_argument("--repeats", type=int, default=2, help="timed samples per step time (the median)")
    p.add_argument("--budget-s", type=float, default=270.0, help="no new measurement starts after this")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny model, the producers interpreted")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "fp8_step")
    opts = p.parse_args(argv)
    if opts.slots is not None and any(s < 1 for s in opts.slots):
        p.error(f"--slots {opts.slots}: expected positive slot counts")
    parts = opts.parts or ["checks", "steps", "profile", "producers"]
    slot_counts = sorted(set(opts.slots or ([2, 1] if opts.tiny else [32, 8, 1])), reverse=True)
    config = model_config("llada-8b", opts.tiny)
    if opts.tiny:  # widths the fused kernel takes (head_dim 64), bfloat16 as on a GPU
        config = dataclasses.replace(config, n_heads=2, n_kv_heads=2, dtype="bfloat16")
    gen_length, prompt_len = (32, 16) if opts.tiny else (256, 256)
    report = Report(opts.out, opts.budget_s)
    kinds = variants(opts.tiny)
    report.data["variants"] = {name: {"quantization": q, "kernels": str(k)} for name, (q, k) in kinds.items()}
    start = time.perf_counter()
    weights = {"none": jax.block_until_ready(init_params_per_layer(config, jax.random.key(0)))}
    weights["fp8"] = jax.block_until_ready(quantize_on_device(weights["none"], "fp8"))
    report.add("setup", {"init_s": time.perf_counter() - start, "config": str(config)})
    made: dict[str, Engine] = {}

    def engines(name: str) -> Engine:
        """The variant's engine, built once (its compiled loops are kept for the profile)."""
        if name not in made:
            mode, kernels = kinds[name]
            made[name] = Engine(
                dataclasses.replace(config, quantization=mode), weights[mode], backend=kernels, full_pass_lanes=()
            )
        return made[name]

    if "checks" in parts:
        checks_part(report, config, weights, kinds, [1, 2] if opts.tiny else [1, 8])
    if "steps" in parts:
        steps_part(report, engines, kinds, slot_counts, gen_length, prompt_len, opts.iterations, opts.repeats)
    if "profile" in parts:
        profile_part(report, engines, ["fp8 fused", "fp8 xla-quant"], config, slot_counts[0], gen_length, prompt_len)
    if "producers" in parts:
        producers_part(report, config, ROWS_PER_SLOT * slot_counts[0], interpret=opts.tiny)
    print("\n" + markdown(report.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
