"""The routed experts' grouped GEMM on the GPU: jax.lax.ragged_dot as XLA lowers it against the Pallas kernel.

    PYTHONPATH=. python scripts/gpu/grouped_gemm.py --out OUT          # H200: about 3 minutes
    PYTHONPATH=. python scripts/gpu/grouped_gemm.py --tiny --out OUT   # CPU smoke (the kernels in interpret mode)
    PYTHONPATH=. python scripts/gpu/grouped_gemm.py --impls pallas pallas-sweep --flag-sets default \
        --slots 32 8 1 --repeats 5 --timeout-s 140 --out OUT           # H200: the kernel's tilings alone
    PYTHONPATH=. python scripts/gpu/grouped_gemm.py --impls gated --flag-sets default \
        --slots 32 8 1 --repeats 5 --timeout-s 140 --out OUT           # H200: gate/up + gelu, fused or not

DiffusionGemma's experts run as two grouped GEMMs over the rows sorted by expert
(dllm_jax.models.experts). At the 26B-A4B shape (128 experts of 2816 -> 2 x 704 -> 2816, top 8)
a decoder step of S slots has S x 256 x 8 assignment rows (2048 / 16384 / 65536 at 1 / 8 / 32).
For each row count (a random uniform routing) and each product (gate/up: [M, 2816] x [128, 1408,
2816]; down: [M, 704] x [128, 2816, 704]) this times (median of --repeats calls):

  xla        jax.lax.ragged_dot_general on our layout ([E, out, in], the weights' last axis
             contracted), and ragged_dot's own ([E, in, out]) as "xla-ragged_dot", in every
             XLA flag set of --flag-sets (one child process each: XLA reads XLA_FLAGS once);
             the optimized program's ragged dots, cuDNN calls and largest temporary are read
             (a dense rewrite keeps neither and needs E times the bytes);
  pallas     pallas_kernels.matmul.grouped_matmul (bf16; its default tiling, then the others of
             a small sweep, "pallas <tiling>"), default flag set only; gate/up's rows are 8 (tiny:
             2) picks of random token rows, as the experts make them, and "pallas-gathered" runs
             the kernel on the token rows with row_index (its result must equal the first row's);
  xla-int8 / pallas-int8, xla-fp8 / pallas-fp8
             the 8-bit experts (quantize_experts of the same weights): quantized_ragged_dot
             against the kernel (int8: weights converted in registers; fp8: rows quantized per
             row, float8 x float8);
  tokamax    tokamax.ragged_dot_general(implementation="mosaic") (Mosaic GPU, sm90) when
             tokamax imports (0.0.17 wheels: see BENCHMARKS.md): on our layout (tokamax
             transposes the weights at every call) and on weights stored [E, in, out]
             ("tokamax-kn", its native layout). xprof, which tokamax imports for profiling
             only, is stubbed when missing.

  jax-mgpu   jax's own Hopper grouped GEMM, jax.experimental.pallas.ops.gpu.ragged_dot_mgpu
             (Mosaic GPU: wgmma, TMA, a persistent grid of 132 programs) on our [E, out, in]
             layout (transpose_rhs), over the sorted rows (no gather), at the tilings of
             JAX_MGPU_TILINGS that divide the product; GPU only.
  gated      gate/up with the activation, hidden = gelu(gate) * up [M, F], as the experts run it
             (token rows gathered by row_index, fill_tail=False): "unfused" is today's pair, the
             plain kernel's [M, 2F] product then XLA's gelu * up ("unfused gemm": the kernel
             alone), against pallas_kernels.matmul.grouped_matmul_gated ("gated <tiling>": its
             default, then a small sweep, gated_sweep); then, after every slot count's bf16
             rows, the same pair with int8 and fp8 weights at the default tiling. "unequal" is
             the share of the elements that differ from the unfused pair's bit for bit (expected
             ~0: the same rounding points, only tanh's last bit and the MMA order may differ).
             The product is "gate_up+gelu"; a summary per slot count follows the table
             (the fastest tiling, and the saving per step of 30 layers).

Each row's "rel err" is the relative L2 error against an exact float32 product of 64 sampled
rows (the row's expert's weights gathered), so every path is checked on the GPU on fresh random
data; "vs xla" is the relative L2 difference to the xla row of the same product where it ran. The
xla rows write float32 products, the kernel's and tokamax's bf16 ones (as the engine uses them),
so theirs include bf16's rounding (~2e-3). "vs pallas" is the relative L2 difference of the whole
output to the first Pallas (Triton) row of the same product: an unwritten row shows there.
--impls picks the families timed (default all; "pallas" is the Triton kernel's default tiling,
"pallas-sweep" its other tilings; the xla rows at 32 slots take minutes and GBs of temporaries).
Each child writes OUT/grouped_gemm_<flag set>.json; the table is printed at the end.

What to expect (H200: ~3.2 TB/s through JAX, ~800 TFLOP/s bf16; per layer, bf16 weights):
  weights   gate/up 128 x 1408 x 2816 x 2 B = 1.015 GB, down 0.507 GB: streaming them takes
            0.32 + 0.16 ms per layer at any row count (every expert gets rows from 1 slot up:
            256 rows x 8 picks of 128), 14.3 ms per step over 30 layers (8-bit: 7.1 ms);
  FLOPs     2 x M x (2816 x 1408 + 704 x 2816) = 11.9 MFLOP per row: 24 / 195 / 780 GFLOP
            per layer at 1 / 8 / 32 slots, i.e. 0.03 / 0.24 / 0.98 ms per layer (0.9 / 7.3 /
            29.3 ms per step);
  rows      x, products and hidden rows: ~31 KB per assignment row per layer (x 5.6 KB,
            gate/up out 2.8 KB bf16, hidden 1.4 KB, down out 5.6 KB, each written and read):
            0.06 / 0.5 / 2.0 GB per layer (0.02 / 0.16 / 0.64 ms);
  so the experts' floor per step is ~15 ms at 1 slot (weights), ~20 ms at 8 (weights + rows),
  ~45 ms at 32 (FLOPs + rows); the dense rewrite does E / K = 16 times the FLOPs. The kernel is
  a plain Triton GEMM (no TMA, no warp specialization): 50-70% of the bandwidth at 1 slot and
  40-60% of the MMA rate at 32 slots would be a good result, i.e. per layer about 0.7 ms at 1
  slot, 0.8 ms at 8, 2-2.5 ms at 32 for both products.
  gated     the fused kernel skips the [M, 1408] bf16 product's write and read and XLA's pass
            over it (0.37 / 0.09 / 0.01 GB per layer at 32 / 8 / 1 slots; the pass measured 82
            us per layer at 32 slots in the engine's profile): about 0.1 ms per layer at 32
            slots (3 ms per step) if the epilogue's tanh and second accumulator cost the main
            loop nothing, little at 1 slot (the weights' stream dominates).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

# the families of variants --impls picks from
IMPLS = ("xla", "pallas", "pallas-sweep", "8bit", "tokamax", "gated", "jax-mgpu")
# jax's own Hopper ragged dot's tilings tried (block_m, block_n, block_k, max_concurrent_steps,
# grid_block_n), those whose block_n * grid_block_n divides N and block_k K
JAX_MGPU_TILINGS = (
    (128, 128, 64, 4, 1),
    (128, 128, 64, 5, 1),
    (64, 128, 64, 4, 1),
    (128, 256, 64, 3, 1),
    (128, 128, 64, 4, 2),
    (192, 128, 64, 4, 1),
    (128, 64, 64, 6, 2),
)
FLAG_SETS = {
    "default": "",
    "cudnn_ragged_dot": "--xla_gpu_experimental_use_ragged_dot_fusion=true",
}
SAMPLED_ROWS = 64
GATED = "gate_up+gelu"  # the gated family's product
LAYERS = 30  # 26B-A4B's decoder layers: a step runs the experts' products once per layer


def _import_tokamax():
    """tokamax, or the reason it does not import (xprof stubbed: tokamax imports it for its
    profiler-based timing only)."""
    try:
        import xprof  # noqa: F401
    except ImportError:
        tools = types.ModuleType("xprof.cli.tools")
        tools.get_kernel_stats_tool = None
        sys.modules.setdefault("xprof", types.ModuleType("xprof"))
        sys.modules.setdefault("xprof.cli", types.ModuleType("xprof.cli"))
        sys.modules.setdefault("xprof.cli.tools", tools)
    try:
        import tokamax

        return tokamax, None
    except Exception as e:  # noqa: BLE001 (only a report)
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def tiling(text: str):
    """A tiling written as its name, e.g. "128x256x64 w8 s3" (block_m x block_n x block_k,
    Triton's warps and stages)."""
    from pallas_kernels.matmul.grouped_matmul import GroupedMatmulBlockSizes

    try:
        blocks, warps, stages = text.split()
        bm, bn, bk = (int(b) for b in blocks.split("x"))
        return GroupedMatmulBlockSizes(bm, bn, bk, num_warps=int(warps.lstrip("w")), num_stages=int(stages.lstrip("s")))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"tiling {text!r}: expected e.g. '128x256x64 w8 s3' ({e})") from None


