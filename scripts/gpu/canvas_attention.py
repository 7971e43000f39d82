"""DiffusionGemma's canvas attention on the GPU: XLA's canvas_cache_attention against the Triton kernel.

    PYTHONPATH=. python scripts/gpu/canvas_attention.py --out OUT          # H200: a few minutes
    PYTHONPATH=. python scripts/gpu/canvas_attention.py --tiny --out OUT   # CPU smoke (interpret mode, < 1 min)
    PYTHONPATH=. python scripts/gpu/canvas_attention.py --no-sweep --slots 32 --out OUT

One layer's attention of S slots x 256 canvas rows over each slot's cached keys plus its own
rows (dllm_jax.runtime.canvas_attention), at the 26B-A4B shapes: sliding layers (16 query heads
over 8 kv heads, Dh 256, window 1024) and full layers (16 over 2, Dh 512), 1 / 8 / 32 slots,
256 and 1024 cached keys per slot. Modes (--modes):
  canvas         a canvas being denoised (the default loop's decoder pass): the cached keys
                 before it (sliding: the last W - 1), all 256 own rows, no scores;
  encoder        a chunk of 256 rows being encoded: each row's own window (sliding: a per-row
                 first key), its own rows causally;
  cached-canvas  Flash-Cache on the canvas: the canvas rows are in the cache (key_end = start +
                 256), no own rows, tracking scores of every row.
Each slot's cache rows past what the case reads are NaN, so a kernel that reads a hidden key
shows a non-finite output. Per case (one row each in the table):
  xla       canvas_cache_attention (chunked online softmax in XLA), the engine's path until now;
  kernel    canvas_cache_attention_pallas with the default tiling, then in canvas mode (unless
            --no-sweep) a few other tilings ("kernel BQxBK wW sS", the default's key splits); a
            tiling the compiler rejects (shared memory) is reported as an error row;
times are the median over --repeats rounds of --chain back-to-back calls (ms per call), and
"rel err" is the relative L2 difference of the output (and the scores) to xla's on the device.
"TFLOP/s" counts 4 x rows x heads x Dh x (visible keys) per call, the work the masks allow.

Outputs: OUT/canvas_attention.json (every row, the device and the arguments) and
OUT/canvas_attention.md (the table, also printed). Each case runs in its own try/except; the
run stops starting new cases after --budget-s seconds (the JSON says which were skipped).

What to expect (H200, ~800 TFLOP/s bf16, ~3.2 TB/s through JAX): a sliding layer at 32 slots
and 1024 cached keys does 4 x 8192 x 16 x 256 x (1023 + 256) = 172 GFLOP, ~0.2 ms at the MMA
peak; its K/V reads are 32 x 1280 x 4096 x 2 x 2 B = 0.67 GB (0.2 ms), so ~0.3-0.5 ms would be
a good kernel. XLA's version took 15-20 ms for a whole 32-slot step (30 layers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models.diffusion_gemma_config import AttentionKind, diffusion_gemma_26b_a4b_config
from dllm_jax.runtime.canvas_attention import canvas_cache_attention, canvas_cache_attention_pallas
from pallas_kernels.attention.cache_attention import AttentionBlockSizes, default_attention_block_sizes

MODES = ("canvas", "encoder", "cached-canvas")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One layer kind's attention shape."""

    n_heads: int
    kv_heads: int
    head_dim: int
    rows: int  # R, the canvas length
    window: int | None  # sliding layers' W; None for full layers


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "sliding" or "full"
    mode: str
    slots: int
    cached: int  # cached keys per slot before the canvas / chunk

    @property
    def name(self) -> str:
        return f"{self.kind} {self.mode} S={self.slots} K={self.cached}"


