"""DiffusionGemma on the engine at the 26B-A4B shape (random weights, bf16), in one GPU call.

    PYTHONPATH=. python scripts/gpu/diffusion_gemma_engine.py            # H200: about 3-4 min
    PYTHONPATH=. python scripts/gpu/diffusion_gemma_engine.py --tiny     # CPU smoke test (tiny shapes)

Parts, in order, each slot count's rows written to diffusion_gemma_engine.json / .md under --out
as they come, no new part started once --budget-s is spent:
  ceilings  this device's copy bandwidth (an elementwise bf16 pass) and bf16 matmul rate, the
            floors' denominators, measured in the same process;
  steps     for each slot count (1, 8, 32): the engine's canvas loop compiled for it (the
            engine's own memory check first), every slot denoising a canvas after a prompt of
            --prompt tokens (max_denoising_steps so large and confidence_threshold so small that no
            canvas stops): ms per loop iteration (the decoder pass over slots x 256 rows, the LM
            head and the entropy-bound step of every slot, the soft embeddings), against
            the weight floor (the weights' bytes, each expert counted when some row of the
            step is expected to reach it, over the copy bandwidth) and the FLOP floor
            (2 x the active parameters of a token + the soft embeddings' 2 V D + attention, per
            row, over the matmul rate);
  e2e       the equal-work schedule on the same compiled loop: --requests requests of one
            canvas (256 tokens) after a --prompt-token prompt, --steps denoising steps each (no
            early stop), through Engine.generate (the session's host loop included): canvas
            positions generated per second.
Each row also says how XLA lowered the experts' grouped GEMMs (ragged dots left in the optimized
program and cuDNN custom calls: cuDNN's grouped GEMM, or a dense rewrite when both are 0); a slot
count that fails (compile, memory) is reported with its error and the next one runs.

Random weights: normal with 1/sqrt(fan-in) per matrix, norms and scalars 1, made on the device
per layer (the layer stacks as tuples of per-layer trees, as Engine(unroll_layers=True) keeps
them), 25.25e9 parameters, 50.5 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dllm_jax.models import diffusion_gemma as dg  # noqa: E402
from dllm_jax.models.diffusion_gemma_config import (  # noqa: E402
    AttentionKind,
    DiffusionGemmaConfig,
    diffusion_gemma_26b_a4b_config,
)
from dllm_jax.sampling.params import MAX_DENOISING_STEPS, SamplingParams  # noqa: E402

TINY_TEXT = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=16,
    num_global_key_value_heads=1,
    sliding_window=4,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=16,
    max_position_embeddings=256,
)
ONES = ("weight", "layer_scalar", "encoder_layer_scalar", "scale", "per_expert_scale")


def model_config(tiny: bool) -> DiffusionGemmaConfig:
    if not tiny:
        return diffusion_gemma_26b_a4b_config("bfloat16")
    hf = {"model_type": "diffusion_gemma", "canvas_length": 8, "text_config": TINY_TEXT}
    return DiffusionGemmaConfig.from_hf_config(hf, dtype="float32", source="tiny")


def random_weights(config: DiffusionGemmaConfig, seed: int = 0) -> dg.Weights:
    """The parameter tree with per-layer tuples, each leaf made on the device."""
    stacked = dg.abstract_params(config)
    tree = dict(stacked)
    for name in dg.STACKS.values():
        if name in stacked:
            count = jax.tree.leaves(stacked[name])[0].shape[0]
            one = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), stacked[name])
            tree[name] = (one,) * count
    makers = {}

    def make(path, leaf, index):
        name = path[-1].key
        key = (leaf.shape, leaf.dtype, name in ONES)
        if key not in makers:
            if name in ONES:
                makers[key] = jax.jit(lambda k, s=leaf.shape, d=leaf.dtype: jnp.ones(s, d))
            else:
                # [in, out] kernels and the embedding [V, D]: fan-in is axis 0 / D; experts [E, out, in]: the last
                fan_in = leaf.shape[-1] if leaf.ndim == 3 or name == "embedding" else leaf.shape[0]
                makers[key] = jax.jit(
                    lambda k, s=leaf.shape, d=leaf.dtype, f=fan_in: (
                        jax.random.normal(k, s, jnp.float32) / f**0.5
                    ).astype(d)
                )
        return makers[key](jax.random.fold_in(jax.random.key(seed), index))

    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(treedef, [make(path, leaf, i) for i, (path, leaf) in enumerate(leaves)])


def ceilings(tiny: bool) -> dict:
    """Copy bandwidth (bytes read + written per second of an elementwise bf16 pass) and bf16 matmul FLOP/s."""
    n = 1 << (16 if tiny else 30)
    x = jnp.ones((n,), jnp.bfloat16)
    double = jax.jit(lambda a: a * 2)
    m = 256 if tiny else 8192
    a = jnp.ones((m, m), jnp.bfloat16)
    matmul = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16))

    def best(fn, *args, repeats=5):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
        return min(times)

    return {"bytes_per_s": 4 * n / best(double, x), "flops_per_s": 2 * m**3 / best(matmul, a, a)}


def floors(config: DiffusionGemmaConfig, slots: int, prompt: int, ceiling: dict) -> dict:
    """The step's weight floor (ms) and FLOP floor (ms): see the module docstring."""
    shapes = dg.abstract_params(config)
    itemsize = config.jnp_dtype.itemsize
    total = dg.count_params(shapes)
    experts = dg.count_params([shapes[n]["experts"] for n in dg.STACKS.values() if n in shapes])
    L, E, K = config.canvas_length, config.n_experts, config.top_k_experts
    rows = slots * L
    # expected share of a layer's experts some row of the step is routed to (uniform routing)
    reached = 1 - (1 - K / E) ** rows
    weight_bytes = ((total - experts) + experts * reached) * itemsize
    active = dg.active_params_per_token(config, shapes)
    attention = 0
    for kind in AttentionKind:
        cached = prompt if kind is AttentionKind.FULL else min(prompt, config.sliding_window - 1)
        attention += config.layers_of(kind) * 4 * (cached + L) * config.n_heads * config.head_dim(kind)
    flops = rows * (2 * active + 2 * config.vocab_size * config.d_model + attention)
    return {
        "weight_floor_ms": 1e3 * weight_bytes / ceiling["bytes_per_s"],
        "flop_floor_ms": 1e3 * flops / ceiling["flops_per_s"],
        "weight_gb": weight_bytes / 1e9,
        "gflop": flops / 1e9,
    }


