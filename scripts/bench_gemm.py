"""The projection GEMMs alone: bf16 against FP8 (W8A8) and int8 weights, at the model's shapes.

For each projection shape of LLaDA-8B ([in, out] = q/k/v/o 4096 x 4096, gate/up 4096 x 12288,
down 12288 x 4096) and each row count (1, 8 and 32 slots x 128 rows), times against the bf16
``jnp.dot``:
  fp8          dllm_jax.models.quantization.quantized_matmul (the engine's W8A8: per-row activation
               abs-max and convert, one FP8 GEMM, the scales on the product);
  fp8 f32 product  the same with a float32 GEMM product, scaled and rounded after (the
               engine's path before the GEMM wrote bf16 itself);
  fp8 dot      the FP8 GEMM on activations already in e4m3 (no abs-max), so the difference to
               "fp8" is what the activation quantization costs per projection;
  int8 xla     quantized_matmul's XLA path (int8 weights converted inside XLA's GEMM);
  int8 pallas  the Pallas kernel pallas_kernels.matmul.int8_matmul at its default tiling (what
               quantized_matmul's "auto" runs on NVIDIA GPUs up to INT8_KERNEL_MAX_ROWS rows,
               0 since it measured slower than "int8 xla");
  with --sweep, the kernel at each tiling of SWEEP that fits.
Reports time, TFLOP/s, the weight stream in GB/s (weight bytes read once per call / time: 2
bytes per weight in bf16, 1 in 8 bits) and reads the compiled HLO of each to say which GEMM
the compiler chose (a cuBLASLt FP8 custom call, a plain cuBLAS GEMM, a Triton fusion, the
Pallas kernel's Triton call ...), so a dequantize-then-bf16-GEMM shows up as such.

  python scripts/bench_gemm.py [--sweep]       # on the GPU, writes $OUT/bench_gemm.json and .md
  python scripts/bench_gemm.py --tiny          # CPU smoke test at small shapes (kernel interpreted)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()
from bench_kernels import rel_l2, time_chain  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.common.platform import on_nvidia_gpu  # noqa: E402
from dllm_jax.models.quantization import quantize_kernel, quantized_matmul  # noqa: E402
from pallas_kernels.common import next_power_of_two  # noqa: E402
from pallas_kernels.matmul.int8_matmul import Int8MatmulBlockSizes, int8_weight_matmul, supports  # noqa: E402

SHAPES = {"qkvo 4096x4096": (4096, 4096), "gate/up 4096x12288": (4096, 12288), "down 12288x4096": (12288, 4096)}
TINY_SHAPES = {"tiny 128x256": (128, 256)}
GEMM_CALL = re.compile(r'custom_call_target="([^"]+)"|fusion_kind="?(\w+)"?|"kind":"(__\w+)"')
# int8 kernel tilings tried by --sweep (BM, BN, BK, swap_ab, warps, stages, split_k); BM is
# capped at the rows
SWEEP = tuple(
    Int8MatmulBlockSizes(bm, bn, bk, swap, warps, stages, split)
    for bm, bn, bk, swap, warps, stages, split in [
        (128, 128, 64, False, 4, 4, 1),
        (128, 128, 128, False, 8, 3, 1),
        (128, 128, 128, False, 4, 4, 1),
        (128, 64, 128, False, 4, 4, 1),
        (128, 64, 256, False, 4, 3, 1),
        (128, 32, 128, False, 4, 4, 1),
        (64, 128, 128, False, 4, 4, 1),
        (64, 64, 256, False, 4, 3, 1),
        (64, 128, 64, False, 4, 5, 1),
        (128, 128, 64, True, 8, 4, 1),
        (128, 128, 128, True, 8, 3, 1),
        (128, 128, 128, True, 4, 4, 1),
        (128, 64, 128, True, 4, 4, 1),
        (128, 64, 256, True, 4, 3, 1),
        (128, 256, 64, True, 8, 3, 1),
        (64, 128, 128, True, 4, 4, 1),
        (128, 128, 64, True, 8, 4, 2),
        (128, 128, 64, True, 8, 4, 4),
        (128, 64, 128, True, 4, 4, 2),
    ]
)


def gemm_kinds(compiled_text: str) -> list[str]:
    """The GEMM-ish custom calls and fusion kinds named in a compiled HLO module."""
    kinds = set()
    for match in GEMM_CALL.finditer(compiled_text):
        name = next(g for g in match.groups() if g)
        if any(k in name.lower() for k in ("gemm", "matmul", "cublas", "triton", "dot")):
            kinds.add(name)
    if " dot(" in compiled_text:
        kinds.add("dot")
    if "int8_weight_matmul" in compiled_text:
        kinds.add("pallas int8_weight_matmul")
    return sorted(kinds)


BASE_VARIANTS = ("bf16", "fp8", "fp8 f32 product", "fp8 dot", "int8 xla", "int8 pallas")


def variants(d_in: int, d_out: int, rows: int, w: jax.Array, sweep: bool, chosen=BASE_VARIANTS) -> dict[str, tuple]:
    """label -> (fn(x, weight) -> [rows, d_out], weight, weight bytes, input dtype): the chosen
    BASE_VARIANTS (bf16 first: the others' times are relative to it) and, with sweep, the
    int8 kernel at each fitting tiling of SWEEP."""
    w_bf16 = w.astype(jnp.bfloat16)
    fp8, int8 = (quantize_kernel(w, mode) for mode in ("fp8", "int8-weights"))
    kernel = "pallas" if on_nvidia_gpu() else "interpret"
    bytes8 = d_in * d_out + 4 * d_out
    out = {
        "bf16": (
            lambda x, k: jnp.dot(x, k, preferred_element_type=jnp.bfloat16),
            w_bf16,
            2 * d_in * d_out,
            jnp.bfloat16,
        ),
        "fp8": (lambda x, q: quantized_matmul(x, q["qkernel"], q["scale"], jnp.bfloat16), fp8, bytes8, jnp.bfloat16),
        "fp8 f32 product": (
            lambda x, q: quantized_matmul(x, q["qkernel"], q["scale"], jnp.float32).astype(jnp.bfloat16),
            fp8,
            bytes8,
            jnp.bfloat16,
        ),
        "fp8 dot": (
            lambda x, q: (
                jax.lax.dot_general(x, q["qkernel"], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                * q["scale"]
            ),
            fp8,
            bytes8,
            jnp.float8_e4m3fn,
        ),
        "int8 xla": (
            lambda x, q: quantized_matmul(x, q["qkernel"], q["scale"], jnp.bfloat16, int8_gemm="xla"),
            int8,
            bytes8,
            jnp.bfloat16,
        ),
        "int8 pallas": (
            lambda x, q: quantized_matmul(x, q["qkernel"], q["scale"], jnp.bfloat16, int8_gemm=kernel),
            int8,
            bytes8,
            jnp.bfloat16,
        ),
    }
    out = {label: v for label, v in out.items() if label in chosen}
    for blocks in SWEEP if sweep else ():
        blocks = dataclasses.replace(blocks, block_m=min(blocks.block_m, max(16, next_power_of_two(rows))))
        if supports(rows, d_out, d_in, blocks) and f"int8 {blocks.name}" not in out:
            out[f"int8 {blocks.name}"] = (
                lambda x, q, b=blocks: int8_weight_matmul(
                    x, q["qkernel"], q["scale"], block_sizes=b, interpret=kernel == "interpret"
                ),
                int8,
                bytes8,
                jnp.bfloat16,
            )
    return out


def run(rows_list, shapes, repeats, sweep=False, chosen=BASE_VARIANTS, save=lambda results: None) -> list[dict]:
    """Times every variant at every shape and row count; save(results) after each (a run cut
    short by a time limit keeps what it measured)."""
    results = []
    for name, (d_in, d_out) in shapes.items():
        w = jax.random.normal(jax.random.key(0), (d_in, d_out), jnp.float32) * 0.02
        for rows in rows_list:
            x = jax.random.normal(jax.random.key(rows), (rows, d_in), jnp.float32).astype(jnp.bfloat16)
            reference = x.astype(jnp.float32) @ w
            bf16_seconds = None
            for label, (fn, weight, weight_bytes, x_dtype) in variants(d_in, d_out, rows, w, sweep, chosen).items():
                # "fp8 dot" takes activations already in e4m3, scaled by a fixed 1/16
                x_in = (x.astype(jnp.float32) * 16).astype(x_dtype) if x_dtype == jnp.float8_e4m3fn else x
                try:
                    compiled = jax.jit(fn).lower(x_in, weight).compile()
                    y = compiled(x_in, weight)
                    error = rel_l2(y / 16 if x_dtype == jnp.float8_e4m3fn else y, reference)

                    # chained so that each call depends on the last (no overlap, no dead code)
                    def step(i, c, k, fn=fn, x_dtype=x_dtype):
                        y = fn(c, k)
                        y = y[:, :d_in] if d_out >= d_in else jnp.tile(y, (1, -(-d_in // d_out)))[:, :d_in]
                        return y.astype(x_dtype)

                    seconds = time_chain(step, jnp.copy(x_in), weight, inner=4, repeats=repeats)  # the carry is donated
                except Exception as e:  # a tiling that does not compile is reported, the others still run
                    print(f"{name} rows={rows} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    results.append(
                        {"shape": name, "rows": rows, "variant": label, "error": f"{type(e).__name__}: {str(e)[:1000]}"}
                    )
                    save(results)
                    continue
                bf16_seconds = seconds if label == "bf16" else bf16_seconds
                results.append(
                    {
                        "shape": name,
                        "rows": rows,
                        "variant": label,
                        "seconds": seconds,
                        "tflops": 2 * rows * d_in * d_out / seconds / 1e12,
                        "weight_gbps": weight_bytes / seconds / 1e9,
                        "time_over_bf16": seconds / bf16_seconds if bf16_seconds else None,
                        "rel_error_vs_f32": error,
                        "gemm": gemm_kinds(compiled.as_text()),
                    }
                )
                save(results)
                r = results[-1]
                print(
                    f"{name} rows={rows} {label}: {1e6 * seconds:.1f} us, {r['tflops']:.0f} TFLOP/s, "
                    f"{r['weight_gbps']:.0f} GB/s weights, x{r['time_over_bf16'] or 0:.2f} bf16, err {error:.2e}, {r['gemm']}",
                    flush=True,
                )
    return results


def markdown(results: list[dict]) -> str:
    """Per shape and rows: each variant's time, rates and time relative to bf16 (< 1 = faster)."""
    lines = [
        "| shape [in x out] | rows | variant | us | TFLOP/s | weight GB/s | time / bf16 | rel. error | GEMM |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r and "seconds" not in r:
            lines.append(f"| {r['shape']} | {r['rows']} | {r['variant']} | failed: {r['error'][:120]} | | | | | |")
            continue
        ratio = f"{r['time_over_bf16']:.2f}" if r["time_over_bf16"] else ""
        lines.append(
            f"| {r['shape']} | {r['rows']} | {r['variant']} | {1e6 * r['seconds']:.1f} | {r['tflops']:.0f} | "
            f"{r['weight_gbps']:.0f} | {ratio} | {r['rel_error_vs_f32']:.1e} | {', '.join(r['gemm'])} |"
        )
    best = {}
    for r in results:
        if r["variant"].startswith("int8") and "seconds" in r:
            key = (r["shape"], r["rows"])
            if key not in best or r["seconds"] < best[key]["seconds"]:
                best[key] = r
    if best:
        lines += [
            "",
            "Fastest int8 variant per shape and rows:",
            "",
            "| shape | rows | variant | time / bf16 | weight GB/s |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {s} | {m} | {r['variant']} | {r['time_over_bf16'] or 0:.2f} | {r['weight_gbps']:.0f} |"
            for (s, m), r in best.items()
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test at small shapes")
    p.add_argument("--rows", nargs="+", type=int, default=None, help="GEMM rows (default 128 1024 4096)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also time the int8 kernel at each tiling of SWEEP")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=BASE_VARIANTS,
        default=list(BASE_VARIANTS),
        help="which GEMMs to time (bf16 is always timed first, as the reference)",
    )
    p.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=None, help="projection shapes (default all)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    rows = opts.rows or ([8, 32] if opts.tiny else [128, 1024, 4096])
    shapes = TINY_SHAPES if opts.tiny else {name: SHAPES[name] for name in (opts.shapes or SHAPES)}
    chosen = ("bf16", *(v for v in opts.variants if v != "bf16"))
    opts.out.mkdir(parents=True, exist_ok=True)

    def save(results):
        report = {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "results": results,
        }
        write_text_atomically(opts.out / "bench_gemm.json", json.dumps(report, indent=1))
        write_text_atomically(opts.out / "bench_gemm.md", markdown(results) + "\n")

    results = run(rows, shapes, 2 if opts.tiny else opts.repeats, opts.sweep, chosen, save)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