def layer_shapes(tiny: bool) -> dict[str, Shape]:
    """The 26B-A4B sliding and full layer shapes (tiny: scaled down for interpret mode)."""
    if tiny:
        return {"sliding": Shape(4, 2, 32, 16, 24), "full": Shape(4, 1, 64, 16, None)}
    config = diffusion_gemma_26b_a4b_config()
    R = config.canvas_length
    sliding, full = AttentionKind.SLIDING, AttentionKind.FULL
    return {
        "sliding": Shape(config.n_heads, config.kv_heads(sliding), config.head_dim(sliding), R, config.sliding_window),
        "full": Shape(config.n_heads, config.kv_heads(full), config.head_dim(full), R, None),
    }


def sweep_tilings(head_dim: int, defaults: AttentionBlockSizes) -> list[AttentionBlockSizes]:
    """A few tilings around the default for this head width (the default's key splits)."""
    if head_dim <= 128:
        shapes = [(128, 64, 8, 2), (64, 64, 4, 2)]
    elif head_dim <= 256:
        # 64-key steps on 4 warps: half the q tile's shared-memory reads per key (2026-12-07)
        shapes = [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 3), (32, 32, 4, 2)]
        shapes += [(64, 64, 4, 2), (64, 64, 4, 1), (128, 64, 8, 1)]
    else:
        shapes = [(64, 32, 8, 1), (64, 16, 8, 2), (32, 16, 4, 2), (32, 32, 8, 1), (16, 32, 4, 2)]
    tilings = [AttentionBlockSizes(bq, bk, defaults.num_splits, num_warps=w, num_stages=s) for bq, bk, w, s in shapes]
    return [t for t in tilings if t != defaults]


def make_inputs(case: Case, shape: Shape, seed: int) -> dict:
    """One call's arguments (bfloat16 on the default device). Every slot has the same layout:
    cached keys [0, K), the canvas or chunk at [K, K + R); max_len = K + R. Cache rows no row
    reads are NaN."""
    rng = np.random.default_rng(seed)
    S, R, K = case.slots, shape.rows, case.cached
    H, KVH, Dh = shape.n_heads, shape.kv_heads, shape.head_dim
    max_len = K + R
    rows = np.arange(R)
    W = shape.window
    if case.mode == "encoder":
        key_start = (K + rows - W + 1) if W else np.zeros(R, int)
        own = rows[None, :] <= rows[:, None]
        if W:
            own &= rows[None, :] > rows[:, None] - W
        key_end = K
    else:
        key_start = np.full(R, K - W + 1 if W else 0)
        own = np.full((R, R), case.mode == "canvas")
        key_end = K + R if case.mode == "cached-canvas" else K
    key_start = np.clip(key_start, 0, None)
    read = np.zeros(max_len, bool)
    read[key_start.min() : key_end] = True
    cache = np.full((S, max_len, KVH * Dh), np.nan, np.float32)
    k_cache, v_cache = cache, cache.copy()
    # [S, n_read, KVH*Dh]: random keys and values where some row reads
    n_read = int(read.sum())
    k_cache[:, read] = rng.standard_normal((S, n_read, KVH * Dh))
    v_cache[:, read] = rng.standard_normal((S, n_read, KVH * Dh))
    bf16 = jnp.bfloat16

    def normal(*dims):
        return jnp.asarray(rng.standard_normal(dims), bf16)

    # The model's logit scale is 1 over per-head RMS-normed q and k (their learned gains keep
    # the logits moderate); random normal q and k at scale 1 would give logits of std sqrt(Dh),
    # a near one-hot softmax, so the check runs at 1 / sqrt(Dh). The cost does not depend on it.
    scale = 1.0 / math.sqrt(Dh)
    visible_keys = (key_end - key_start).clip(0).sum() + own.sum()
    return dict(
        args=(
            normal(S, R, H, Dh),
            jnp.asarray(k_cache.reshape(1, S * max_len, -1), bf16),
            jnp.asarray(v_cache.reshape(1, S * max_len, -1), bf16),
            0,
            jnp.asarray(np.broadcast_to(key_start, (S, R)), jnp.int32),
            jnp.full((S,), key_end, jnp.int32),
            normal(S, R, KVH, Dh),
            normal(S, R, KVH, Dh),
            jnp.asarray(np.broadcast_to(own, (S, R, R))),
        ),
        kwargs=dict(
            max_len=max_len,
            scale=scale,
            score_rows=jnp.ones((S, R), bool) if case.mode == "cached-canvas" else None,
        ),
        flops=4.0 * S * H * Dh * float(visible_keys),
        max_len=max_len,
    )