def no_stop(max_steps: int = MAX_DENOISING_STEPS) -> SamplingParams:
    """One canvas per request, denoised for exactly max_steps steps (random weights are never confident)."""
    return SamplingParams(max_denoising_steps=max_steps, confidence_threshold=1e-30, seed=0)


def step_time(engine, compiled, prompt_ids, slots: int, iterations: int, repeats: int) -> float:
    """ms per loop iteration with every slot denoising (after one prefill iteration)."""
    sampling = dataclasses.replace(no_stop(), max_new_tokens=engine.config.canvas_length)
    state = compiled.initial_state([prompt_ids] * slots, sampling)
    # prefill: ceil(prompt / L) iterations, then every slot denoises
    done = -(-len(prompt_ids) // engine.config.canvas_length)
    state = compiled.run(engine.weights, state, jnp.int32(done), jnp.bool_(False))
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done += iterations
        state = compiled.run(engine.weights, state, jnp.int32(done), jnp.bool_(False))
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) / iterations)
    assert int(jax.device_get(state.iteration)) == done and bool(jax.device_get(state.slots.active).all())
    return 1e3 * min(times)


def lowering(compiled) -> dict:
    """How XLA lowered the experts' grouped GEMMs: ragged dots left and cuDNN fusions in the
    optimized program (a dense rewrite leaves neither)."""
    text = compiled.run.as_text() or ""
    return {"ragged_dot": text.count("ragged-dot("), "cudnn_calls": text.count("__cudnn$")}


