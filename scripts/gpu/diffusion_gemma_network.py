"""DiffusionGemma-26B-A4B's network on one GPU (issue 31), random bf16 weights of the published
shape (diffusion_gemma_26b_a4b_config), no downloads:

    PYTHONPATH=. python scripts/gpu/diffusion_gemma_network.py           # H200: at most --budget-s (150 s)
    PYTHONPATH=. python scripts/gpu/diffusion_gemma_network.py --tiny    # CPU smoke test (same code paths)

Two parts, each in its own process (so each has the GPU's memory to itself), in this order:
  jax    the ceilings (a bf16 matmul, an elementwise pass); random weights generated on the
         device; the encoder prefill of a PROMPT-token prompt; one denoising step of a
         CANVAS-token canvas at 1, 8 and 32 rows (the reference's jitted step: the decoder pass
         with self-conditioning, then the entropy-bound sampler over the full vocabulary) and the
         sampler alone, against the step's weight-read floor (the shared weights plus the experts
         its rows reach) and FLOP floor; the routed experts of one layer at the real shapes as
         the grouped GEMM (jax.lax.ragged_dot, experts.grouped_expert_mlp) against a loop over
         the experts (dense capacity-padded GEMMs) and the same as one batched GEMM, each
         checked against experts.dense_expert_mlp; the reference generation
         (tests/diffusion_gemma_reference.generate) at 1 and 8 rows, tokens/s.
  torch  transformers' DiffusionGemmaForBlockDiffusion of the same shape, initialised at random
         on the device in bf16, its own generate at 1 and 8 rows, tokens/s.
Both generations run the same work: a PROMPT-token prompt, CANVASES canvases of exactly STEPS
denoising steps each (the stop criterion's confidence threshold 1e-30 never fires, no EOS ends a
row), the same temperatures and entropy bound.

Floors use --peak-tflops and --peak-tbps (default: /work/shared/notes/gpu-machine.md's measured
H200 ceilings, 800 TFLOP/s and 4.3 TB/s); the ceilings measured here are reported beside them.
Writes diffusion_gemma_network.json and .md under --out (default $OUT or ./out), after every row.
Each part stops starting new work _GRACE_S before its share of --budget-s is spent and is stopped
at its end, so the whole run ends within --budget-s (plus the parent's few seconds).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import ROOT, put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import ROOT, put_checkout_on_path
put_checkout_on_path()

REPORT = "diffusion_gemma_network"
ROWS = (1, 8, 32)
GENERATE_ROWS = (1, 8)
IMAGE_FREE_IDS = (3, 255_999)  # prompt ids drawn below the 26B vocabulary's image tokens


def bench_shape(tiny: bool) -> dict[str, Any]:
    """The benchmark's sizes: the real ones, or the --tiny smoke test's."""
    if tiny:
        return {"prompt": 16, "canvases": 1, "steps": 3, "reps": 2}
    return {"prompt": 256, "canvases": 1, "steps": 16, "reps": 5}


def model_config(tiny: bool):
    """The 26B-A4B text model in bf16, or (--tiny) a small one with every feature: sliding and
    full layers, 8 experts top-2, a window shorter than the prompt, a canvas of 16."""
    from dllm_jax.models.diffusion_gemma_config import (
        AttentionKind,
        DiffusionGemmaConfig,
        RopeSettings,
        diffusion_gemma_26b_a4b_config,
    )

    if not tiny:
        return diffusion_gemma_26b_a4b_config("bfloat16")
    return DiffusionGemmaConfig(
        d_model=64,
        n_heads=4,
        layer_types=(AttentionKind.SLIDING, AttentionKind.SLIDING, AttentionKind.FULL),
        sliding_head_dim=16,
        sliding_kv_heads=2,
        full_head_dim=32,
        full_kv_heads=1,
        mlp_hidden_size=96,
        n_experts=8,
        top_k_experts=2,
        expert_hidden_size=32,
        vocab_size=512,
        sliding_window=8,
        sliding_rope=RopeSettings(10_000.0),
        full_rope=RopeSettings(1_000_000.0, rotated_fraction=0.25),
        canvas_length=16,
        max_sequence_length=256,
        eos_token_ids=(1,),
        dtype="bfloat16",
    )


def denoise_settings(shape: dict[str, Any]):
    """transformers' default temperatures and entropy bound, STEPS steps, a stop criterion that
    never fires (equal work on both sides)."""
    from dllm_jax.policies.entropy_bound import DenoiseSettings

    return DenoiseSettings(max_denoising_steps=shape["steps"], confidence_threshold=1e-30)


# ----------------------------------------------------------------------------- floors


def expert_bytes(config) -> int:
    """Bytes of one expert of one layer (gate/up and down projections, bf16)."""
    return 3 * config.d_model * config.expert_hidden_size * 2


def weight_bytes(config) -> int:
    from dllm_jax.models import diffusion_gemma as dg

    return 2 * dg.count_params(dg.abstract_params(config))


def experts_reached(config, routed_rows: int) -> float:
    """Expected distinct experts of one layer that routed_rows rows reach under uniform top-k
    routing (random weights route close to uniformly): E (1 - (1 - k/E)^rows)."""
    E, k = config.n_experts, config.top_k_experts
    return E * (1.0 - (1.0 - k / E) ** routed_rows)


def pass_weight_bytes(config, rows: int) -> float:
    """The weight-read floor of one pass over `rows` token rows: every weight but the experts
    once, plus the experts those rows reach in each layer."""
    all_experts = config.n_layers * config.n_experts * expert_bytes(config)
    reached = config.n_layers * experts_reached(config, rows) * expert_bytes(config)
    return weight_bytes(config) - all_experts + reached


def _layer_flops_per_row(config, kind, keys: float) -> float:
    """Matmul FLOPs of one token row through one layer attending to `keys` keys."""
    from dllm_jax.models.diffusion_gemma_config import AttentionKind

    D, H, Dh, KV = config.d_model, config.n_heads, config.head_dim(kind), config.kv_heads(kind)
    kv_projections = 2 if kind is AttentionKind.SLIDING else 1  # full layers: v is the k projection
    projections = 2 * D * H * Dh * 2 + 2 * D * KV * Dh * kv_projections
    attention = 4 * H * Dh * keys
    dense_mlp = 2 * 3 * D * config.mlp_hidden_size
    routed = 2 * D * config.n_experts + config.top_k_experts * 2 * 3 * D * config.expert_hidden_size
    return projections + attention + dense_mlp + routed


def decode_flops(config, rows: int, prefix: int) -> float:
    """Useful matmul FLOPs of one decoder pass over `rows` canvases after `prefix` cached
    positions: the layers (canvas rows see the whole canvas, full layers every cached key,
    sliding layers the last W - 1), self-conditioning (MLP and soft embeddings over the
    vocabulary) and the LM head."""
    from dllm_jax.models.diffusion_gemma_config import AttentionKind

    L, D, V = config.canvas_length, config.d_model, config.vocab_size
    per_row = 0.0
    for kind in config.layer_types:
        visible = prefix if kind is AttentionKind.FULL else min(prefix, config.sliding_window - 1)
        per_row += _layer_flops_per_row(config, kind, L + visible)
    per_row += 2 * 3 * D * config.mlp_hidden_size + 2 * V * D + 2 * D * V
    return rows * L * per_row


def encode_flops(config, rows: int, tokens: int) -> float:
    """Useful matmul FLOPs of the causal encoder over `tokens` tokens (no LM head): query i sees
    i + 1 keys in full layers, at most W in sliding ones."""
    from dllm_jax.models.diffusion_gemma_config import AttentionKind

    total = 0.0
    for i in range(tokens):
        for kind in config.layer_types:
            keys = i + 1 if kind is AttentionKind.FULL else min(i + 1, config.sliding_window)
            total += _layer_flops_per_row(config, kind, keys)
    return rows * total


def expert_flops(config, rows: int) -> float:
    return rows * config.top_k_experts * 2 * 3 * config.d_model * config.expert_hidden_size


# ----------------------------------------------------------------------------- report


class Report:
    """Rows by section in one JSON file (and its Markdown), written after every row."""

    def __init__(self, out: Path, data: dict[str, Any] | None = None):
        self.out = out
        self.data = data or {}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.data.setdefault(section, []).append(row)
        print(f"{section}: {json.dumps(row, default=str)[:300]}", flush=True)
        self.save()

    def save(self) -> None:
        from dllm_jax.common.atomic_write import write_text_atomically

        write_text_atomically(self.out / f"{REPORT}.json", json.dumps(self.data, indent=1, default=str))
        write_text_atomically(self.out / f"{REPORT}.md", markdown(self.data) + "\n")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3g}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# DiffusionGemma network, {data.get('config', '?')} (bf16, random weights)", ""]
    for key in ("device", "jax", "torch", "date", "shape", "peaks"):
        if key in data:
            lines.append(f"- {key}: {data[key]}")
    if data.get("ceilings"):
        lines += ["", "| ceiling | measured |", "|---|---|"]
        lines += [f"| {r['what']} | {r['value']:.3g} {r['unit']} |" for r in data["ceilings"]]
    if data.get("prefill"):
        lines += ["", "| prefill | rows x tokens | ms | weight floor ms | FLOP floor ms | x weight | x FLOP |"]
        lines.append("|---|---|---|---|---|---|---|")
        for r in data["prefill"]:
            lines.append(
                f"| encoder | {r['rows']} x {r['tokens']} | {_ms(r['s'])} | {_ms(r['weight_floor_s'])} | "
                f"{_ms(r['flop_floor_s'])} | {_x(r['x_weight_floor'])} | {_x(r['x_flop_floor'])} |"
            )
    if data.get("step"):
        lines += [
            "",
            "| denoising step, rows | step ms | sampler alone ms | network (step - sampler) ms | weight floor ms "
            "| FLOP floor ms | step x weight floor | step x FLOP floor |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in data["step"]:
            lines.append(
                f"| {r['rows']} | {_ms(r['s'])} | {_ms(r.get('sampler_s'))} | {_ms(r.get('network_s'))} | "
                f"{_ms(r['weight_floor_s'])} | {_ms(r['flop_floor_s'])} | {_x(r['x_weight_floor'])} | "
                f"{_x(r['x_flop_floor'])} |"
            )
    if data.get("experts"):
        lines += [
            "",
            "| routed experts, one layer, rows | ragged_dot ms | expert loop ms | batched capacity GEMM ms "
            "| capacity | weight floor ms | FLOP floor ms | max rel. error vs dense |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in data["experts"]:
            lines.append(
                f"| {r['rows']} | {_ms(r['ragged_s'])} | {_ms(r['loop_s'])} | {_ms(r['batched_s'])} | "
                f"{r['capacity']} | {_ms(r['weight_floor_s'])} | {_ms(r['flop_floor_s'])} | {r['max_rel_error']:.2e} |"
            )
    if data.get("generate"):
        lines += [
            "",
            "| generate | rows | canvases x steps | new tokens | wall s | tokens/s | decoder passes/row |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in data["generate"]:
            lines.append(
                f"| {r['impl']} | {r['rows']} | {r['canvases']} x {r['steps']} | {r['new_tokens']} | "
                f"{r['s']:.3f} | {r['tokens_per_s']:.1f} | {r['decoder_passes']} |"
            )
    for key in ("errors", "skipped"):
        if data.get(key):
            lines += ["", f"{key}:"] + [f"- {e}" for e in data[key]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- jax part


def _timed(fn, reps: int) -> float:
    """Median wall seconds of fn() (which blocks on its result) over reps calls, after one."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_weights(config, seed: int = 0):
    """Random weights of the config's shape made on the device by one program (each leaf one
    fused random-number kernel, no float32 copy of the 25 GB expert stack materialised):
    normal(0, 0.02) matrices and ones for the norm gains, scales and layer scalars, as
    init_params makes them."""
    import jax
    import jax.numpy as jnp

    from dllm_jax.models import diffusion_gemma as dg

    leaves, treedef = jax.tree_util.tree_flatten_with_path(dg.abstract_params(config))

    @jax.jit
    def make(key):
        out = []
        for i, (path, leaf) in enumerate(leaves):
            if path[-1].key in ("kernel", "embedding", "gate_up_proj", "down_proj"):
                normal = jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)
                out.append((0.02 * normal).astype(leaf.dtype))
            else:
                out.append(jnp.ones(leaf.shape, leaf.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    return make(jax.random.key(seed))


def looped_expert_mlp(x, weights, experts, gate_up, down, capacity: int):
    """experts.grouped_expert_mlp's result as a loop over the experts: expert e multiplies a
    dense block of `capacity` rows (its routed rows, sorted by expert, padded), capacity >= the
    largest group. Same signature plus the capacity."""
    import jax
    import jax.numpy as jnp

    from dllm_jax.models.gemma_layers import gelu_tanh

    T, K = experts.shape
    E, F = gate_up.shape[0], down.shape[2]
    flat = experts.reshape(T * K)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.concatenate([x[order // K], jnp.zeros((capacity, x.shape[1]), x.dtype)])
    sizes = jnp.bincount(flat, length=E)
    starts = jnp.cumsum(sizes) - sizes

    def one_expert(e, out):
        block = jax.lax.dynamic_slice_in_dim(rows, starts[e], capacity)
        h = jnp.dot(block, gate_up[e].T, preferred_element_type=jnp.float32)
        h = gelu_tanh(h[:, :F].astype(x.dtype)) * h[:, F:].astype(x.dtype)
        y = jnp.dot(h, down[e].T, preferred_element_type=jnp.float32)
        y = jnp.where((jnp.arange(capacity) < sizes[e])[:, None], y, 0.0)
        # rows past the group belong to the next expert: adding zeros there leaves them alone
        return jax.lax.dynamic_update_slice_in_dim(
            out, jax.lax.dynamic_slice_in_dim(out, starts[e], capacity) + y, starts[e], 0
        )

    out = jax.lax.fori_loop(0, E, one_expert, jnp.zeros((T * K + capacity, x.shape[1]), jnp.float32))[: T * K]
    out = out.astype(x.dtype).astype(jnp.float32) * weights.reshape(T * K)[order][:, None]
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return jnp.sum(unsorted.reshape(T, K, -1), axis=1).astype(x.dtype)


def batched_expert_mlp(x, weights, experts, gate_up, down, capacity: int):
    """The same as one batched GEMM over [E, capacity] blocks (each expert's routed rows
    scattered into its block, the rest zero)."""
    import jax.numpy as jnp

    from dllm_jax.models.gemma_layers import gelu_tanh

    T, K = experts.shape
    E, F = gate_up.shape[0], down.shape[2]
    flat = experts.reshape(T * K)
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    sizes = jnp.bincount(flat, length=E)
    slot = jnp.arange(T * K) - (jnp.cumsum(sizes) - sizes)[sorted_experts]
    blocks = jnp.zeros((E, capacity, x.shape[1]), x.dtype).at[sorted_experts, slot].set(x[order // K])
    h = jnp.einsum("ecd,efd->ecf", blocks, gate_up, preferred_element_type=jnp.float32)
    h = gelu_tanh(h[..., :F].astype(x.dtype)) * h[..., F:].astype(x.dtype)
    y = jnp.einsum("ecf,edf->ecd", h, down, preferred_element_type=jnp.float32).astype(x.dtype)
    out = y[sorted_experts, slot].astype(jnp.float32) * weights.reshape(T * K)[order][:, None]
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return jnp.sum(unsorted.reshape(T, K, -1), axis=1).astype(x.dtype)


def reference_generation(config, settings, params, prompt, rows: int, shape: dict[str, Any], report: Report) -> None:
    """tests/diffusion_gemma_reference.generate (a host loop over the jitted prefill and steps
    the step rows time) on `rows` copies of the prompt: one warm-up run, one timed."""
    import jax
    import numpy as np

    from tests.diffusion_gemma_reference import generate

    P, L = prompt.shape[1], config.canvas_length
    run = functools.partial(
        generate,
        config,
        params,
        np.repeat(prompt, rows, axis=0),
        jax.random.key(2),
        max_new_tokens=shape["canvases"] * L,
        settings=settings,
        eos_token_ids=(),
    )
    run()
    start = time.perf_counter()
    out = run()
    s = time.perf_counter() - start
    new = out.sequences.shape[1] - P
    report.add(
        "generate",
        {
            "impl": "dllm_jax reference (host loop)",
            "rows": rows,
            "canvases": shape["canvases"],
            "steps": settings.max_denoising_steps,
            "new_tokens": new,
            "s": s,
            "tokens_per_s": rows * new / s,
            "decoder_passes": sorted(set(out.decoder_passes.tolist())),
        },
    )


def run_jax(args: argparse.Namespace, report: Report, deadline: float) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dllm_jax.models import diffusion_gemma as dg
    from dllm_jax.models import experts as ex
    from dllm_jax.policies.entropy_bound import denoise_update, initial_canvas, initial_state, step_noise
    from tests.diffusion_gemma_reference import _denoise_step, _encode

    shape = bench_shape(args.tiny)
    config = model_config(args.tiny)
    settings = denoise_settings(shape)
    peak_flops, peak_bw = args.peak_tflops * 1e12, args.peak_tbps * 1e12
    P, L, V, reps = shape["prompt"], config.canvas_length, config.vocab_size, shape["reps"]
    report.data.update(device=jax.devices()[0].device_kind, jax=jax.__version__)

    def time_left(section: str) -> bool:
        if time.perf_counter() < deadline:
            return True
        report.data.setdefault("skipped", []).append(f"{section} (jax part's budget spent)")
        report.save()
        return False

    # ceilings
    n = 1024 if args.tiny else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    s = _timed(lambda: mm(a).block_until_ready(), reps)
    report.add("ceilings", {"what": f"bf16 matmul {n}^3", "value": 2 * n**3 / s / 1e12, "unit": "TFLOP/s"})
    big = jnp.ones(((1 << 26) if args.tiny else (1 << 32),), jnp.bfloat16)
    add = jax.jit(lambda x: x + 1)
    s = _timed(lambda: add(big).block_until_ready(), reps)
    report.add(
        "ceilings", {"what": "bf16 elementwise (read + write)", "value": 2 * big.nbytes / s / 1e12, "unit": "TB/s"}
    )
    big = None  # the buffer is freed (the timed closure above is done with it)

    start = time.perf_counter()
    params = jax.block_until_ready(random_weights(config))
    report.data["weights"] = {"bytes": weight_bytes(config), "make_s": round(time.perf_counter() - start, 2)}
    report.save()

    rng = np.random.default_rng(0)
    prompt = rng.integers(*IMAGE_FREE_IDS, (1, P)) if not args.tiny else rng.integers(3, V, (1, P))
    valid = jnp.ones((1, P), bool)

    # prefill: the reference's jitted encoder into an empty cache of the prompt's length
    empty = dg.init_cache(config, 1, P)
    cache, _ = _encode(config, params, jnp.asarray(prompt), empty, valid)
    s = _timed(lambda: jax.block_until_ready(_encode(config, params, jnp.asarray(prompt), empty, valid)), reps)
    weight_s, flop_s = pass_weight_bytes(config, P) / peak_bw, encode_flops(config, 1, P) / peak_flops
    report.add(
        "prefill",
        {
            "rows": 1,
            "tokens": P,
            "s": s,
            "weight_floor_s": weight_s,
            "flop_floor_s": flop_s,
            "x_weight_floor": s / weight_s,
            "x_flop_floor": s / flop_s,
        },
    )

    # one denoising step (decoder pass + sampler) and the sampler alone, at each row count
    key = jax.random.key(1)

    @jax.jit
    def sampler_only(state, logits, step):
        uniform, noise = step_noise(key, step, *state.canvas.shape, V)
        return denoise_update(settings, state, logits, step, uniform, noise)

    for rows in ROWS:
        if not time_left(f"step at {rows} rows"):
            break
        # the prompt's cache repeated for every row: keys and values [N_kind, B, S, KVH, Dh]
        tiled = cache.replace(
            keys={name: jnp.repeat(k, rows, axis=1) for name, k in cache.keys.items()},
            values={name: jnp.repeat(v, rows, axis=1) for name, v in cache.values.items()},
            valid=jnp.repeat(cache.valid, rows, axis=0),
        )
        state = initial_state(initial_canvas(key, rows, L, V), V, settings, config.jnp_dtype)
        state = _denoise_step(config, settings, params, state, tiled, key, jnp.int32(0))  # self-conditioned from now on
        step = jnp.int32(1)
        s = _timed(
            lambda: jax.block_until_ready(_denoise_step(config, settings, params, state, tiled, key, step)), reps
        )
        logits = jax.random.normal(key, (rows, L, V), jnp.float32)
        sampler_s = _timed(lambda: jax.block_until_ready(sampler_only(state, logits, step)), reps)
        weight_s = pass_weight_bytes(config, rows * L) / peak_bw
        flop_s = decode_flops(config, rows, P) / peak_flops
        report.add(
            "step",
            {
                "rows": rows,
                "s": s,
                "sampler_s": sampler_s,
                "network_s": s - sampler_s,
                "weight_floor_s": weight_s,
                "flop_floor_s": flop_s,
                "x_weight_floor": s / weight_s,
                "x_flop_floor": s / flop_s,
                "experts_reached_per_layer": experts_reached(config, rows * L),
                "logits_f32_bytes": rows * L * V * 4,
            },
        )
        tiled = state = logits = None  # freed before the next row count
        if rows in GENERATE_ROWS and time_left(f"reference generate at {rows} rows"):
            reference_generation(config, settings, params, prompt, rows, shape, report)

    # the routed experts of one layer at the real shapes
    gate_up, down = (
        params["sliding_layers"]["experts"]["gate_up_proj"][0],
        params["sliding_layers"]["experts"]["down_proj"][0],
    )
    grouped = jax.jit(ex.grouped_expert_mlp)
    dense = jax.jit(ex.dense_expert_mlp)
    looped = jax.jit(looped_expert_mlp, static_argnums=5)
    batched = jax.jit(batched_expert_mlp, static_argnums=5)
    for rows in ROWS:
        if not time_left(f"experts at {rows} canvases"):
            break
        T = rows * L
        kx, kr, kw = jax.random.split(jax.random.fold_in(key, rows), 3)
        x = jax.random.normal(kx, (T, config.d_model), jnp.bfloat16)
        routing = jax.random.uniform(kr, (T, config.n_experts))
        _, chosen = jax.lax.top_k(routing, config.top_k_experts)
        chosen = chosen.astype(jnp.int32)
        weights = jax.random.uniform(kw, (T, config.top_k_experts), jnp.float32)
        largest = int(np.bincount(np.asarray(chosen).ravel(), minlength=config.n_experts).max())
        capacity = -(-largest // 8) * 8
        args_ = (x, weights, chosen, gate_up, down)
        reference = np.asarray(dense(*args_), np.float32)
        error = 0.0
        for fn in (lambda: grouped(*args_), lambda: looped(*args_, capacity), lambda: batched(*args_, capacity)):
            got = np.asarray(fn(), np.float32)
            error = max(error, float(np.linalg.norm(got - reference) / np.linalg.norm(reference)))
        reached = experts_reached(config, T)
        report.add(
            "experts",
            {
                "rows": T,
                "ragged_s": _timed(lambda: grouped(*args_).block_until_ready(), reps),
                "loop_s": _timed(lambda: looped(*args_, capacity).block_until_ready(), reps),
                "batched_s": _timed(lambda: batched(*args_, capacity).block_until_ready(), reps),
                "capacity": capacity,
                "weight_floor_s": reached * expert_bytes(config) / peak_bw,
                "flop_floor_s": expert_flops(config, T) / peak_flops,
                "max_rel_error": error,
            },
        )


# ----------------------------------------------------------------------------- torch part


def run_torch(args: argparse.Namespace, report: Report, deadline: float) -> None:
    import torch
    from transformers import DiffusionGemmaConfig as HFConfig
    from transformers import DiffusionGemmaForBlockDiffusion, DiffusionGemmaGenerationConfig
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    from dllm_jax.models.diffusion_gemma_config import SMALLEST_VISION_CONFIG

    shape = bench_shape(args.tiny)
    config = model_config(args.tiny)
    settings = denoise_settings(shape)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report.data.update(torch=torch.__version__)
    hf = config.to_hf_config()
    hf["vision_config"] = SMALLEST_VISION_CONFIG  # transformers builds one regardless (unused by text)
    hf_config = HFConfig.from_dict(hf)
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = DiffusionGemmaForBlockDiffusion._from_config(hf_config, dtype=torch.bfloat16).eval()
    report.data["torch_model"] = {
        "params": sum(p.numel() for p in model.parameters()),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "attn_implementation": model.config._attn_implementation,
        "make_s": round(time.perf_counter() - start, 2),
    }
    report.save()
    generation = DiffusionGemmaGenerationConfig(
        max_new_tokens=shape["canvases"] * config.canvas_length,
        max_denoising_steps=settings.max_denoising_steps,
        t_min=settings.t_min,
        t_max=settings.t_max,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=settings.entropy_bound),
        stability_threshold=settings.stability_threshold,
        confidence_threshold=settings.confidence_threshold,
    )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    P = shape["prompt"]
    high = IMAGE_FREE_IDS[1] if not args.tiny else config.vocab_size
    for rows in GENERATE_ROWS:
        if time.perf_counter() > deadline:
            report.data.setdefault("skipped", []).append(
                f"transformers generate at {rows} rows (torch part's budget spent)"
            )
            report.save()
            break
        ids = torch.randint(IMAGE_FREE_IDS[0], high, (1, P), device=device).repeat(rows, 1)

        def run(ids=ids):
            with torch.no_grad():
                out = model.generate(ids, generation_config=generation)
            if device == "cuda":
                torch.cuda.synchronize()
            return out

        run()
        start = time.perf_counter()
        out = run()
        s = time.perf_counter() - start
        new = out.sequences.shape[1] - P
        passes = (new / out.tokens_per_forward).round().int().tolist()
        report.add(
            "generate",
            {
                "impl": f"transformers {model.config._attn_implementation} (eager generate)",
                "rows": rows,
                "canvases": shape["canvases"],
                "steps": settings.max_denoising_steps,
                "new_tokens": new,
                "s": s,
                "tokens_per_s": rows * new / s,
                "decoder_passes": sorted(set(passes)),
            },
        )


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small config (CPU smoke test, same code paths)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--budget-s", type=float, default=150.0, help="wall time of both parts together")
    parser.add_argument("--peak-tflops", type=float, default=800.0)
    parser.add_argument("--peak-tbps", type=float, default=4.3)
    parser.add_argument("--parts", nargs="+", choices=("jax", "torch"), default=["jax", "torch"])
    parser.add_argument("--part", choices=("jax", "torch"), help=argparse.SUPPRESS)  # one part, in this process
    parser.add_argument("--deadline-s", type=float, help=argparse.SUPPRESS)
    return parser


# the jax part's share of the budget (the torch part gets what is left), and how long before the
# end of its share a part stops starting sections (the one it started may take that long)
_JAX_SHARE = 0.65
_GRACE_S = 30.0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out
    if args.part:  # a child: one part, appending to the report the parent started
        report = Report(out, json.loads((out / f"{REPORT}.json").read_text()))
        deadline = time.perf_counter() + args.deadline_s
        try:
            (run_jax if args.part == "jax" else run_torch)(args, report, deadline)
        except Exception as e:
            report.data.setdefault("errors", []).append(f"{args.part}: {type(e).__name__}: {e}")
            report.save()
            raise
        return 0

    started = time.perf_counter()
    shape = bench_shape(args.tiny)
    report = Report(
        out,
        {
            "config": "tiny" if args.tiny else "diffusion_gemma_26b_a4b_config()",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": " ".join(sys.argv),
            "shape": shape,
            "peaks": {"tflops": args.peak_tflops, "tbps": args.peak_tbps},
        },
    )
    report.save()
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95", PYTHONPATH=str(ROOT))
    if args.tiny:
        env.setdefault("JAX_PLATFORMS", "cpu")
    rc = 0
    for part in args.parts:
        left = args.budget_s - (time.perf_counter() - started)
        share = left * _JAX_SHARE if part == "jax" and "torch" in args.parts else left
        soft = max(share - _GRACE_S, 0.0)
        command = [sys.executable, __file__, "--part", part, "--deadline-s", f"{soft:.1f}", "--out", str(out)]
        command += ["--peak-tflops", str(args.peak_tflops), "--peak-tbps", str(args.peak_tbps)]
        command += ["--tiny"] if args.tiny else []
        try:
            # a part only starts work before its deadline; at the end of its share, it is stopped
            returncode = subprocess.run(command, env=env, timeout=max(share, 1.0)).returncode
        except subprocess.TimeoutExpired:
            returncode = 124
        if returncode:
            rc = returncode
            data = json.loads((out / f"{REPORT}.json").read_text())
            data.setdefault("errors", []).append(f"part {part} exited with {returncode}")
            Report(out, data).save()
    data = json.loads((out / f"{REPORT}.json").read_text())
    data["wall_s"] = round(time.perf_counter() - started, 1)
    Report(out, data).save()
    print(markdown(data), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