def sweep(rows: int, n: int, k: int, groups: int, extra=()):
    """The kernel's default tiling, then a few others around it, then `extra` where they divide N and K."""
    from pallas_kernels.matmul.grouped_matmul import GroupedMatmulBlockSizes, default_grouped_block_sizes

    base = default_grouped_block_sizes(rows, n, k, groups)
    others = [b for b in extra if n % b.block_n == 0 and k % b.block_k == 0 and b != base]
    for bm in (16, 32, 64, 128):
        if bm != base.block_m and bm <= rows and abs(bm.bit_length() - base.block_m.bit_length()) == 1:
            warps = 8 if bm * base.block_n >= 128 * 128 else 4
            others.append(GroupedMatmulBlockSizes(bm, base.block_n, base.block_k, warps, 4 if bm <= 64 else 3))
    if k % 128 == 0 and base.block_k != 128:
        others.append(GroupedMatmulBlockSizes(base.block_m, base.block_n, 128, base.num_warps, 3))
    return [base, *others]


def time_call(fn, *operands, repeats: int):
    """(ms, result, compiled) of a jitted fn: compile, one call, then the median of `repeats`."""
    import jax
    import numpy as np

    compiled = jax.jit(fn).lower(*operands).compile()
    result = jax.block_until_ready(compiled(*operands))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*operands))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times)), result, compiled