def measure(engine, config, slots: int, prompt_ids: list[int], iterations: int, row: dict, args, began: float):
    """One slot count: compile (with the engine's memory check), the step, then the e2e schedule."""
    from dllm_jax.runtime.decode_config import DecodeConfig

    decode_config = DecodeConfig(method="diffusion_gemma", gen_length=config.canvas_length, batch_size=slots)
    compiled = engine.compile(decode_config, len(prompt_ids), num_slots=slots)
    row.update(compile_s=compiled.compile_seconds, memory_gib=compiled.memory.total / 2**30, **lowering(compiled))
    row["step_ms"] = step_time(engine, compiled, prompt_ids, slots, iterations, args.repeats)
    if time.perf_counter() - began > args.budget_s:
        return
    sampling = dataclasses.replace(no_stop(args.steps), max_new_tokens=config.canvas_length)
    out = engine.generate([prompt_ids] * args.requests, sampling, decode_config=decode_config)
    assert all(r.steps == args.steps for r in out.results), "every canvas runs --steps steps"
    # every request generates its whole canvas (an EOS the random weights write ends the
    # answer's text, not the work)
    tokens = args.requests * config.canvas_length
    row["e2e"] = {
        "requests": args.requests,
        "tokens": tokens,
        "wall_s": out.stats.wall_seconds,
        "tokens_per_s": tokens / out.stats.wall_seconds,
        "iterations": out.stats.iterations,
    }


def write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "diffusion_gemma_engine.json").write_text(json.dumps(report, indent=2))
    lines = [
        "| slots | step ms | weight floor ms | step / weight floor | FLOP floor ms | step / FLOP floor | compile s | "
        "e2e tokens/s | e2e wall s | ragged dots / cuDNN calls |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        e2e = row.get("e2e", {})
        if "step_ms" not in row:
            lines.append(f"| {row['slots']} | failed: {row.get('error', '?')[:200]} |")
            continue
        lines.append(
            f"| {row['slots']} | {row['step_ms']:.2f} | {row['weight_floor_ms']:.2f} | "
            f"{row['step_ms'] / row['weight_floor_ms']:.2f} | {row['flop_floor_ms']:.2f} | "
            f"{row['step_ms'] / row['flop_floor_ms']:.2f} | {row['compile_s']:.1f} | "
            f"{e2e.get('tokens_per_s', float('nan')):.1f} | {e2e.get('wall_s', float('nan')):.2f} | "
            f"{row['ragged_dot']} / {row['cudnn_calls']} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "diffusion_gemma_engine.md").write_text(text)
    print(text, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on any device (a smoke test)")
    p.add_argument("--slots", type=int, nargs="+", default=None, help="slot counts (default 1 8 32; tiny: 1 2)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; tiny: 8)")
    p.add_argument("--iterations", type=int, default=None, help="loop iterations per timed call (default 8)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=32, help="e2e: requests per slot count")
    p.add_argument("--steps", type=int, default=16, help="e2e: denoising steps per canvas")
    p.add_argument("--budget-s", type=float, default=210.0, help="no new part starts after this many seconds")
    p.add_argument("--out", type=Path, default=Path("diffusion_gemma_engine_out"))
    args = p.parse_args(argv)
    began = time.perf_counter()
    slot_counts = args.slots or ([1, 2] if args.tiny else [1, 8, 32])
    prompt = args.prompt or (8 if args.tiny else 256)
    iterations = args.iterations or (2 if args.tiny else 8)

    from dllm_jax.engine.engine import Engine

    config = model_config(args.tiny)
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "prompt": prompt, "rows": []}
    report["ceilings"] = ceilings(args.tiny)
    print(f"ceilings: {report['ceilings']}", flush=True)
    start = time.perf_counter()
    weights = random_weights(config)
    jax.block_until_ready(weights)
    report["weights_s"] = time.perf_counter() - start
    report["weight_bytes"] = int(sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(weights)))
    print(f"weights: {report['weight_bytes'] / 1e9:.2f} GB in {report['weights_s']:.1f} s", flush=True)
    engine = Engine(config, weights, None, unroll_layers=True)
    prompt_ids = [int(t) for t in np.random.default_rng(0).integers(3, config.vocab_size, prompt)]
    for slots in slot_counts:
        if time.perf_counter() - began > args.budget_s:
            report.setdefault("skipped", []).append(slots)
            continue
        row = {"slots": slots, **floors(config, slots, prompt, report["ceilings"])}
        report["rows"].append(row)
        try:
            measure(engine, config, slots, prompt_ids, iterations, row, args, began)
        except Exception as e:  # a failed slot count (compile, memory) is reported, the next one runs
            row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"{slots} slots failed: {row['error']}", flush=True)
        report["elapsed_s"] = time.perf_counter() - began
        write(args.out, report)
    write(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
