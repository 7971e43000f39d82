"""The projection GEMMs alone: bf16 against FP8 (W8A8) and int8 weights, at the model's shapes.

For each projection shape of LLaDA-8B ([in, out] = q/k/v/o 4096 x 4096, gate/up 4096 x 12288,
down 12288 x 4096) and each row count (1, 8 and 32 slots x 128 rows), times
dllm_jax.quantization.quantized_matmul (the engine's own code path) against the bf16
``jnp.dot`` and reports TFLOP/s; and reads the compiled HLO of each to say which GEMM the
compiler chose (a cuBLASLt FP8 custom call, a plain cuBLAS GEMM, a Triton fusion ...), so a
dequantize-then-bf16-GEMM shows up as such.

  python scripts/bench_gemm.py                 # on the GPU, writes $OUT/bench_gemm.json
  python scripts/bench_gemm.py --tiny          # CPU smoke test at small shapes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dllm_jax.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.quantization import quantize_kernel, quantized_matmul  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import rel_l2, time_chain  # noqa: E402

SHAPES = {"qkvo 4096x4096": (4096, 4096), "gate/up 4096x12288": (4096, 12288), "down 12288x4096": (12288, 4096)}
TINY_SHAPES = {"tiny 128x256": (128, 256)}
GEMM_CALL = re.compile(r'custom_call_target="([^"]+)"|fusion_kind="?(\w+)"?|"kind":"(__\w+)"')


def gemm_kinds(compiled_text: str) -> list[str]:
    """The GEMM-ish custom calls and fusion kinds named in a compiled HLO module."""
    kinds = set()
    for match in GEMM_CALL.finditer(compiled_text):
        name = next(g for g in match.groups() if g)
        if any(k in name.lower() for k in ("gemm", "matmul", "cublas", "triton", "dot")):
            kinds.add(name)
    if " dot(" in compiled_text:
        kinds.add("dot")
    return sorted(kinds)


def run(rows_list, shapes, repeats) -> list[dict]:
    results = []
    for name, (d_in, d_out) in shapes.items():
        w = jax.random.normal(jax.random.key(0), (d_in, d_out), jnp.float32) * 0.02
        w_bf16 = w.astype(jnp.bfloat16)
        quantized = {mode: quantize_kernel(w, mode) for mode in ("fp8", "int8-weights")}
        for rows in rows_list:
            x = jax.random.normal(jax.random.key(rows), (rows, d_in), jnp.float32).astype(jnp.bfloat16)
            reference = x.astype(jnp.float32) @ w
            variants = {"bf16": (lambda x, k: jnp.dot(x, k, preferred_element_type=jnp.bfloat16), w_bf16)}
            for mode, q in quantized.items():
                variants[mode] = (lambda x, q: quantized_matmul(x, q["qkernel"], q["scale"], jnp.bfloat16), q)
            for label, (fn, weight) in variants.items():
                compiled = jax.jit(fn).lower(x, weight).compile()
                error = rel_l2(compiled(x, weight), reference)
                # chained so that each call depends on the last (no overlap, no dead code)
                step = (lambda i, c, k, fn=fn: fn(c, k)[:, :d_in] if d_out >= d_in else
                        jnp.tile(fn(c, k), (1, -(-d_in // d_out)))[:, :d_in])
                seconds = time_chain(step, jnp.copy(x), weight, inner=4, repeats=repeats)  # the carry is donated
                results.append({
                    "shape": name, "rows": rows, "variant": label, "seconds": seconds,
                    "tflops": 2 * rows * d_in * d_out / seconds / 1e12, "rel_error_vs_f32": error,
                    "gemm": gemm_kinds(compiled.as_text()),
                })
                print(f"{name} rows={rows} {label}: {1e6 * seconds:.1f} us, "
                      f"{results[-1]['tflops']:.0f} TFLOP/s, err {error:.2e}, {results[-1]['gemm']}", flush=True)
    return results


def markdown(results: list[dict]) -> str:
    lines = ["| shape | rows | bf16 TFLOP/s | fp8 TFLOP/s | fp8 / bf16 | int8-weights TFLOP/s | int8 / bf16 | fp8 GEMM | int8 GEMM |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["shape"], r["rows"], r["variant"]): r for r in results}
    for shape, rows in dict.fromkeys((r["shape"], r["rows"]) for r in results):
        b, f, i = (by[(shape, rows, v)] for v in ("bf16", "fp8", "int8-weights"))
        lines.append(
            f"| {shape} | {rows} | {b['tflops']:.0f} | {f['tflops']:.0f} | {f['tflops'] / b['tflops']:.2f} | "
            f"{i['tflops']:.0f} | {i['tflops'] / b['tflops']:.2f} | {', '.join(f['gemm'])} | {', '.join(i['gemm'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test at small shapes")
    p.add_argument("--rows", nargs="+", type=int, default=None, help="GEMM rows (default 128 1024 4096)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    rows = opts.rows or ([8, 32] if opts.tiny else [128, 1024, 4096])
    results = run(rows, TINY_SHAPES if opts.tiny else SHAPES, 2 if opts.tiny else opts.repeats)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "results": results}
    opts.out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(opts.out / "bench_gemm.json", json.dumps(report, indent=1))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