def rel(a, b) -> float:
    """Relative L2 difference of a to b (float64 on the host)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def gated_sweep(rows: int, f: int, k: int, groups: int, extra=()):
    """The gated kernel's default tiling, then its neighbours: half or twice the columns (of the
    gate's, the up's as many), half or twice the rows, both (e.g. 64 x 128 from 128 x 64), the
    other warp count, the other stage count, twice block_k; then `extra`. Those that fit F and K."""
    from pallas_kernels.matmul.grouped_matmul import GroupedMatmulBlockSizes, default_gated_block_sizes

    base = default_gated_block_sizes(rows, f, k, groups)
    bm, bn, bk = base.block_m, base.block_n, base.block_k

    def tiling(m, n):
        # two accumulators of m x n: 8 warps from 2 x 128 x 64 columns on, as the plain kernel's
        if m < 16 or n < 16:
            return None
        return GroupedMatmulBlockSizes(m, n, bk, 8 if m * 2 * n >= 128 * 128 else 4, 4 if m <= 64 else 3)

    candidates = [
        base,
        tiling(bm, bn // 2),
        tiling(bm, 2 * bn),
        tiling(bm // 2, bn),
        tiling(2 * bm, bn),
        tiling(bm // 2, 2 * bn),
        dataclasses.replace(base, num_warps=12 - base.num_warps),
        dataclasses.replace(base, num_stages=7 - base.num_stages),
        dataclasses.replace(base, block_k=2 * bk, num_stages=3),
        *extra,
    ]
    chosen = []
    for b in candidates:
        fits = b is not None and b.block_m <= min(128, max(16, rows)) and b.block_n <= f and k % b.block_k == 0
        if fits and b not in chosen:
            chosen.append(b)
    return chosen


def gated_child(args, out: dict, interpret: bool) -> None:
    """The gated family (--impls gated): for each slot count, gate/up + gelu * up as the experts
    run it today (plain kernel, then XLA) against the gated kernel's tilings (bf16 weights), then
    the 8-bit pair at the default tiling; rows appended to out["rows"], saved after each."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dllm_jax.models.gemma_layers import gelu_tanh
    from dllm_jax.models.quantization import fp8_rows, quantize_experts
    from pallas_kernels.matmul.grouped_matmul import default_gated_block_sizes, grouped_matmul, grouped_matmul_gated

    E, K = (8, 2) if args.tiny else (128, 8)
    D, F = (128, 64) if args.tiny else (2816, 704)
    dtype = jnp.bfloat16
    rng = np.random.default_rng(1)
    path = args.out / f"grouped_gemm_{args.flag_set}.json"

    def compare(result, baseline):
        """(relative L2 difference, share of unequal elements) of two [M, F] results, on the device."""
        a, b = result.astype(jnp.float32), baseline.astype(jnp.float32)
        diff = jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)
        return float(diff), float(jnp.mean(a != b))

    for mode in ("none", "int8-weights", "fp8"):
        for slots in args.slots:
            M = slots * (8 if args.tiny else 256) * K
            T = M // K
            sizes = jnp.asarray(np.bincount(rng.integers(0, E, M), minlength=E).astype(np.int32))
            row_group = jnp.asarray(np.repeat(np.arange(E), np.asarray(sizes)), jnp.int32)
            sample = jnp.asarray(np.sort(rng.choice(M, min(M, SAMPLED_ROWS), replace=False)))
            key_x, key_w = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
            tokens = jax.random.normal(key_x, (T, D), jnp.float32).astype(dtype)
            index = jnp.asarray(rng.integers(0, T, M), jnp.int32)
            w = (jax.random.normal(key_w, (E, 2 * F, D), jnp.float32) / np.sqrt(D)).astype(dtype)
            # the weights and rows as the product sees them, for the exact float32 reference
            rows = tokens[index[sample]].astype(jnp.float32)
            weights = w
            if mode == "none":
                operands = (tokens, w, sizes, None, None, index)
            else:
                q = quantize_experts(w, mode)
                weights = q["qkernel"].astype(jnp.float32) * q["scale"][..., None]
                if mode == "fp8":  # rows quantized per token row, before the gather (as the experts do)
                    xq, xs = fp8_rows(tokens)
                    rows = xq[index[sample]].astype(jnp.float32) * xs[index[sample]]
                    operands = (xq, q["qkernel"], sizes, q["scale"], xs[index, 0], index)
                else:
                    operands = (tokens, q["qkernel"], sizes, q["scale"], None, index)
            product = jnp.einsum("rk,rnk->rn", rows, weights[row_group[sample]].astype(jnp.float32))
            exact = jax.nn.gelu(product[:, :F], approximate=True) * product[:, F:]
            del weights

            def plain(x, w, s, w_scale, x_scale, i):
                return grouped_matmul(
                    x, w, s, w_scale, x_scale, out_dtype=dtype, fill_tail=False, interpret=interpret, row_index=i
                )

            def unfused(*a):
                y = plain(*a)
                return gelu_tanh(y[:, :F]) * y[:, F:]

            def fused(x, w, s, w_scale, x_scale, i, blocks=None):
                return grouped_matmul_gated(
                    x,
                    w,
                    s,
                    w_scale,
                    x_scale,
                    out_dtype=dtype,
                    fill_tail=False,
                    interpret=interpret,
                    block_sizes=blocks,
                    row_index=i,
                )

            suffix = "" if mode == "none" else "-" + ("int8" if mode == "int8-weights" else "fp8")
            tilings = (
                gated_sweep(M, F, D, E, args.tilings) if mode == "none" else [default_gated_block_sizes(M, F, D, E)]
            )
            variants = [(f"unfused gemm{suffix}", plain, None)] * (mode == "none")
            variants += [(f"unfused{suffix}", unfused, None)]
            variants += [(f"gated{suffix}", functools.partial(fused, blocks=b), b) for b in tilings]
            baseline = None
            weight_bytes = sum(a.size * a.dtype.itemsize for a in operands[1:4:2] if a is not None)
            for label, fn, blocks in variants:
                label = label if blocks is None else f"{label} {blocks.name}"
                row = {"slots": slots, "rows": M, "impl": label, "product": GATED}
                try:
                    ms, result, compiled = time_call(fn, *operands, repeats=args.repeats)
                    memory = compiled.memory_analysis()
                    row["temp_gib"] = (memory.temp_size_in_bytes / 2**30) if memory is not None else float("nan")
                    row["ragged_dots"], row["cudnn_calls"] = 0, 0
                    row["ms"] = ms
                    # the least a gated product moves: the weights, the gathered rows, [M, F] out
                    moved = weight_bytes + M * D * operands[0].dtype.itemsize + M * F * 2
                    row["tb_per_s"] = moved / (ms * 1e-3) / 1e12
                    row["tflop_per_s"] = 2 * M * 2 * F * D / (ms * 1e-3) / 1e12
                    if label.startswith("unfused gemm"):
                        # the [M, 2F] product alone: its error against the product's exact rows
                        row["rel_err"] = rel(result[sample], product)
                    else:
                        row["rel_err"] = rel(result[sample], exact)
                        if baseline is None:
                            baseline = result
                        else:
                            row["vs_unfused"], row["unequal"] = compare(result, baseline)
                    del compiled, result
                except Exception as e:  # noqa: BLE001 (a failed variant is reported)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
                path.write_text(json.dumps(out, indent=2))
            del tokens, w, operands, baseline


