"""Device memory of the compiled decode loop, from XLA's own analysis: no weights allocated.

    PYTHONPATH=. python scripts/memory_profile.py --model-shape llada-8b --slots 1 8 32
    PYTHONPATH=. python scripts/memory_profile.py --model-shape tiny --slots 2      # smoke test

Compiles the decode loop (``Engine.compile``, exactly what ``generate`` runs) with abstract
parameters (jax.ShapeDtypeStruct leaves), so an 8B model compiles on a small CPU machine;
on a GPU it compiles for the GPU. For every (method, slots) it reports the compiled
executable's ``memory_analysis()``: arguments (weights, the decode state with its cache),
outputs (aliased to the donated state), and the temporaries XLA's buffer assignment needs
beyond them, against weights + cache; then the largest arrays the optimized HLO computes
(shape, bytes, the op that produces them), the usual suspects when the temporaries are large.
Writes memory.json and memory.md to --out.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
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
from bench import MODEL_SHAPES, decode_config, tiny_config  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.models.config import ModelConfig  # noqa: E402
from dllm_jax.models.transformer import abstract_params  # noqa: E402
from dllm_jax.runtime.flat_cache import cache_bytes  # noqa: E402

METHODS = ("flash_cache", "flash_verify", "fast_dllm", "llada")
GiB = 2**30


def model_shape(name: str) -> ModelConfig:
    if name == "tiny":
        return tiny_config()
    if name not in MODEL_SHAPES:
        raise SystemExit(f"--model-shape {name!r}: expected tiny or one of {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]()


def per_layer(params):
    """Abstract per-layer params (what the benchmarks run: the layer loop unrolled)."""
    stacked = params["layers"]
    n_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    layer = jax.tree_util.tree_map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), stacked)
    return {**params, "layers": (layer,) * n_layers}


_ARRAY = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z]+\d*)\[([\d,]*)\]\{?[^ ]*\s+([\w\-]+)\(")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}


def largest_arrays(hlo_text: str, count: int, floor_bytes: int) -> list[dict]:
    """The largest array shapes the optimized HLO produces (parameters excluded), with the
    ops producing them and how many instructions produce that shape."""
    seen: dict[tuple, dict] = {}
    for line in hlo_text.splitlines():
        m = _ARRAY.match(line)
        if not m:
            continue
        name, dtype, dims, op = m.groups()
        if op in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant") or dtype not in _BYTES:
            continue
        shape = tuple(int(d) for d in dims.split(",") if d)
        size = _BYTES[dtype]
        for d in shape:
            size *= d
        if size < floor_bytes:
            continue
        entry = seen.setdefault(
            (dtype, shape),
            {
                "dtype": dtype,
                "shape": list(shape),
                "bytes": size,
                "instructions": 0,
                "ops": collections.Counter(),
                "example": name,
            },
        )
        entry["instructions"] += 1
        entry["ops"][op] += 1
    top = sorted(seen.values(), key=lambda e: -e["bytes"])[:count]
    for e in top:
        e["ops"] = dict(e["ops"].most_common(4))
    return top


_LIVE = re.compile(r"^\s+([\w.\-]+)\{[\d,]*\}: (\d+) bytes")


def peak_buffers(dump_dir: Path, hlo_text: str, count: int) -> dict | None:
    """The buffers live at the program's memory peak, from the newest live-range report XLA
    dumped for the decode loop (None when there is none): the largest `count` with their
    shape and producing op, and XLA's breakdown of the peak by source location."""
    reports = sorted(
        dump_dir.glob("*jit_loop_call*after_optimizations-live-range.txt"), key=lambda f: f.stat().st_mtime
    )
    if not reports:
        return None
    lines = reports[-1].read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if "(peak):" in line), None)
    if start is None:
        return None
    shapes = {}
    for line in hlo_text.splitlines():
        m = _ARRAY.match(line)
        if m:
            name, dtype, dims, op = m.groups()
            shapes[name] = (f"{dtype}[{dims}]", op)
    live = []
    for line in lines[start + 1 :]:
        m = _LIVE.match(line)
        if not m:
            break
        shape, op = shapes.get(m.group(1), ("?", "?"))
        live.append({"name": m.group(1), "bytes": int(m.group(2)), "shape": shape, "op": op})
    breakdown = [line for line in lines[start + 1 + len(live) :] if line.strip()][:40]
    temporaries = sorted((b for b in live if b["op"] != "parameter"), key=lambda b: -b["bytes"])
    return {
        "buffers": temporaries[:count],
        "live_at_peak": len(live),
        "bytes_at_peak": sum(b["bytes"] for b in live),
        "temporaries_at_peak": sum(b["bytes"] for b in temporaries),
        "breakdown": breakdown,
    }


def profile(
    engine: Engine,
    method: str,
    slots: int,
    gen_length: int,
    prompt_len: int,
    weight_bytes: int,
    dump_dir: Path | None = None,
) -> dict:
    decode = decode_config(method, "one", gen_length, slots)
    start = time.perf_counter()
    compiled = engine.compile(decode, prompt_len)
    seconds = time.perf_counter() - start
    analysis = compiled.call.memory_analysis()
    text = compiled.call.as_text()
    loop = compiled.loop
    cache = cache_bytes(engine.config, loop.num_slots, loop.max_len)
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    sizes = {f: int(getattr(analysis, f)) for f in fields}
    # outputs alias the donated state, so the peak is arguments + temporaries (+ unaliased outputs)
    peak = (
        sizes["argument_size_in_bytes"]
        + sizes["temp_size_in_bytes"]
        + sizes["output_size_in_bytes"]
        - sizes["alias_size_in_bytes"]
    )
    return {
        "method": method,
        "slots": slots,
        "gen_length": gen_length,
        "prompt_length": prompt_len,
        "max_len": loop.max_len,
        "backend": engine.backend,
        **sizes,
        "weight_bytes": weight_bytes,
        "cache_bytes": cache,
        "peak_estimate_bytes": peak,
        "over_weights_and_cache_bytes": peak - weight_bytes - cache,
        "compile_s": seconds,
        "largest_arrays": largest_arrays(text, 12, 0),
        "peak_buffers": peak_buffers(dump_dir, text, 16) if dump_dir else None,
    }


