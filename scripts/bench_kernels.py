"""Benchmark of the two Pallas kernels against the XLA paths they replace, with roofline fractions.

    PYTHONPATH=. python scripts/bench_kernels.py            # GPU, LLaDA-8B layer shapes
    PYTHONPATH=. python scripts/bench_kernels.py --tiny     # CPU smoke test, interpret mode
    PYTHONPATH=. python scripts/bench_kernels.py --full-pass  # GPU, attention of one request's first full pass
    PYTHONPATH=. python scripts/bench_kernels.py --attention-only --budget-s 260   # GPU, the attention cases alone

One run: (1) the two ceilings, a large bf16 matmul rate and a large elementwise pass's
bandwidth (bytes read + written); (2) correctness of each kernel against its jnp reference on
fresh random data with NaN-poisoned caches; (3) per case (slots x 128 query rows, key lengths
512 and 2048) the median time of each XLA path, of the kernel's default tiling and of a short
block-size sweep (stopped when --budget-s is spent; every swept tiling is also checked against
the reference). Times come from jitted chains of calls (each call's output feeds the next, so
nothing is hoisted; see time_chain) and are medians over --repeats samples, warm-up excluded.
Prints a markdown table and writes JSON to --out (default $OUT/bench_kernels.json), updated
after every case so a run cut short still leaves its results.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dllm_jax.common.atomic_write import write_text_atomically
from pallas_kernels.attention.cache_attention import (
    AttentionBlockSizes,
    cache_attention,
    cache_attention_reference,
    default_attention_block_sizes,
)
from pallas_kernels.common import RowBlockSizes
from pallas_kernels.projection.qkv_rope_cache import (
    QKVBlockSizes,
    default_qkv_block_sizes,
    qkv_rope_cache,
    qkv_rope_cache_reference,
)

THETA = 500000.0


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Layer shapes of one benchmark run (H * Dh == D, so a call's q can feed the next call)."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int  # layers of the stacked weights/caches (the kernels index one of them)
    rows_per_slot: int
    max_len: int
    cache_slots: int  # slots the flat cache holds: M = cache_slots * max_len + 1
    slot_counts: tuple[int, ...]
    key_lengths: tuple[int, ...]
    verify_rows: int
    matmul_size: int
    copy_elements: int
    sweep_size: int  # tilings tried per case besides the default (while the budget lasts)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def cache_rows(self) -> int:
        return self.cache_slots * self.max_len + 1


LLADA_8B = Shapes(
    d_model=4096,
    n_heads=32,
    n_kv_heads=32,
    n_layers=2,
    rows_per_slot=128,
    max_len=2048,
    cache_slots=32,
    slot_counts=(1, 8, 32),
    key_lengths=(512, 2048),
    verify_rows=32,
    matmul_size=8192,
    copy_elements=2**28,
    sweep_size=7,
)

# the first full pass of one request (issue 30): 1 slot, prompt 512 + answer 128 = 640 rows over
# their own 640 keys; attention only (the pass's projections are XLA's GEMMs), a wider sweep
LLADA_8B_FULL_PASS = dataclasses.replace(
    LLADA_8B, rows_per_slot=640, max_len=640, cache_slots=1, slot_counts=(1,), key_lengths=(640,), sweep_size=14
)

TINY = Shapes(
    d_model=128,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    rows_per_slot=16,
    max_len=64,
    cache_slots=2,
    slot_counts=(2,),
    key_lengths=(64,),
    verify_rows=16,
    matmul_size=128,
    copy_elements=2**16,
    sweep_size=1,
)


def qkv_candidates(default: QKVBlockSizes, shapes: Shapes, n_rows: int) -> list[QKVBlockSizes]:
    """The default first, then variations in order of expected value; only tilings that fit."""
    replace = functools.partial(dataclasses.replace, default)
    candidates = [
        default,
        replace(block_pairs=64),
        replace(block_pairs=32),
        replace(num_warps=4, num_stages=4),
        replace(block_rows=64, num_warps=4),
        replace(block_rows=256),
        replace(block_d=32, num_stages=4),
        replace(block_d=128, num_stages=2),
    ]
    fits = [
        b
        for b in candidates
        if (shapes.head_dim // 2) % b.block_pairs == 0
        and shapes.d_model % b.block_d == 0
        and b.block_rows <= max(16, n_rows)
    ]
    return list(dict.fromkeys(fits))[: 1 + shapes.sweep_size]


def attention_candidates(default: AttentionBlockSizes, shapes: Shapes) -> list[AttentionBlockSizes]:
    replace = functools.partial(dataclasses.replace, default)
    candidates = [
        default,
        replace(num_splits=default.num_splits * 2),
        replace(num_stages=3),
        replace(block_k=128),
        replace(num_splits=max(1, default.num_splits // 2)),
        replace(num_warps=4 if default.num_warps == 8 else 8),
        replace(block_k=32, num_warps=4),
        replace(block_q=64, num_warps=4),
        # past sweep_size 7 (the full pass's sweep): fewer rows per program for more programs
        replace(block_q=64, num_warps=4, num_splits=2),
        replace(block_q=64, num_warps=4, num_stages=3),
        replace(block_q=64, block_k=128, num_warps=4),
        replace(block_q=32, num_warps=4),
        replace(block_q=64, num_warps=8, num_stages=3),
        replace(block_k=128, num_stages=3),
        replace(num_splits=4),
    ]
    return list(dict.fromkeys(candidates))[: 1 + shapes.sweep_size]


# ----------------------------------------------------------------------------- timing


RUNS_PER_SAMPLE = 4


def row_block_tilings(default: RowBlockSizes, block_rows: tuple[int, ...]) -> list[RowBlockSizes]:
    """A row-block kernel's tilings to time: its default first, then each of block_rows (at
    least 1) on 4 and on 8 warps, each tiling once."""
    out = [default]
    for rows in block_rows:
        for warps in (4, 8):
            blocks = RowBlockSizes(block_rows=max(1, rows), num_warps=warps)
            if blocks not in out:
                out.append(blocks)
    return out


def time_chain(step: Callable, carry: Any, consts: Any, *, inner: int, repeats: int) -> float:
    """Seconds per step of chained calls step(i, carry, consts) -> carry.

    One jitted program runs `inner` steps unrolled (the carry is donated); a sample enqueues
    RUNS_PER_SAMPLE programs back to back and blocks once, so dispatch latency overlaps with
    device work. Median over `repeats` samples; compile and warm-up excluded.
    """

    @functools.partial(jax.jit, donate_argnums=0)
    def run(carry, consts):
        return lax.fori_loop(0, inner, lambda i, c: step(i, c, consts), carry, unroll=True)

    carry = jax.block_until_ready(run(carry, consts))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(RUNS_PER_SAMPLE):
            carry = run(carry, consts)
        jax.block_until_ready(carry)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (RUNS_PER_SAMPLE * inner)


def measure_ceilings(shapes: Shapes, repeats: int) -> dict[str, float]:
    """Dense bf16 matmul rate (FLOP/s) and streaming bandwidth (bytes read + written per s)."""
    n = shapes.matmul_size
    a, b = jax.random.normal(jax.random.key(0), (2, n, n), jnp.bfloat16)
    # b / sqrt(n) keeps the chained products' magnitude
    seconds = time_chain(lambda i, c, b: c @ b, a, b / n**0.5, inner=4, repeats=repeats)
    bandwidth = 0.0
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.ones((shapes.copy_elements,), dtype)
        bytes_moved = 2 * x.size * x.dtype.itemsize
        # one pass per program: XLA would fuse a chain of elementwise ops into a single pass
        seconds_per_pass = time_chain(lambda i, c, _: c * 1.5, x, None, inner=1, repeats=repeats)
        bandwidth = max(bandwidth, bytes_moved / seconds_per_pass)
    return {"matmul_flops": 2 * n**3 / seconds, "bandwidth_bytes": bandwidth}


# ----------------------------------------------------------------------------- inputs


def rel_l2(actual: jax.Array, expected: jax.Array) -> float:
    actual, expected = actual.astype(jnp.float32), expected.astype(jnp.float32)
    return float(jnp.linalg.norm(actual - expected) / jnp.maximum(jnp.linalg.norm(expected), 1e-30))


def normal_parts(seed: int, *shapes: tuple[int, ...]) -> list[jax.Array]:
    """Standard-normal float32 arrays of the given shapes from a single draw (XLA:CPU compiles one
    RNG program per distinct shape, which made --tiny slow)."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = jax.random.normal(jax.random.key(seed), (sum(sizes),))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [flat[o : o + n].reshape(shape) for o, n, shape in zip(offsets, sizes, shapes)]