def gated_summary(rows: list[dict]) -> str:
    """Per slot count of the gated family: the unfused pair, the gated default and fastest
    tiling, and what the fastest saves per step (LAYERS layers); the fastest tilings are the
    candidates for default_gated_block_sizes."""
    lines = []
    for slots in sorted({r["slots"] for r in rows if r["product"] == GATED}, reverse=True):
        own = [r for r in rows if r["product"] == GATED and r["slots"] == slots and "ms" in r]
        by = {r["impl"]: r for r in own}
        gated = [r for r in own if r["impl"].startswith("gated ")]
        if "unfused" not in by or not gated:
            continue
        unfused, gemm = by["unfused"]["ms"], by.get("unfused gemm", {}).get("ms", float("nan"))
        default, best = gated[0], min(gated, key=lambda r: r["ms"])
        lines.append(
            f"{slots} slots ({own[0]['rows']} rows): unfused {unfused:.3f} ms (GEMM {gemm:.3f} + XLA gelu*up "
            f"{unfused - gemm:.3f}); gated default {default['ms']:.3f} ({default['impl'][6:]}); fastest "
            f"{best['ms']:.3f} ({best['impl'][6:]}, max unequal {max(r.get('unequal', 0) for r in gated):.1e}); "
            f"saves {unfused - best['ms']:.3f} ms per layer, {LAYERS * (unfused - best['ms']):.2f} ms per step"
        )
        for q in ("int8", "fp8"):
            if f"unfused-{q}" in by and any(r["impl"].startswith(f"gated-{q}") for r in own):
                fused = next(r for r in own if r["impl"].startswith(f"gated-{q}"))
                lines.append(
                    f"  {q}: unfused {by[f'unfused-{q}']['ms']:.3f} ms, gated {fused['ms']:.3f} "
                    f"(rel err {fused['rel_err']:.1e}, unequal {fused.get('unequal', float('nan')):.1e})"
                )
    return "\n".join(lines)


