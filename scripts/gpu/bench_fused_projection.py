"""The Mosaic GPU fused projection (q/k/v GEMM + RoPE + cache write) against the XLA path, H200.

    PYTHONPATH=. python scripts/gpu/bench_fused_projection.py                 # ~3 min: checks + defaults
    PYTHONPATH=. python scripts/gpu/bench_fused_projection.py --checks quick --sweep --budget-s 150
    PYTHONPATH=. python scripts/gpu/bench_fused_projection.py --tiny          # CPU smoke test (interpreted)

One run, LLaDA-8B layer shapes (d_model 4096, 32 heads of 128, 128 query rows per slot,
1 / 8 / 32 slots, a flat cache of 32 slots x 2048 positions, 2 stacked layers):
1. correctness on the GPU (--checks full): the kernels' default tilings (and the
   one-warpgroup tiling) against their jnp references on fresh random data with NaN-poisoned
   caches (q, the named cache rows, every other row untouched), at 1 and 8 slots and on a
   small Dream-like case (biases, grouped-query heads, rows not a multiple of the tile);
   --checks quick: 8 slots, default tilings only;
2. per slot count, side by side in one process, the median time per call of
   bf16: "xla": three cuBLAS GEMMs (float32 products) + XLA's RoPE + the Pallas row-scatter
        kernel, over per-layer weights (what backend "auto" runs today); "mosaic": the kernel
        (its default tiling), over the stacked weights it indexes in place;
   fp8: "xla": the engine's quantized_matmul per projection (per-row abs-max and convert in
        XLA, cuBLASLt FP8 GEMM) + RoPE + scatter; "xla, x pre-quantized": the same without the
        activation quantization (not with --checks quick); "mosaic": the FP8 kernel on
        pre-quantized rows (its producer writes them; no quantization pass is counted);
   each variant a jitted chain of calls (q feeds the next call's rows, the caches are carried
   and donated, so nothing is hoisted), warm-up and compile excluded;
3. --sweep: the SWEEP tilings, largest slot count first, while --budget-s lasts.
Prints a table (us per call, TFLOP/s, xla time / variant time) and writes JSON to --out
(default $OUT), updated after every slot count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models.quantization import compiler_options, quantize_kernel, quantized_matmul
from pallas_kernels.norm.rms_norm import rms_norm
from pallas_kernels.projection.qkv_rope_cache import qkv_rope_cache_reference
from pallas_kernels.projection.qkv_rope_cache_mosaic import (
    MosaicQKVBlockSizes,
    default_mosaic_block_sizes,
    qkv_rope_cache_mosaic,
    qkv_rope_cache_mosaic_fp8,
    qkv_rope_cache_mosaic_fp8_reference,
)
from pallas_kernels.projection.quantize_rows import (
    quantize_rows_reference,
    rms_norm_quantize,
    rms_norm_quantize_reference,
    swiglu_quantize,
    swiglu_quantize_reference,
)
from pallas_kernels.projection.rope import apply_rope, rope_cos_sin
from pallas_kernels.projection.scatter_rows import scatter_kv_rows

THETA = 500000.0
D, HEADS, HEAD_DIM, ROWS_PER_SLOT, MAX_LEN, CACHE_SLOTS, LAYERS = 4096, 32, 128, 128, 2048, 32, 2
SLOTS = (1, 8, 32)
FF, EPS = 12288, 1e-5  # LLaDA-8B's SwiGLU width and RMSNorm epsilon
INNER = {1: 24, 8: 12, 32: 6}  # chained calls per timed program
INTERPRET = False  # --tiny: CPU smoke test of the script (tiny shapes, the kernels interpreted)
RUNS_PER_SAMPLE = 3
# Extra tilings (--sweep): (rows per warpgroup, reduction tile, stages, compute warpgroups,
# wgmma groups in flight). Shared memory per program: stages x (program rows x BK + BK x 128)
# operand bytes + the rounded tiles (wgs x rows x 128 x 2 bytes), under 227 KB. Of these only
# the one-warpgroup tilings were timed (at 1 slot, 2026-12-02): the runs' device time went to
# the checks and the defaults.
SWEEP = {
    "bf16": [
        MosaicQKVBlockSizes(64, 64, 4, 2, 1),
        MosaicQKVBlockSizes(128, 64, 3, 2, 0),
        MosaicQKVBlockSizes(64, 64, 2, 2, 1),
        MosaicQKVBlockSizes(64, 64, 4, 1, 1),
    ],
    "fp8": [
        MosaicQKVBlockSizes(64, 128, 4, 2, 1),
        MosaicQKVBlockSizes(128, 128, 3, 2, 0),
        MosaicQKVBlockSizes(64, 128, 4, 1, 1),
    ],
}
FP8_OPTIONS = compiler_options("fp8") or None


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tiling_name(t: MosaicQKVBlockSizes) -> str:
    return f"bm{t.block_rows} bk{t.block_d} s{t.max_concurrent_steps} wg{t.compute_wgs} f{t.wgmma_in_flight}"


def flat_rows(rng, slots: int) -> np.ndarray:
    """128 distinct positions per slot (the last position, the trash row, excluded)."""
    per_slot = [s * MAX_LEN + rng.choice(MAX_LEN - 1, ROWS_PER_SLOT, replace=False) for s in range(slots)]
    return np.concatenate(per_slot).astype(np.int32)


# ----------------------------------------------------------------------------- correctness


def check_case(rng, *, n_rows, d_model, heads, kv_heads, head_dim, n_cache_rows, biased, fp8, tiling):
    """Kernel vs reference on one fresh case; returns the worst relative L2 error (NaN if a
    named row was not written or another row changed)."""
    kv_width = kv_heads * head_dim
    x = jnp.asarray(rng.standard_normal((n_rows, d_model)), jnp.bfloat16)
    ws = [
        jnp.asarray(rng.standard_normal((LAYERS, d_model, w)) / np.sqrt(d_model), jnp.bfloat16)
        for w in (heads * head_dim, kv_width, kv_width)
    ]
    biases = tuple(jnp.asarray(rng.standard_normal((LAYERS, w.shape[2])), jnp.bfloat16) for w in ws) if biased else None
    positions = jnp.asarray(rng.integers(0, 4096, n_rows), jnp.int32)
    rows = rng.choice(n_cache_rows - 1, n_rows, replace=False).astype(np.int32)
    rows[-3:] = n_cache_rows - 1  # padding rows
    cache = np.asarray(rng.standard_normal((LAYERS, n_cache_rows, kv_width)), np.float32)
    cache[:, rng.random(n_cache_rows) < 0.5] = np.nan
    layer = 1
    kw = dict(n_heads=heads, n_kv_heads=kv_heads, rope_theta=THETA)
    caches = lambda: (jnp.asarray(cache, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16))  # noqa: E731
    if fp8:
        x32 = x.astype(jnp.float32)
        x_scale = jnp.max(jnp.abs(x32), axis=1) / 448.0
        xq = (x32 / x_scale[:, None]).astype(jnp.float8_e4m3fn)
        quant = [quantize_kernel(w, "fp8") for w in ws]
        args = (xq, x_scale, tuple(q["qkernel"] for q in quant), tuple(q["scale"] for q in quant))
        got = qkv_rope_cache_mosaic_fp8(
            *args, positions, rows, *caches(), layer, biases, **kw, block_sizes=tiling, interpret=INTERPRET
        )
        want = qkv_rope_cache_mosaic_fp8_reference(*args, positions, rows, *caches(), layer, biases, **kw)
    else:
        got = qkv_rope_cache_mosaic(
            x, *ws, positions, rows, *caches(), layer, biases, **kw, block_sizes=tiling, interpret=INTERPRET
        )
        want = qkv_rope_cache_reference(x, *ws, positions, rows, *caches(), layer, biases, **kw)
    got = [np.asarray(a.astype(jnp.float32)) for a in got]
    want = [np.asarray(a.astype(jnp.float32)) for a in want]
    named = rows[rows != n_cache_rows - 1]
    touched = np.zeros(cache.shape[:2], bool)
    touched[layer, named] = touched[layer, -1] = True
    before = np.asarray(jnp.asarray(cache, jnp.bfloat16).astype(jnp.float32))
    errors = [rel_l2(got[0], want[0])]
    for g, w in zip(got[1:], want[1:]):
        if not np.isfinite(g[layer, named]).all() or not np.array_equal(g[~touched], before[~touched], equal_nan=True):
            errors.append(float("nan"))
        errors.append(rel_l2(g[layer, named], w[layer, named]))
    return max(errors) if not any(np.isnan(errors)) else float("nan")


def run_checks(results: dict, quick: bool) -> None:
    """The default tiling of each case (and, unless quick, the single-warpgroup tiling too)
    against the reference; quick: 8 slots only."""
    rng = np.random.default_rng(0)
    cases = [
        dict(
            n_rows=ROWS_PER_SLOT * s,
            d_model=D,
            heads=HEADS,
            kv_heads=HEADS,
            head_dim=HEAD_DIM,
            n_cache_rows=s * MAX_LEN + 1,
            biased=False,
            name=f"llada {s} slot(s)",
        )
        for s in (SLOTS[1:2] if quick else SLOTS[:2])
    ]
    if not quick:
        small = 256 if INTERPRET else 1024
        cases.append(
            dict(
                n_rows=200,
                d_model=small,
                heads=8,
                kv_heads=2,
                head_dim=128,
                n_cache_rows=4 * 512 + 1,
                biased=True,
                name="dream-like: biases, 8/2 heads, 200 rows",
            )
        )
    for case in cases:
        name = case.pop("name")
        for fp8 in (False, True):
            dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
            tilings = [default_mosaic_block_sizes(dtype, case["n_rows"])]
            if not quick:
                tilings.append(default_mosaic_block_sizes(dtype, 1))  # the single-warpgroup path
            for tiling in dict.fromkeys(tilings):
                key = f"{'fp8' if fp8 else 'bf16'} {name} {tiling_name(tiling)}"
                try:
                    err = check_case(rng, **case, fp8=fp8, tiling=tiling)
                    ok = np.isfinite(err) and err < (2e-2 if fp8 else 1e-2)
                    results["checks"][key] = {"max_rel_l2": err, "ok": bool(ok)}
                except Exception as e:  # noqa: BLE001  (a failing variant must not end the run)
                    results["checks"][key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                    traceback.print_exc()
                print("check", key, results["checks"][key], flush=True)


# ----------------------------------------------------------------------------- timing


def time_chain(step, carry, consts, *, inner: int, repeats: int, options=None):
    """(seconds per call, carry) of `inner` chained calls step(i, carry, consts) in one jitted
    program (the carry donated), median over `repeats` samples of RUNS_PER_SAMPLE programs."""

    def run(carry, consts):
        for i in range(inner):
            carry = step(i, carry, consts)
        return carry

    run = jax.jit(run, donate_argnums=0, compiler_options=options)
    carry = jax.block_until_ready(run(carry, consts))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(RUNS_PER_SAMPLE):
            carry = run(carry, consts)
        jax.block_until_ready(carry)
        samples.append((time.perf_counter() - start) / (RUNS_PER_SAMPLE * inner))
    return statistics.median(samples), carry


def xla_project(x, ws, positions, rows, k_cache, v_cache, layer, fp8):
    """The XLA path of one layer: GEMMs with float32 products, RoPE, the Pallas row scatter."""
    n = x.shape[0]
    if fp8:
        proj = [quantized_matmul(x, w["qkernel"], w["scale"], jnp.float32) for w in ws]
    else:
        proj = [jnp.dot(x, w, preferred_element_type=jnp.float32) for w in ws]
    cos, sin = rope_cos_sin(positions, HEAD_DIM, THETA)
    cos, sin = cos[:, None, :], sin[:, None, :]
    q = apply_rope(proj[0].reshape(n, -1, HEAD_DIM), cos, sin).reshape(n, -1).astype(jnp.bfloat16)
    k = apply_rope(proj[1].reshape(n, -1, HEAD_DIM), cos, sin).reshape(n, -1).astype(jnp.bfloat16)
    v = proj[2].astype(jnp.bfloat16)
    k_cache, v_cache = scatter_kv_rows(k_cache, v_cache, k, v, rows, jnp.int32(layer), interpret=INTERPRET)
    return q, k_cache, v_cache


def xla_project_prequantized(xq, ws, positions, rows, k_cache, v_cache, layer):
    """The fp8 XLA path with the rows already quantized (x_scale = 1)."""
    n = xq.shape[0]
    contract = (((1,), (1,)), ((), ()))
    proj = [
        jax.lax.dot_general(xq, w["qkernel"], contract, preferred_element_type=jnp.float32) * w["scale"] for w in ws
    ]
    cos, sin = rope_cos_sin(positions, HEAD_DIM, THETA)
    cos, sin = cos[:, None, :], sin[:, None, :]
    q = apply_rope(proj[0].reshape(n, -1, HEAD_DIM), cos, sin).reshape(n, -1).astype(jnp.bfloat16)
    k = apply_rope(proj[1].reshape(n, -1, HEAD_DIM), cos, sin).reshape(n, -1).astype(jnp.bfloat16)
    k_cache, v_cache = scatter_kv_rows(
        k_cache, v_cache, k, proj[2].astype(jnp.bfloat16), rows, jnp.int32(layer), interpret=INTERPRET
    )
    return q, k_cache, v_cache


def make_weights(key):
    """Per-layer bf16 weights [D, 4096] x 3 and their FP8 leaves, LAYERS layers, plus the
    stacked arrays the kernels read."""
    keys = jax.random.split(key, 3 * LAYERS)
    per_layer = [
        [jax.random.normal(keys[3 * l + j], (D, HEADS * HEAD_DIM), jnp.bfloat16) / float(np.sqrt(D)) for j in range(3)]
        for l in range(LAYERS)
    ]
    fp8_layer = [[quantize_kernel(w, "fp8") for w in ws] for ws in per_layer]
    stacked = tuple(jnp.stack([per_layer[l][j] for l in range(LAYERS)]) for j in range(3))
    stacked_q = tuple(jnp.stack([fp8_layer[l][j]["qkernel"] for l in range(LAYERS)]) for j in range(3))
    stacked_s = tuple(jnp.stack([fp8_layer[l][j]["scale"] for l in range(LAYERS)]) for j in range(3))
    return per_layer, fp8_layer, stacked, stacked_q, stacked_s


def bench_slots(results, slots, weights, caches, budget_end, extra: bool):
    per_layer, fp8_layer, stacked, stacked_q, stacked_s = weights
    rng = np.random.default_rng(slots)
    n = ROWS_PER_SLOT * slots
    rows = jnp.asarray(flat_rows(rng, slots))
    positions = jnp.asarray(rng.integers(0, 4096, n), jnp.int32)
    x = jax.random.normal(jax.random.key(slots), (n, D), jnp.bfloat16)
    inner = INNER[slots]
    repeats = 2 if INTERPRET else 5
    flops = 2 * n * D * 3 * HEADS * HEAD_DIM
    entry = results["timings"].setdefault(str(slots), {})
    kw = dict(n_heads=HEADS, n_kv_heads=HEADS, rope_theta=THETA)

    def record(name, step, rows_in, options=None):
        """Times one variant; rows_in: its first call's rows (copied: the chain donates them)."""
        nonlocal caches
        if name in entry:
            return
        try:
            carry = (jnp.array(rows_in, copy=True), *caches)
            seconds, carry = time_chain(step, carry, None, inner=inner, repeats=repeats, options=options)
            caches = carry[1:3]
            entry[name] = {"us": seconds * 1e6, "tflops": flops / seconds / 1e12}
        except Exception as e:  # noqa: BLE001
            entry[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            traceback.print_exc()
        print(f"slots={slots} {name}: {entry[name]}", flush=True)

    def bf16_xla(i, c, _):
        x, k, v = c
        return xla_project(x, per_layer[i % LAYERS], positions, rows, k, v, i % LAYERS, False)

    def bf16_mosaic(tiling):
        def step(i, c, _):
            x, k, v = c
            return qkv_rope_cache_mosaic(
                x, *stacked, positions, rows, k, v, i % LAYERS, **kw, block_sizes=tiling, interpret=INTERPRET
            )

        return step

    def fp8_xla(i, c, _):
        x, k, v = c
        return xla_project(x, fp8_layer[i % LAYERS], positions, rows, k, v, i % LAYERS, True)

    ones = jnp.ones((n,), jnp.float32)

    def fp8_xla_pre(i, c, _):
        xq, k, v = c
        q, k, v = xla_project_prequantized(xq, fp8_layer[i % LAYERS], positions, rows, k, v, i % LAYERS)
        return q.astype(jnp.float8_e4m3fn), k, v

    def fp8_mosaic(tiling):
        def step(i, c, _):
            xq, k, v = c
            q, k, v = qkv_rope_cache_mosaic_fp8(
                xq,
                ones,
                stacked_q,
                stacked_s,
                positions,
                rows,
                k,
                v,
                i % LAYERS,
                **kw,
                block_sizes=tiling,
                interpret=INTERPRET,
            )
            return q.astype(jnp.float8_e4m3fn), k, v

        return step

    xq = x.astype(jnp.float8_e4m3fn)
    bf16_default = default_mosaic_block_sizes(jnp.bfloat16, n)
    fp8_default = default_mosaic_block_sizes(jnp.float8_e4m3fn, n)
    if not extra:
        record("bf16 xla", bf16_xla, x)
        record(f"bf16 mosaic {tiling_name(bf16_default)} (default)", bf16_mosaic(None), x)
        record("fp8 xla", fp8_xla, x, FP8_OPTIONS)
        record("fp8 xla, x pre-quantized", fp8_xla_pre, xq, FP8_OPTIONS)
        record(f"fp8 mosaic {tiling_name(fp8_default)} (default)", fp8_mosaic(None), xq, FP8_OPTIONS)
    else:
        for tiling in SWEEP["bf16"]:
            if time.time() < budget_end and tiling != bf16_default:
                record(f"bf16 mosaic {tiling_name(tiling)}", bf16_mosaic(tiling), x)
        for tiling in SWEEP["fp8"]:
            if time.time() < budget_end and tiling != fp8_default:
                record(f"fp8 mosaic {tiling_name(tiling)}", fp8_mosaic(tiling), xq, FP8_OPTIONS)
    return caches


def dequantize(q, scale, dtype):
    return (q.astype(jnp.float32) * scale[:, None]).astype(dtype)


def check_producers(results) -> None:
    """The two FP8 producer kernels against their references at 8 slots' rows."""
    rng = np.random.default_rng(1)
    n = ROWS_PER_SLOT * SLOTS[min(1, len(SLOTS) - 1)]
    x = jnp.asarray(rng.standard_normal((n, D)) * 3, jnp.bfloat16)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.bfloat16)
    gate, up = (jnp.asarray(rng.standard_normal((n, FF)) * 2, jnp.bfloat16) for _ in range(2))
    for name, got, want in (
        (
            "rms_norm_quantize",
            lambda: rms_norm_quantize(x, weight, EPS, interpret=INTERPRET),
            lambda: rms_norm_quantize_reference(x, weight, EPS),
        ),
        (
            "swiglu_quantize",
            lambda: swiglu_quantize(gate, up, interpret=INTERPRET),
            lambda: swiglu_quantize_reference(gate, up),
        ),
    ):
        try:
            (q, scale), (q_ref, scale_ref) = got(), want()
            err = rel_l2(dequantize(q, scale, jnp.float32), dequantize(q_ref, scale_ref, jnp.float32))
            differ = float(np.mean(np.asarray(q.astype(jnp.float32)) != np.asarray(q_ref.astype(jnp.float32))))
            results["checks"][f"{name} {n} rows"] = {
                "max_rel_l2": err,
                "fp8_elements_differing": differ,
                "ok": bool(err < 1e-2 and differ < 0.01),
            }
        except Exception as e:  # noqa: BLE001
            results["checks"][f"{name} {n} rows"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            traceback.print_exc()
        print("check", name, results["checks"][f"{name} {n} rows"], flush=True)


def bench_producers(results, slots) -> None:
    """The FP8 producers against XLA's producer + per-row quantization (the fp8 engine's path
    today), each a chain whose next input is the dequantized output (one elementwise pass,
    the same in both)."""
    n = ROWS_PER_SLOT * slots
    keys = jax.random.split(jax.random.key(100 + slots), 4)
    x = jax.random.normal(keys[0], (n, D), jnp.bfloat16)
    weight = (1 + 0.1 * jax.random.normal(keys[1], (D,), jnp.float32)).astype(jnp.bfloat16)
    gate = jax.random.normal(keys[2], (n, FF), jnp.bfloat16)
    up = jax.random.normal(keys[3], (n, FF), jnp.bfloat16)
    entry = results["producers"].setdefault(str(slots), {})
    variants = (
        (
            "rms_norm + quantize: xla",
            lambda i, c, w: dequantize(*quantize_rows_reference(rms_norm(c, w, EPS)), c.dtype),
            x,
            weight,
        ),
        (
            "rms_norm + quantize: kernel",
            lambda i, c, w: dequantize(*rms_norm_quantize(c, w, EPS, interpret=INTERPRET), c.dtype),
            x,
            weight,
        ),
        (
            "swiglu + quantize: xla",
            lambda i, c, u: dequantize(*quantize_rows_reference(jax.nn.silu(c) * u), c.dtype),
            gate,
            up,
        ),
        (
            "swiglu + quantize: kernel",
            lambda i, c, u: dequantize(*swiglu_quantize(c, u, interpret=INTERPRET), c.dtype),
            gate,
            up,
        ),
    )
    for name, step, carry, consts in variants:
        try:
            seconds, _ = time_chain(
                step,
                jnp.array(carry, copy=True),
                consts,
                inner=INNER[slots],
                repeats=2 if INTERPRET else 5,
                options=FP8_OPTIONS,
            )
            entry[name] = {"us": seconds * 1e6}
        except Exception as e:  # noqa: BLE001
            entry[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            traceback.print_exc()
        print(f"slots={slots} {name}: {entry[name]}", flush=True)


def print_table(results) -> None:
    print("\n| slots | variant | us / call | TFLOP/s | xla / variant |")
    print("|---|---|---|---|---|")
    for slots, entry in results["timings"].items():
        for name, r in entry.items():
            if "us" not in r:
                print(f"| {slots} | {name} | {r.get('error', '?')[:80]} | | |")
                continue
            base = entry.get("fp8 xla" if name.startswith("fp8") else "bf16 xla", {})
            ratio = f"{base['us'] / r['us']:.2f}" if "us" in base else "-"
            print(f"| {slots} | {name} | {r['us']:.1f} | {r['tflops']:.0f} | {ratio} |")
    print("\n| slots | FP8 producer | us / call | xla / kernel |")
    print("|---|---|---|---|")
    for slots, entry in results["producers"].items():
        for name, r in entry.items():
            base = entry.get(name.replace("kernel", "xla"), {})
            ratio = f"{base['us'] / r['us']:.2f}" if "us" in r and "us" in base else "-"
            print(
                f"| {slots} | {name} | {r['us']:.1f} | {ratio} |"
                if "us" in r
                else f"| {slots} | {name} | {r.get('error', '?')[:80]} | |"
            )
    print("\n| check | max rel L2 | ok |")
    print("|---|---|---|")
    for name, r in results["checks"].items():
        print(f"| {name} | {r.get('max_rel_l2', r.get('error', '?'))} | {r.get('ok', False)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no sweep tiling after this many seconds")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench_fused_projection.json")
    parser.add_argument("--skip-producers", action="store_true", help="do not time the FP8 producer kernels")
    parser.add_argument(
        "--checks",
        choices=("full", "quick", "none"),
        default="quick",
        help="full: default tilings at 1 and 8 slots + a Dream-like case; quick: 8 slots only",
    )
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP tilings (within --budget-s)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, kernels interpreted")
    args = parser.parse_args()
    if args.tiny:
        global D, FF, HEADS, MAX_LEN, CACHE_SLOTS, SLOTS, INNER, INTERPRET, RUNS_PER_SAMPLE
        D, FF, HEADS, MAX_LEN, CACHE_SLOTS, SLOTS, INTERPRET, RUNS_PER_SAMPLE = 256, 512, 2, 256, 2, (1, 2), True, 1
        INNER = {1: 1, 2: 1}
        SWEEP["bf16"][:] = SWEEP["bf16"][:1]
        SWEEP["fp8"][:] = SWEEP["fp8"][:1]
    start = time.time()
    budget_end = start + args.budget_s
    results = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "checks": {},
        "timings": {},
        "producers": {},
    }
    out = os.path.join(args.out, "bench_fused_projection.json")

    def save():
        with open(out, "w") as f:
            json.dump(results, f, indent=1)

    if args.checks != "none":
        run_checks(results, quick=args.checks == "quick")
        check_producers(results)
        save()
    print(f"checks done at {time.time() - start:.0f} s", flush=True)
    weights = make_weights(jax.random.key(0))
    n_cache = CACHE_SLOTS * MAX_LEN + 1
    caches = tuple(
        jax.random.normal(jax.random.key(9 + i), (LAYERS, n_cache, HEADS * HEAD_DIM), jnp.bfloat16) for i in range(2)
    )
    for extra in (False, True) if args.sweep else (False,):
        for slots in SLOTS[::-1] if extra else SLOTS:  # the sweep: the largest (compute-bound) case first
            caches = bench_slots(results, slots, weights, caches, budget_end, extra)
            save()
            print(f"slots={slots} extra={extra} done at {time.time() - start:.0f} s", flush=True)
        if not extra and not args.skip_producers:
            for slots in SLOTS:
                bench_producers(results, slots)
                save()
            print(f"producers done at {time.time() - start:.0f} s", flush=True)
    print_table(results)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