# Thresholds on a standard normal giving a fraction of True: P(N < -1.15) = 0.125,
# P(N < -1.28) = 0.10, P(N < 0) = 0.5.
EIGHTH, TENTH, HALF = -1.15, -1.28, 0.0


@functools.partial(jax.jit, static_argnums=(0, 1, 2), static_argnames=("poison",))
def qkv_inputs(shapes: Shapes, n_slots: int, seed: int, *, poison: bool) -> dict[str, Any]:
    """Query rows of n_slots slots (distinct random in-slot positions); caches all NaN if poison."""
    n_rows, d = n_slots * shapes.rows_per_slot, shapes.d_model
    q_width = shapes.n_heads * shapes.head_dim
    cache_shape = (shapes.n_layers, shapes.cache_rows, shapes.kv_width)
    order, x, wq, wk, wv, cache = normal_parts(
        seed,
        (n_slots, shapes.max_len),
        (n_rows, d),
        (shapes.n_layers, d, q_width),
        (shapes.n_layers, d, shapes.kv_width),
        (shapes.n_layers, d, shapes.kv_width),
        cache_shape,
    )
    # [n_slots, rows_per_slot]: distinct random positions inside each slot
    in_slot = jnp.argsort(order, axis=1)[:, : shapes.rows_per_slot]
    slots = jnp.arange(n_slots)[:, None] * 7 % shapes.cache_slots
    cache = jnp.full(cache_shape, jnp.nan, jnp.bfloat16) if poison else cache.astype(jnp.bfloat16)
    return dict(
        x=x.astype(jnp.bfloat16),
        wq=(wq / d**0.5).astype(jnp.bfloat16),
        wk=(wk / d**0.5).astype(jnp.bfloat16),
        wv=(wv / d**0.5).astype(jnp.bfloat16),
        positions=in_slot.reshape(-1).astype(jnp.int32),
        cache_rows=(slots * shapes.max_len + in_slot).reshape(-1).astype(jnp.int32),
        k_cache=cache,
        v_cache=cache + 0,
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), static_argnames=("rows", "poison", "verify"))
def attention_inputs(
    shapes: Shapes, n_slots: int, key_len: int, seed: int, *, rows: int, poison: bool, verify: bool = False
) -> dict[str, Any]:
    """Groups = slots (reversed order), ragged key lengths in (3/4 key_len, key_len]. With poison,
    every cache row a group may not read (and the other layer) is NaN."""
    cache_shape = (shapes.n_layers, shapes.cache_rows, shapes.kv_width)
    q, score_draw, exclude_draw, k_extra, v_extra, mask_draw, k_cache, v_cache = normal_parts(
        seed,
        (n_slots, rows, shapes.n_heads * shapes.head_dim),
        (n_slots, rows),
        (n_slots, shapes.max_len),
        (n_slots, rows, shapes.kv_width),
        (n_slots, rows, shapes.kv_width),
        (n_slots, rows, rows),
        cache_shape,
        cache_shape,
    )
    group_slot = (n_slots - 1 - jnp.arange(n_slots)).astype(jnp.int32)
    lengths = (key_len - jnp.arange(n_slots) * 37 % max(1, key_len // 4)).astype(jnp.int32)
    positions = jnp.arange(shapes.max_len)
    visible = positions[None, :] < lengths[:, None]
    args = dict(q=q.astype(jnp.bfloat16), group_slot=group_slot, key_len=lengths, score_rows=score_draw < EIGHTH)
    if verify:
        args["key_exclude"] = exclude_draw < TENTH
        visible &= ~args["key_exclude"]
        args["extra"] = (k_extra.astype(jnp.bfloat16), v_extra.astype(jnp.bfloat16), mask_draw < HALF)
        args["score_rows"] = None
    if poison:
        readable = (
            jnp.zeros((shapes.cache_rows,), bool)
            .at[(group_slot[:, None] * shapes.max_len + positions[None, :]).reshape(-1)]
            .set(visible.reshape(-1))
        )
        keep = (jnp.arange(shapes.n_layers) == 1)[:, None, None] & readable[None, :, None]
        k_cache, v_cache = (jnp.where(keep, c, jnp.nan) for c in (k_cache, v_cache))
    args.update(k_cache=k_cache.astype(jnp.bfloat16), v_cache=v_cache.astype(jnp.bfloat16))
    return args


def model_kwargs(shapes: Shapes) -> dict[str, Any]:
    return dict(n_heads=shapes.n_heads, n_kv_heads=shapes.n_kv_heads)


# ----------------------------------------------------------------------------- correctness


QKV_ORDER = ("x", "wq", "wk", "wv", "positions", "cache_rows", "k_cache", "v_cache")


def qkv_reference(shapes: Shapes, n_slots: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference q and the k / v rows it writes (layer 1) for the inputs of check_qkv."""
    inp = qkv_inputs(shapes, n_slots, seed=1, poison=True)
    q, k_cache, v_cache = qkv_rope_cache_reference(
        *(inp[k] for k in QKV_ORDER), 1, **model_kwargs(shapes), rope_theta=THETA
    )
    return q, k_cache[1, inp["cache_rows"]], v_cache[1, inp["cache_rows"]]


def check_qkv(shapes: Shapes, n_slots: int, blocks: QKVBlockSizes | None, interpret: bool, ref) -> dict:
    """Kernel vs reference on NaN-filled caches: q, the written rows, and every other row
    (except the trash row) still NaN."""
    inp = qkv_inputs(shapes, n_slots, seed=1, poison=True)
    q, k_cache, v_cache = qkv_rope_cache(
        *(inp[k] for k in QKV_ORDER),
        1,
        **model_kwargs(shapes),
        rope_theta=THETA,
        interpret=interpret,
        block_sizes=blocks,
    )
    rows = inp["cache_rows"]
    written = jnp.zeros((shapes.n_layers, shapes.cache_rows), bool).at[1, rows].set(True).at[1, -1].set(True)
    errors = {"q": rel_l2(q, ref[0]), "k": rel_l2(k_cache[1, rows], ref[1]), "v": rel_l2(v_cache[1, rows], ref[2])}
    untouched_nan = all(bool(jnp.isnan(c).all(axis=-1)[~written].all()) for c in (k_cache, v_cache))
    return {
        "errors": errors,
        "untouched_rows_unchanged": untouched_nan,
        "ok": max(errors.values()) < 1e-2 and untouched_nan,
    }


def check_attention(
    shapes: Shapes,
    n_slots: int,
    key_len: int,
    blocks: AttentionBlockSizes | None,
    interpret: bool,
    *,
    verify: bool = False,
) -> dict:
    rows = shapes.verify_rows if verify else shapes.rows_per_slot
    inp = attention_inputs(shapes, n_slots, key_len, seed=2, rows=rows, poison=True, verify=verify)
    args = (inp["q"], inp["k_cache"], inp["v_cache"], 1, inp["group_slot"], inp["key_len"], inp["score_rows"])
    kw = dict(
        **model_kwargs(shapes), max_len=shapes.max_len, key_exclude=inp.get("key_exclude"), extra=inp.get("extra")
    )
    out, scores = cache_attention(*args, **kw, interpret=interpret, block_sizes=blocks)
    out_ref, scores_ref = cache_attention_reference(*args, **kw)
    errors = {"out": rel_l2(out, out_ref), "scores": rel_l2(scores, scores_ref)}
    finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
    ok = errors["out"] < 1e-2 and (verify or errors["scores"] < 1e-4) and finite
    return {"errors": errors, "finite": finite, "ok": ok}


# ----------------------------------------------------------------------------- cases


def run_sweep(candidates: list, check: Callable, timed: Callable, deadline: float, label: str) -> list[dict]:
    """Checks and times each tiling (the first always, the others until the deadline)."""
    entries = []
    for i, blocks in enumerate(candidates):
        if i and time.monotonic() > deadline:
            break
        entry: dict[str, Any] = {"blocks": dataclasses.asdict(blocks)}
        try:
            entry["check"] = check(blocks)
            entry["s"] = timed(blocks)
        except Exception as e:  # a tiling the Triton compiler rejects is a sweep result, not a crash
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        entries.append(entry)
        log(f"  {label} {blocks}: {us(entry.get('s'))} us {entry.get('error', '')}")
    return entries


def time_paths(label: str, runs: dict[str, Callable[[], float]]) -> tuple[dict, dict]:
    """Times each XLA path; a path that fails (no cuDNN, out of memory) is recorded as None."""
    times, errors = {}, {}
    for name, run in runs.items():
        try:
            times[name] = run()
        except Exception as e:
            times[name], errors[name] = None, f"{type(e).__name__}: {str(e)[:300]}"
        log(f"  {label} {name}: {us(times[name])} us {errors.get(name, '')}")
    return times, errors


def summarise(result: dict, sweep: list[dict]) -> dict:
    """Adds the sweep, the default's time and the fastest correct tiling to a case result."""
    result["sweep"] = sweep
    result["default_s"] = sweep[0].get("s")
    # a variant the Triton compiler rejects is a sweep result; a failing default is a failure
    result["all_checks_ok"] = "s" in sweep[0] and all(e["check"]["ok"] for e in sweep if "check" in e)
    good = [e for e in sweep if "s" in e and e["check"]["ok"]]
    if good:
        best = min(good, key=lambda e: e["s"])
        result["best"] = {"blocks": best["blocks"], "s": best["s"]}
    return result


def qkv_case(shapes: Shapes, n_slots: int, opts: argparse.Namespace, ceilings: dict, deadline: float) -> dict:
    n_rows = n_slots * shapes.rows_per_slot
    kw = dict(**model_kwargs(shapes), rope_theta=THETA)
    layers = jnp.arange(opts.inner, dtype=jnp.int32) % shapes.n_layers

    def timed(fn, n_layers=shapes.n_layers, **extra):
        inp = qkv_inputs(shapes, n_slots, seed=3, poison=False)
        consts = (
            inp["wq"][:n_layers],
            inp["wk"][:n_layers],
            inp["wv"][:n_layers],
            inp["positions"],
            inp["cache_rows"],
            layers % n_layers,
        )
        carry = (inp["x"], inp["k_cache"][:n_layers], inp["v_cache"][:n_layers])

        def step(i, c, consts):
            wq, wk, wv, positions, rows, layer_ids = consts
            # q [N, H*Dh] becomes the next call's x (H*Dh == D)
            return fn(c[0], wq, wk, wv, positions, rows, c[1], c[2], layer_ids[i], **kw, **extra)

        return time_chain(step, carry, consts, inner=opts.inner, repeats=opts.repeats)

    columns = (shapes.n_heads + 2 * shapes.n_kv_heads) * shapes.head_dim
    flops = 2 * n_rows * shapes.d_model * columns
    bytes_moved = 2 * (shapes.d_model * columns + n_rows * shapes.d_model + n_rows * columns)
    memory_floor = bytes_moved / ceilings["bandwidth_bytes"]
    paths, errors = time_paths(
        f"qkv slots={n_slots}",
        {
            "xla": lambda: timed(qkv_rope_cache_reference),
            "xla_one_layer": lambda: timed(qkv_rope_cache_reference, 1),
        },
    )
    result = {
        "slots": n_slots,
        "rows": n_rows,
        "flops": flops,
        "bytes": bytes_moved,
        "memory_floor_s": memory_floor,
        "roofline_s": max(memory_floor, flops / ceilings["matmul_flops"]),
        "paths": paths,
        "path_errors": errors,
    }
    ref = qkv_reference(shapes, n_slots)
    sweep = run_sweep(
        qkv_candidates(default_qkv_block_sizes(n_rows, shapes.d_model, shapes.head_dim, columns), shapes, n_rows),
        check=lambda b: check_qkv(shapes, n_slots, b, opts.tiny, ref),
        timed=lambda b: timed(qkv_rope_cache, interpret=opts.tiny, block_sizes=b),
        deadline=deadline,
        label=f"qkv slots={n_slots}",
    )
    return summarise(result, sweep)


def cudnn_attention(q, k_cache, v_cache, layer, group_slot, key_len, score_rows, *, n_heads, n_kv_heads, max_len):
    """The XLA path with cuDNN: gather each group's K/V, cuDNN flash attention with key lengths,
    tracking score as one vector-matrix product per group (summed score-row queries)."""
    n_groups, n_rows, _ = q.shape
    head_dim = q.shape[2] // n_heads
    rows = group_slot[:, None] * max_len + jnp.arange(max_len)[None, :]
    # [S, max_len, KVH, Dh]
    k = k_cache[layer, rows].reshape(n_groups, max_len, n_kv_heads, head_dim)
    v = v_cache[layer, rows].reshape(n_groups, max_len, n_kv_heads, head_dim)
    q4 = q.reshape(n_groups, n_rows, n_heads, head_dim)
    out = jax.nn.dot_product_attention(q4, k, v, key_value_seq_lengths=key_len, implementation="cudnn")
    # [S, KVH, Dh]: score-row queries summed over rows and the query heads of each kv head
    q_sum = jnp.where(score_rows[..., None, None], q4.astype(jnp.float32), 0).sum(axis=1)
    q_sum = q_sum.reshape(n_groups, n_kv_heads, -1, head_dim).sum(axis=2)
    scores = jnp.einsum("skd,sjkd->sj", q_sum, k.astype(jnp.float32))
    scores = jnp.where(jnp.arange(max_len)[None, :] < key_len[:, None], scores, 0.0)
    return out.reshape(q.shape), scores


def attention_case(
    shapes: Shapes, n_slots: int, key_len: int, opts: argparse.Namespace, ceilings: dict, deadline: float
) -> dict:
    rows = shapes.rows_per_slot
    inp = attention_inputs(shapes, n_slots, key_len, seed=4, rows=rows, poison=False)
    kw = dict(**model_kwargs(shapes), max_len=shapes.max_len)
    consts = (
        inp["k_cache"],
        inp["v_cache"],
        inp["group_slot"],
        inp["key_len"],
        inp["score_rows"],
        jnp.arange(opts.inner, dtype=jnp.int32) % shapes.n_layers,
    )

    def timed(fn, **extra):
        def step(i, c, consts):
            k_cache, v_cache, group_slot, lengths, score_rows, layer_ids = consts
            out, scores = fn(c[0], k_cache, v_cache, layer_ids[i], group_slot, lengths, score_rows, **kw, **extra)
            # out [S, R, H*Dh] is the next call's q; the scores are accumulated so they stay live
            return out, c[1] + scores

        carry = (inp["q"] + 0, jnp.zeros((n_slots, shapes.max_len), jnp.float32))
        return time_chain(step, carry, consts, inner=opts.inner, repeats=opts.repeats)

    keys_read = int(inp["key_len"].sum())
    width = shapes.n_heads * shapes.head_dim
    bytes_moved = 2 * 2 * keys_read * shapes.kv_width + 2 * 2 * n_slots * rows * width + 4 * n_slots * shapes.max_len
    flops = 4 * rows * keys_read * width
    memory_floor = bytes_moved / ceilings["bandwidth_bytes"]
    paths, errors = time_paths(
        f"attention slots={n_slots} keys={key_len}",
        {
            "xla": lambda: timed(cache_attention_reference),
            "cudnn": lambda: timed(cudnn_attention),
        },
    )
    result = {
        "slots": n_slots,
        "key_len": key_len,
        "keys_read": keys_read,
        "flops": flops,
        "bytes": bytes_moved,
        "memory_floor_s": memory_floor,
        "roofline_s": max(memory_floor, flops / ceilings["matmul_flops"]),
        "paths": paths,
        "path_errors": errors,
    }
    default = default_attention_block_sizes(n_slots, rows, shapes.n_heads, shapes.n_kv_heads, shapes.max_len)
    sweep = run_sweep(
        attention_candidates(default, shapes),
        check=lambda b: check_attention(shapes, n_slots, key_len, b, opts.tiny),
        timed=lambda b: timed(cache_attention, interpret=opts.tiny, block_sizes=b),
        deadline=deadline,
        label=f"attention slots={n_slots} keys={key_len}",
    )
    return summarise(result, sweep)


# ----------------------------------------------------------------------------- report


def us(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:.1f}"


def ratio(numerator: float | None, denominator: float | None) -> str:
    return "n/a" if not numerator or not denominator else f"{numerator / denominator:.2f}"


def blocks_label(blocks: dict) -> str:
    return "/".join(str(v) for v in blocks.values())


def markdown(report: dict) -> str:
    """One row per measured path and case; fractions are roofline (or memory floor) / time."""
    ceilings = report["ceilings"]
    lines = [
        f"device: {report['device']}, jax {report['jax']}; ceilings: bf16 matmul "
        f"{ceilings['matmul_flops'] / 1e12:.1f} TFLOP/s, bandwidth {ceilings['bandwidth_bytes'] / 1e12:.2f} TB/s",
        "",
        "| kernel | slots | keys | path | blocks | us | of roofline | of memory floor | XLA / this |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, cases in (("qkv_rope_cache", report["qkv"]), ("cache_attention", report["attention"])):
        for r in cases:
            rows = [(path, "-", t) for path, t in r["paths"].items()]
            rows.append(("pallas default", blocks_label(r["sweep"][0]["blocks"]), r["default_s"]))
            if "best" in r:
                rows.append(("pallas best", blocks_label(r["best"]["blocks"]), r["best"]["s"]))
            for path, blocks, seconds in rows:
                lines.append(
                    f"| {name} | {r['slots']} | {r.get('key_len', '-')} | {path} | {blocks} | {us(seconds)} "
                    f"| {ratio(r['roofline_s'], seconds)} | {ratio(r['memory_floor_s'], seconds)} "
                    f"| {ratio(r['paths']['xla'], seconds)} |"
                )
    lines += [
        "",
        "paths: xla = the jnp reference (qkv: layer-stacked weights, dynamic layer; xla_one_layer: one layer's "
        "weights); cudnn = K/V gather + jax.nn.dot_product_attention(implementation='cudnn') + score product.",
        "blocks: qkv block_rows/block_pairs/block_d/num_warps/num_stages; "
        "attention block_q/block_k/num_splits/num_warps/num_stages.",
        f"correctness checks all ok: {report['all_checks_ok']}",
    ]
    return "\n".join(lines)


def log(message: str) -> None:
    print(message, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, CPU, Pallas interpret mode")
    parser.add_argument(
        "--full-pass",
        action="store_true",
        help="attention only, at the first full pass of one request (1 slot x 640 rows over 640 keys)",
    )
    parser.add_argument(
        "--attention-only",
        action="store_true",
        help="the attention cases alone (no q/k/v projection cases): the whole sweep budget for them",
    )
    parser.add_argument("--out", help="JSON path (default $OUT/bench_kernels.json, else ./bench_kernels.json)")
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per measurement (median)")
    parser.add_argument("--inner", type=int, default=4, help="chained calls per compiled program")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=170.0,
        help="seconds from the start after which no further sweep tilings are tried",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    start = time.monotonic()
    if opts.tiny:
        jax.config.update("jax_platforms", "cpu")
    shapes = TINY if opts.tiny else LLADA_8B_FULL_PASS if opts.full_pass else LLADA_8B
    out_path = opts.out or os.path.join(os.environ.get("OUT", "."), "bench_kernels.json")
    report: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "tiny": opts.tiny,
        "shapes": dataclasses.asdict(shapes),
        "qkv": [],
        "attention": [],
    }

    def save():
        report["elapsed_s"] = time.monotonic() - start
        write_text_atomically(out_path, json.dumps(report, indent=1))

    report["ceilings"] = measure_ceilings(shapes, opts.repeats)
    log(f"ceilings: {report['ceilings']}")
    # the main passes are checked for every tiling of the sweep; the verify pass only here
    report["checks"] = {
        "attention_verify": check_attention(
            shapes, shapes.slot_counts[-1], shapes.key_lengths[0], None, opts.tiny, verify=True
        )
    }
    log(f"checks: {json.dumps(report['checks'])}")
    save()

    cases = [] if opts.full_pass or opts.attention_only else [("qkv", n, None) for n in shapes.slot_counts]
    cases += [("attention", n, k) for k in shapes.key_lengths for n in shapes.slot_counts]
    for i, (kind, n_slots, key_len) in enumerate(cases):
        # an equal share of the remaining sweep budget per remaining case
        now = time.monotonic()
        deadline = now + max(0.0, start + opts.budget_s - now) / (len(cases) - i)
        if kind == "qkv":
            report["qkv"].append(qkv_case(shapes, n_slots, opts, report["ceilings"], deadline))
        else:
            report["attention"].append(attention_case(shapes, n_slots, key_len, opts, report["ceilings"], deadline))
        save()

    report["all_checks_ok"] = all(c["ok"] for c in report["checks"].values()) and all(
        r["all_checks_ok"] for r in report["qkv"] + report["attention"]
    )
    report["recommended"] = {
        "qkv": {str(r["slots"]): r.get("best", {}).get("blocks") for r in report["qkv"]},
        "attention": {f"{r['slots']}x{r['key_len']}": r.get("best", {}).get("blocks") for r in report["attention"]},
    }
    save()
    log(markdown(report))
    log(f"wrote {out_path} after {report['elapsed_s']:.0f} s")
    return 0 if report["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