def child(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dllm_jax.models.quantization import GROUPED_ROWS, fp8_rows, quantize_experts, quantized_ragged_dot
    from pallas_kernels.matmul.grouped_matmul import grouped_matmul

    E, K = (8, 2) if args.tiny else (128, 8)
    D, F = (128, 64) if args.tiny else (2816, 704)
    on_gpu = jax.devices()[0].platform == "gpu"
    interpret = not on_gpu
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    out = {"flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0].device_kind), "rows": []}
    out["jax"] = jax.__version__
    try:
        from jax._src.lib import cuda_versions

        out["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as e:  # noqa: BLE001 (only a report)
        out["cudnn"] = f"unknown ({type(e).__name__})"
    kernels = args.flag_set == "default"
    impls = set(args.impls)
    tokamax_wanted = kernels and "tokamax" in impls
    tokamax, why = (
        _import_tokamax() if tokamax_wanted and on_gpu else (None, "not on a GPU" if tokamax_wanted else None)
    )
    out["tokamax"] = getattr(tokamax, "__version__", None) or why

    timed = functools.partial(time_call, repeats=args.repeats)
    if "gated" in impls and kernels:
        gated_child(args, out, interpret)
        impls -= {"gated"}
        if not impls:
            return
    for slots in args.slots:
        M = slots * (8 if args.tiny else 256) * K
        groups = np.bincount(rng.integers(0, E, M), minlength=E).astype(np.int32)
        sizes = jnp.asarray(groups)
        row_group = jnp.asarray(np.repeat(np.arange(E), groups), jnp.int32)
        sample = jnp.asarray(np.sort(rng.choice(M, min(M, SAMPLED_ROWS), replace=False)))
        for name, n_out, n_in in (("gate_up", 2 * F, D), ("down", D, F)):
            # made on the device (a host-made [128, 1408, 2816] float64 array takes seconds)
            key_x, key_w = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
            x = jax.random.normal(key_x, (M, n_in), jnp.float32).astype(dtype)
            tokens = index = None
            if name == "gate_up":  # the rows as the engine makes them: k picks of each token row
                tokens, index = x[: M // K], jnp.asarray(rng.integers(0, M // K, M), jnp.int32)
                x = tokens[index]
            w = (jax.random.normal(key_w, (E, n_out, n_in), jnp.float32) / np.sqrt(n_in)).astype(dtype)
            eight_bit = kernels and "8bit" in impls
            quantized = {mode: quantize_experts(w, mode) for mode in ("int8-weights", "fp8")} if eight_bit else {}

            def exact(xs, ws, _x=x):
                """float32 products of the sampled rows with their experts' (dequantized) weights."""
                rows = _x[sample].astype(jnp.float32) if xs is None else xs
                return jnp.einsum("rk,rnk->rn", rows, ws[row_group[sample]].astype(jnp.float32))

            def dequantized(q):
                return q["qkernel"].astype(jnp.float32) * q["scale"][..., None]

            want = {"none": exact(None, w)}
            if eight_bit:
                want["int8-weights"] = exact(None, dequantized(quantized["int8-weights"]))
                xq, xs = fp8_rows(x[sample])  # the rows as the fp8 paths see them
                want["fp8"] = exact(xq.astype(jnp.float32) * xs, dequantized(quantized["fp8"]))
            variants = [("xla", "none", None), ("xla-ragged_dot", "none", None)] if "xla" in impls else []
            if kernels and {"pallas", "pallas-sweep"} & impls:
                default, *others = sweep(M, n_out, n_in, E, args.tilings)
                chosen = ([default] if "pallas" in impls else []) + (others if "pallas-sweep" in impls else [])
                variants += [("pallas", "none", blocks) for blocks in chosen]
                if "pallas" in impls and tokens is not None:
                    variants.append(("pallas-gathered", "none", None))
            if eight_bit:
                variants += [(f"{impl}-{q}", mode, None) for mode, q in (("int8-weights", "int8"), ("fp8", "fp8"))
                             for impl in ("xla", "pallas")]  # fmt: skip
            if tokamax is not None:
                variants += [("tokamax", "none", None), ("tokamax-kn", "none", None)]
            if kernels and "jax-mgpu" in impls and on_gpu:
                variants += [
                    ("jax-mgpu", "none", t) for t in JAX_MGPU_TILINGS if n_out % (t[1] * t[4]) == 0 and n_in % t[2] == 0
                ]
            xla_result, pallas_result = {}, None
            for impl, mode, blocks in variants:
                label = (
                    impl
                    if blocks is None
                    else f"{impl} {'x'.join(map(str, blocks)) if impl == 'jax-mgpu' else blocks.name}"
                )
                row = {"slots": slots, "rows": M, "impl": label, "product": name}
                q = quantized.get(mode)
                try:
                    if impl == "xla":
                        fn = lambda r, w, s: jax.lax.ragged_dot_general(  # noqa: E731
                            r, w, s, GROUPED_ROWS, preferred_element_type=jnp.float32
                        )
                        operands = (x, w, sizes)
                    elif impl == "xla-ragged_dot":
                        fn = lambda r, w, s: jax.lax.ragged_dot(r, w, s, preferred_element_type=jnp.float32)  # noqa: E731
                        operands = (x, jnp.swapaxes(w, 1, 2), sizes)
                    elif impl.startswith("xla-"):
                        fn = lambda r, qk, sc, s, g: quantized_ragged_dot(r, qk, sc, s, g, jnp.float32)  # noqa: E731
                        operands = (x, q["qkernel"], q["scale"], sizes, row_group)
                    elif impl == "pallas":
                        fn = lambda r, w, s, b=blocks: grouped_matmul(  # noqa: E731
                            r, w, s, out_dtype=dtype, interpret=interpret, block_sizes=b
                        )
                        operands = (x, w, sizes)
                    elif impl == "pallas-gathered":  # the token rows, gathered by the kernel
                        fn = lambda t, w, s, i: grouped_matmul(  # noqa: E731
                            t, w, s, out_dtype=dtype, interpret=interpret, row_index=i
                        )
                        operands = (tokens, w, sizes, index)
                    elif impl == "pallas-fp8":

                        def fn(r, qk, sc, s):
                            xq, xs = fp8_rows(r)
                            return grouped_matmul(xq, qk, s, sc, xs[:, 0], out_dtype=dtype, interpret=interpret)

                        operands = (x, q["qkernel"], q["scale"], sizes)
                    elif impl == "pallas-int8":
                        fn = lambda r, qk, sc, s: grouped_matmul(  # noqa: E731
                            r, qk, s, sc, out_dtype=dtype, interpret=interpret
                        )
                        operands = (x, q["qkernel"], q["scale"], sizes)
                    elif impl == "jax-mgpu":  # jax's Hopper example kernel (wgmma, TMA), on our [E, out, in]
                        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

                        bm, bn, bk, steps, gbn = blocks
                        fn = lambda r, w, s: ragged_dot_mgpu.ragged_dot(  # noqa: E731
                            r, w, group_sizes=s, block_m=bm, block_n=bn, block_k=bk,
                            max_concurrent_steps=steps, grid_block_n=gbn, transpose_rhs=True,
                        )  # fmt: skip
                        operands = (x, w, sizes)
                    else:  # tokamax: Mosaic GPU, on our layout or on [E, in, out]
                        from tokamax._src.ops.ragged_dot.base import TRANS_RHS_RAGGED_DOT_DIM_NUMS

                        if impl == "tokamax":
                            fn = lambda r, w, s: tokamax.ragged_dot_general(  # noqa: E731
                                r, w, s, TRANS_RHS_RAGGED_DOT_DIM_NUMS, preferred_element_type=dtype,
                                implementation="mosaic",
                            )  # fmt: skip
                            operands = (x, w, sizes)
                        else:
                            fn = lambda r, w, s: tokamax.ragged_dot(  # noqa: E731
                                r, w, s, preferred_element_type=dtype, implementation="mosaic"
                            )
                            operands = (x, jnp.swapaxes(w, 1, 2), sizes)
                    ms, result, compiled = timed(fn, *operands)
                    text = compiled.as_text() or ""
                    row["ragged_dots"] = text.count("ragged-dot(")
                    row["cudnn_calls"] = text.count("__cudnn")
                    memory = compiled.memory_analysis()
                    row["temp_gib"] = (memory.temp_size_in_bytes / 2**30) if memory is not None else float("nan")
                    row["ms"] = ms
                    weight = sum(a.size * a.dtype.itemsize for a in operands[1:2] + ((q["scale"],) if q else ()))
                    # every expert's weights read once, the rows read and the products written once
                    moved = weight + x.size * x.dtype.itemsize + M * n_out * result.dtype.itemsize
                    row["tb_per_s"] = moved / (ms * 1e-3) / 1e12
                    row["tflop_per_s"] = 2 * M * n_out * n_in / (ms * 1e-3) / 1e12
                    row["rel_err"] = rel(result[sample], want[mode])
                    if impl.startswith("xla") and impl != "xla-ragged_dot":
                        xla_result[mode] = result
                    elif mode in xla_result:
                        row["vs_xla"] = rel(result, xla_result[mode])
                    if impl == "pallas" and pallas_result is None:
                        pallas_result = result
                    elif (
                        impl in ("pallas", "pallas-gathered", "tokamax", "tokamax-kn", "jax-mgpu")
                        and pallas_result is not None
                    ):
                        row["vs_pallas"] = rel(result, pallas_result)
                    del compiled, result
                except Exception as e:  # noqa: BLE001 (a failed variant is reported)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
                (args.out / f"grouped_gemm_{args.flag_set}.json").write_text(json.dumps(out, indent=2))
            del x, w, tokens, index, quantized, xla_result, pallas_result
    (args.out / f"grouped_gemm_{args.flag_set}.json").write_text(json.dumps(out, indent=2))


def table(reports: dict) -> str:
    nan = float("nan")
    lines = [
        "| flags | slots | rows | impl | product | ms | TB/s | TFLOP/s | rel err | vs xla | vs pallas / unfused "
        "| unequal | ragged dots | cuDNN | temp GiB |",
        "|" + "---|" * 15,
    ]
    for flag_set, report in reports.items():
        for r in report["rows"]:
            head = f"| {flag_set} | {r['slots']} | {r['rows']} | {r['impl']} | {r['product']} |"
            if "error" in r:
                lines.append(f"{head} {r['error'][:120]} |")
                continue
            lines.append(
                f"{head} {r['ms']:.3f} | {r['tb_per_s']:.2f} | {r['tflop_per_s']:.1f} | {r['rel_err']:.1e} | "
                f"{r.get('vs_xla', nan):.1e} | {r.get('vs_pallas', r.get('vs_unfused', nan)):.1e} | "
                f"{r.get('unequal', nan):.1e} | {r['ragged_dots']} | {r['cudnn_calls']} | {r['temp_gib']:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--flag-sets", nargs="+", default=list(FLAG_SETS), choices=list(FLAG_SETS))
    p.add_argument("--flag-set", help=argparse.SUPPRESS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS, help="the families of variants timed")
    p.add_argument("--timeout-s", type=float, default=None, help="per flag set (default 150, the cuDNN set 60)")
    p.add_argument(
        "--tilings",
        nargs="+",
        type=tiling,
        default=[],
        help="more Triton tilings for pallas-sweep, e.g. '128x256x64 w8 s3'",
    )
    p.add_argument("--out", type=Path, default=Path("grouped_gemm_out"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.flag_set:
        child(args)
        return 0
    reports = {}
    for flag_set in args.flag_sets:
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAG_SETS[flag_set]}".strip()}
        command = [sys.executable, __file__, "--flag-set", flag_set, "--out", str(args.out)]
        command += ["--repeats", str(args.repeats), "--slots", *map(str, args.slots), "--impls", *args.impls] + (
            ["--tiny"] if args.tiny else []
        )
        command += ["--tilings", *(b.name for b in args.tilings)] if args.tilings else []
        timeout = args.timeout_s or (150.0 if flag_set == "default" else 60.0)
        try:
            subprocess.run(command, env=env, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"{flag_set}: stopped after {timeout} s", flush=True)
        path = args.out / f"grouped_gemm_{flag_set}.json"
        reports[flag_set] = json.loads(path.read_text()) if path.exists() else {"rows": []}
        print(f"{flag_set}: cudnn {reports[flag_set].get('cudnn')}, tokamax {reports[flag_set].get('tokamax')}")
    text = table(reports)
    summary = gated_summary(reports.get("default", {"rows": []})["rows"])
    text += f"\n\ngated (gate/up + gelu * up):\n{summary}" if summary else ""
    (args.out / "grouped_gemm.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