def markdown(report: dict) -> str:
    lines = [
        f"Device: {report['device']} | jax {report['jax']} | model {report['model']} | backend {report['backend']} | "
        f"layers {report['layers']} | {report['dtype']} | {report['date']}",
        "",
        "| method | slots | max_len | weights GiB | cache GiB | arguments GiB | temporaries GiB | peak estimate GiB | over weights+cache GiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['method']} | {r['slots']} | {r['max_len']} | {r['weight_bytes'] / GiB:.2f} | {r['cache_bytes'] / GiB:.2f} | "
            f"{r['argument_size_in_bytes'] / GiB:.2f} | {r['temp_size_in_bytes'] / GiB:.2f} | "
            f"{r['peak_estimate_bytes'] / GiB:.2f} | {r['over_weights_and_cache_bytes'] / GiB:.2f} | {r['compile_s']:.1f} |"
        )
    for r in report["runs"]:
        lines += [
            "",
            f"Largest arrays of {r['method']} at {r['slots']} slots (shape: instructions producing it, by op):",
        ]
        for a in r["largest_arrays"][:8]:
            ops = ", ".join(f"{op} x{n}" for op, n in a["ops"].items())
            lines.append(f"- {a['dtype']}{a['shape']} {a['bytes'] / GiB:.3f} GiB: {a['instructions']} ({ops})")
        peak = r.get("peak_buffers")
        if peak:
            lines += [
                "",
                f"Largest non-parameter buffers live at the peak of {r['method']} at {r['slots']} slots "
                f"(XLA's live ranges: {peak['live_at_peak']} buffers, {peak['bytes_at_peak'] / GiB:.3f} GiB, "
                f"{peak['temporaries_at_peak'] / GiB:.3f} GiB not parameters):",
            ]
            lines += [f"- {b['shape']} {b['bytes'] / GiB:.3f} GiB: {b['name']} ({b['op']})" for b in peak["buffers"]]
            lines += ["", "XLA's breakdown of the peak:", "```", *peak["breakdown"], "```"]
    for e in report["errors"]:
        lines.append(f"\nERROR {e['run']}: {e['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llada-8b", help=f"tiny or one of {', '.join(MODEL_SHAPES)}")
    p.add_argument("--slots", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--backend", choices=("auto", "xla", "pallas"), default="xla")
    p.add_argument(
        "--layers",
        choices=("stacked", "per_layer"),
        default="per_layer",
        help="layer-stacked weights (scanned layer loop) or per-layer arrays (unrolled, as bench.py)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="model dtype (default: the model's own: bfloat16, tiny float32); XLA:CPU on jax 0.10 computes bf16 dots and scatters through float32 copies of "
        "their operands, so on a CPU float32 shows the program's own temporaries",
    )
    p.add_argument("--gen-length", type=int, default=None, help="default 256 (tiny: 32)")
    p.add_argument("--prompt-length", type=int, default=None, help="default 256 (tiny: 16)")
    p.add_argument(
        "--peak-buffers",
        action="store_true",
        help="also list the buffers live at the memory peak (from XLA's dump of the compiled loop, "
        "written to a temporary folder and deleted)",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    dump_dir = None
    if opts.peak_buffers:
        # read when the backend starts (the first compile below), not at import
        dump_dir = Path(tempfile.mkdtemp(prefix="memory_profile_"))
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=jit_loop_call"
        )
        # a loop read back from a persistent compilation cache is not compiled, so nothing is
        # dumped (jax leaves the dump flags out of its cache key)
        jax.config.update("jax_enable_compilation_cache", False)
    config = model_shape(opts.model_shape)
    config = dataclasses.replace(config, dtype=opts.dtype or config.dtype)
    tiny = opts.model_shape == "tiny"
    gen_length = opts.gen_length or (32 if tiny else 256)
    prompt_len = opts.prompt_length or (16 if tiny else 256)
    params = abstract_params(config)
    if opts.layers == "per_layer":
        if opts.backend == "pallas":
            raise SystemExit("--backend pallas (fused projection kernel) needs --layers stacked")
        params = per_layer(params)
    weight_bytes = sum(w.size * w.dtype.itemsize for w in jax.tree_util.tree_leaves(params))
    engine = Engine(config, params, backend=opts.backend, full_pass_lanes=())
    report = {
        "device": f"{jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "model": opts.model_shape,
        "backend": engine.backend,
        "layers": opts.layers,
        "dtype": config.dtype,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "runs": [],
        "errors": [],
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    for slots in opts.slots:
        for method in opts.methods:
            name = f"{method} slots={slots}"
            try:
                report["runs"].append(profile(engine, method, slots, gen_length, prompt_len, weight_bytes, dump_dir))
            except Exception as e:  # one failed compile is reported, the others still run
                report["errors"].append({"run": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            engine._executables.clear()  # noqa: SLF001 - keep one executable alive at a time
            if dump_dir:
                shutil.rmtree(dump_dir, ignore_errors=True)
            print(f"{name}: done", flush=True)
            write_text_atomically(opts.out / "memory.json", json.dumps(report, indent=1))
            write_text_atomically(opts.out / "memory.md", markdown(report) + "\n")
    print(markdown(report))
    if dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