def timed(fn, inputs: dict, repeats: int, chain: int):
    """(ms per call, the result) of fn(*args, **kwargs) jitted: compile, one call, then the
    median over `repeats` rounds of `chain` back-to-back calls."""
    args, kwargs = inputs["args"], inputs["kwargs"]
    dynamic = [a for a in args if not isinstance(a, int)]
    layer = args[3]

    def call(q, k_cache, v_cache, key_start, key_end, own_k, own_v, own_mask, score_rows):
        return fn(
            q,
            k_cache,
            v_cache,
            layer,
            key_start,
            key_end,
            own_k,
            own_v,
            own_mask,
            max_len=kwargs["max_len"],
            scale=kwargs["scale"],
            score_rows=score_rows,
        )

    operands = (*dynamic, kwargs["score_rows"])
    compiled = jax.jit(call).lower(*operands).compile()
    result = jax.block_until_ready(compiled(*operands))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(chain):
            out = compiled(*operands)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / chain)
    return 1e3 * float(np.median(times)), result


def rel_err(a: jax.Array, b: jax.Array) -> float:
    """Relative L2 difference ||a - b|| / ||b||, computed on the device in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def split(result) -> tuple[jax.Array, jax.Array | None]:
    return result if isinstance(result, tuple) else (result, None)


def run_case(case: Case, shape: Shape, args) -> list[dict]:
    """The case's rows: xla, the kernel's default tiling, the sweep."""
    inputs = make_inputs(case, shape, seed=len(case.name))
    base = dict(case=case.name, **dataclasses.asdict(case), max_len=inputs["max_len"])
    rows = []
    xla_ms, xla = timed(canvas_cache_attention, inputs, args.repeats, args.chain)
    xla_out, xla_scores = split(xla)
    finite = bool(jnp.all(jnp.isfinite(xla_out.astype(jnp.float32))))
    rows.append(dict(base, impl="xla", ms=xla_ms, tflops=inputs["flops"] / xla_ms / 1e9, finite=finite))
    S, R = case.slots, shape.rows
    default = default_attention_block_sizes(S, R, shape.n_heads, shape.kv_heads, inputs["max_len"], shape.head_dim)
    tilings = [("kernel", default)]
    if not args.no_sweep and case.mode == "canvas":
        tilings += [
            (f"kernel {b.block_q}x{b.block_k} w{b.num_warps} s{b.num_stages}", b)
            for b in sweep_tilings(shape.head_dim, default)
        ]
    for name, blocks in tilings:
        row = dict(base, impl=name, tiling=dataclasses.asdict(blocks))
        try:
            fn = _kernel(blocks, args.tiny)
            ms, result = timed(fn, inputs, args.repeats, args.chain)
            out, scores = split(result)
            row.update(
                ms=ms,
                tflops=inputs["flops"] / ms / 1e9,
                speedup=xla_ms / ms,
                rel_err=rel_err(out, xla_out),
                finite=bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))),
            )
            if scores is not None:
                row["scores_rel_err"] = rel_err(scores, xla_scores)
        except Exception as error:  # noqa: BLE001 - one tiling's failure (e.g. shared memory) is a row
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        print(_line(row), flush=True)
    print(_line(rows[0]), flush=True)
    return rows


def _kernel(blocks: AttentionBlockSizes, interpret: bool):
    def kernel(*args, **kwargs):
        return canvas_cache_attention_pallas(*args, **kwargs, interpret=interpret, block_sizes=blocks)

    return kernel


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['case']:<40} {row['impl']:<28} ERROR {row['error']}"
    extra = f" rel err {row['rel_err']:.2e}" if "rel_err" in row else ""
    extra += f" scores {row['scores_rel_err']:.2e}" if "scores_rel_err" in row else ""
    extra += f" {row['speedup']:.2f}x" if "speedup" in row else ""
    return (
        f"{row['case']:<40} {row['impl']:<28} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
        f" finite={row['finite']}{extra}"
    )


def table(rows: list[dict]) -> str:
    head = (
        "| case | impl | ms | TFLOP/s | vs xla | rel err | scores rel err | finite |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['case']} | {row['impl']} | error: {row['error'][:120]} | | | | | |")
            continue

        def fmt(key, spec):
            return format(row[key], spec) if key in row else ""

        lines.append(
            f"| {row['case']} | {row['impl']} | {fmt('ms', '.3f')} | {fmt('tflops', '.1f')} | "
            f"{fmt('speedup', '.2f')} | {fmt('rel_err', '.2e')} | {fmt('scores_rel_err', '.2e')} | {row['finite']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke: tiny shapes, the kernel in interpret mode")
    p.add_argument("--slots", type=int, nargs="+", default=None, help="default 32 8 1 (tiny: 2 1)")
    p.add_argument(
        "--cached", type=int, nargs="+", default=None, help="cached keys per slot (default 256 1024; tiny 24)"
    )
    p.add_argument("--kinds", nargs="+", default=["sliding", "full"], choices=["sliding", "full"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 10; tiny 1)")
    p.add_argument("--chain", type=int, default=None, help="calls per round (default 10; tiny 1)")
    p.add_argument("--no-sweep", action="store_true", help="only the kernel's default tiling")
    p.add_argument("--budget-s", type=float, default=480.0, help="no new case starts after this many seconds")
    p.add_argument("--out", type=Path, default=Path("canvas_attention_out"))
    args = p.parse_args(argv)
    args.slots = args.slots or ([2, 1] if args.tiny else [32, 8, 1])
    args.cached = args.cached or ([24] if args.tiny else [256, 1024])
    args.repeats = args.repeats or (1 if args.tiny else 10)
    args.chain = args.chain or (1 if args.tiny else 10)
    if args.tiny:
        args.no_sweep = True
    args.out.mkdir(parents=True, exist_ok=True)

    shapes = layer_shapes(args.tiny)
    # the main matrix first (canvas mode, every size), then the other modes
    cases = [
        Case(kind, mode, slots, cached)
        for mode in args.modes
        for kind in args.kinds
        for slots in args.slots
        for cached in args.cached
    ]
    started = time.perf_counter()
    rows, skipped, failed = [], [], []
    for case in cases:
        if time.perf_counter() - started > args.budget_s:
            skipped.append(case.name)
            continue
        try:
            rows += run_case(case, shapes[case.kind], args)
        except Exception as error:  # noqa: BLE001 - one case's failure must not lose the others
            traceback.print_exc()
            failed.append(case.name)
            rows.append(dict(case=case.name, impl="xla", error=f"{type(error).__name__}: {str(error)[:300]}"))
        (args.out / "canvas_attention.json").write_text(json.dumps(_report(args, shapes, rows, skipped), indent=2))
    report = _report(args, shapes, rows, skipped)
    (args.out / "canvas_attention.json").write_text(json.dumps(report, indent=2))
    text = table(rows)
    if skipped:
        text += f"\n\nskipped (budget {args.budget_s} s): {', '.join(skipped)}"
    (args.out / "canvas_attention.md").write_text(text + "\n")
    print(text)
    print(
        f"{len(rows)} rows, {len(failed)} failed cases, {len(skipped)} skipped; {time.perf_counter() - started:.0f} s"
    )
    return 0


def _report(args, shapes, rows, skipped) -> dict:
    device = jax.devices()[0]
    return dict(
        device=getattr(device, "device_kind", str(device)),
        platform=device.platform,
        jax=jax.__version__,
        python=platform.python_version(),
        argv=sys.argv[1:],
        shapes={k: dataclasses.asdict(v) for k, v in shapes.items()},
        repeats=args.repeats,
        chain=args.chain,
        rows=rows,
        skipped=skipped,
    )


if __name__ == "__main__":
    raise SystemExit(main())
