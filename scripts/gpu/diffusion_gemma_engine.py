"""DiffusionGemma on the engine at the 26B-A4B shape (random weights, bf16), in one GPU call.

    PYTHONPATH=. python scripts/gpu/diffusion_gemma_engine.py --out OUT   # H200: under 200 s
    PYTHONPATH=. python scripts/gpu/diffusion_gemma_engine.py --tiny --budget-s 900 --hard-limit-s 1000  # CPU smoke
    (add --backend pallas to run the Pallas kernels, the grouped GEMM included, in interpret mode on the CPU)
    PYTHONPATH=. python scripts/gpu/diffusion_gemma_engine.py --quantization fp8 --transformers-s 0 --out OUT

--xla-option KEY=VALUE (repeatable): an XLA option over the engine's defaults for every loop (e.g.
xla_allow_excess_precision=false), kept in the report's compiler_options.

--sampler-budget-bytes N: the denoising stage's temporaries per group of slots (canvas_loop's
SAMPLER_BUDGET_BYTES, read when a loop is traced); with a small N the stage runs one slot at a time.

--canvas-attention-max-head-dim N: the widest heads the canvas attention kernel takes
(canvas_attention.KERNEL_MAX_HEAD_DIM, read when a loop is traced); 512 runs the full layers'
attention on the kernel too.

--quantization fp8 / int8-weights: the random bf16 weights quantized on the device, layer by layer,
each bf16 layer freed once quantized (dllm_jax.models.quantization: the projections and the
experts in 8 bits), and the engine run on them (fp8 with the quantization's compiler options);
the weight floor counts their bytes, the FLOP floor stays at the bf16 matmul rate.

Parts, in order; after each, OUT/diffusion_gemma_engine.json and .md are rewritten, no new part
starts once --budget-s has passed, and at --hard-limit-s the report is written and the process
ends whatever runs:
  transformers  in a child process, before JAX takes the device (its memory is freed when it
            exits), stopped after --transformers-s: transformers' DiffusionGemmaForBlockDiffusion
            of the same shape (its own random init, sdpa, eager: no torch.compile), generate of
            one canvas per row at each batch size of --slots, with 1 and with --steps denoising
            steps: its denoising step's time is the difference over the extra steps, its
            tokens/s the canvas positions of the --steps run per second (OUT/transformers.json);
  ceilings  this device's copy bandwidth (an elementwise bf16 pass) and bf16 matmul rate, the
            floors' denominators, measured in the same process;
  compile   the engine's canvas loop for every slot count of --slots (1, 8, 32), in
            --compile-threads threads (each with the engine's memory check first);
  steps     for each slot count, every slot denoising a canvas after a prompt of --prompt tokens
            (max_denoising_steps so large and confidence_threshold so small that no canvas
            stops): ms per loop iteration (the decoder pass over slots x 256 rows, the LM head
            and the entropy-bound step of every slot, the soft embeddings), against the weight
            floor (the weights' bytes, each expert counted when some row of the step is expected
            to reach it, over the copy bandwidth) and the FLOP floor (2 x the active parameters
            of a token + the soft embeddings' 2 V D + attention, per row, over the matmul rate);
  profile   with --profile-slots, for each of those slot counts a device trace (jax.profiler)
            of --profile-iterations loop iterations: device-busy ms per iteration, the kernels
            summed per name (with the HLO ops the trace names), and by kind (the grouped GEMM's
            kernels, the attention kernel, other GEMMs, the rest), each beside its share of the
            FLOP floor (the rest has none); the loop's optimized HLO as OUT/loop_<slots>.hlo.txt.gz;
  e2e       for each slot count, the equal-work schedule on its compiled loop: --requests
            requests of one canvas (256 tokens) after the prompt, --steps denoising steps each
            (no early stop), through Engine.generate (the session's host loop included): canvas
            positions generated per second;
  cached    with --canvas-rows N ..., for each slot count the step of a loop with Flash-Cache on
            the canvas (DecodeConfig canvas_rows=N: after a canvas's first step, N of its rows
            recomputed, the others kept), its sparse step (every slot past its canvas's first
            step), compiled with full-pass lanes of all slots only.
Each row also says how the experts' grouped GEMMs ran (ragged dots left in the optimized program
and cuDNN custom calls: cuDNN's grouped GEMM, or a dense rewrite when both are 0; and the calls of
the Pallas grouped GEMM kernel, which backend "auto" runs them with on an NVIDIA GPU:
--backend xla shows the old path); a part that fails (compile, memory) is reported with its
error and the next one runs.

Random weights: normal with 1/sqrt(fan-in) per matrix, norms and scalars 1, made on the device
per layer (the layer stacks as tuples of per-layer trees, as Engine(unroll_layers=True) keeps
them), 25.25e9 parameters, 50.5 GB.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from profile_step import by_kind, device_events, is_gemm_kernel, per_kernel  # noqa: E402

from dllm_jax.models import diffusion_gemma as dg  # noqa: E402
from dllm_jax.models.checkpoint.dtypes import QUANTIZATIONS  # noqa: E402
from dllm_jax.models.diffusion_gemma_config import (  # noqa: E402
    AttentionKind,
    DiffusionGemmaConfig,
    diffusion_gemma_26b_a4b_config,
)
from dllm_jax.models.quantization import quantize_params, weight_bytes  # noqa: E402
from dllm_jax.policies.entropy_bound import DenoiseSettings  # noqa: E402
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
TINY_VISION = dict(  # transformers' model has a vision tower; dllm_jax skips it
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=4,
    pooling_kernel_size=1,
    position_embedding_size=16,
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


def quantized_layer_by_layer(weights: dg.Weights, mode: str) -> dg.Weights:
    """quantize_params(weights, mode), each bf16 layer dropped once its 8-bit copy is made: at
    26B-A4B the bf16 tree (50.5 GB) and a whole 8-bit copy (26 GB) do not fit an 80 GB card
    together."""
    weights = dict(weights)
    stacks = [name for name in dg.STACKS.values() if name in weights]
    for name in stacks:
        layers, done = list(weights.pop(name)), []
        while layers:
            done.append(jax.block_until_ready(quantize_params({name: (layers.pop(0),)}, mode)[name][0]))
        weights[name] = tuple(done)
    rest = quantize_params({k: v for k, v in weights.items() if k not in stacks}, mode)
    return {**weights, **rest}


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
    """The step's weight floor (ms) and FLOP floor (ms): see the module docstring (8-bit
    weights: their bytes; the FLOPs are counted on the unquantized model)."""
    shapes = dg.abstract_params(config)
    total = weight_bytes(shapes)
    experts = weight_bytes([shapes[n]["experts"] for n in dg.STACKS.values() if n in shapes])
    L, E, K = config.canvas_length, config.n_experts, config.top_k_experts
    rows = slots * L
    # expected share of a layer's experts some row of the step is routed to (uniform routing)
    reached = 1 - (1 - K / E) ** rows
    read = (total - experts) + experts * reached
    plain = dataclasses.replace(config, quantization="none")
    plain_shapes = dg.abstract_params(plain)
    active = dg.active_params_per_token(plain, plain_shapes)
    # the routed experts' share of a token's parameters (K of E experts per layer)
    routed = dg.count_params([plain_shapes[n]["experts"] for n in dg.STACKS.values() if n in plain_shapes]) * K // E
    attention = 0
    for kind in AttentionKind:
        cached = prompt if kind is AttentionKind.FULL else min(prompt, config.sliding_window - 1)
        attention += config.layers_of(kind) * 4 * (cached + L) * config.n_heads * config.head_dim(kind)
    # per kernel kind (kernel_kind's names): the experts' grouped GEMMs, the other GEMMs (the
    # projections, the dense MLP, the LM head and the soft embeddings), the attention; the rest
    # (norms, routing, the sampler, copies) has no FLOPs counted
    kinds = {
        "grouped GEMM (experts)": 2 * routed,
        "other GEMMs": 2 * (active - routed) + 2 * config.vocab_size * config.d_model,
        "attention": attention,
    }
    flops = rows * sum(kinds.values())
    return {
        "weight_floor_ms": 1e3 * read / ceiling["bytes_per_s"],
        "flop_floor_ms": 1e3 * flops / ceiling["flops_per_s"],
        "flop_floor_ms_by_kind": {k: 1e3 * rows * f / ceiling["flops_per_s"] for k, f in kinds.items()},
        "weight_gb": read / 1e9,
        "gflop": flops / 1e9,
    }


def no_stop(max_steps: int = MAX_DENOISING_STEPS) -> SamplingParams:
    """One canvas per request, denoised for exactly max_steps steps (random weights are never confident),
    every sampler value set (transformers' defaults otherwise): the transformers run reads them."""
    settings = dataclasses.replace(DenoiseSettings(), max_denoising_steps=max_steps, confidence_threshold=1e-30)
    return SamplingParams(**dataclasses.asdict(settings), seed=0)


def denoising_state(engine, compiled, prompt_ids, slots: int):
    """A loop state with every slot past its canvas's first step -> (state, iterations run)."""
    sampling = dataclasses.replace(no_stop(), max_new_tokens=engine.config.canvas_length)
    state = compiled.initial_state([prompt_ids] * slots, sampling)
    # prefill: ceil(prompt / L) iterations, then the canvas's first (full) step, then every slot
    # runs a plain denoising step
    done = -(-len(prompt_ids) // engine.config.canvas_length) + 1
    return jax.block_until_ready(compiled.run(engine.weights, state, done)), done


def step_time(engine, compiled, prompt_ids, slots: int, iterations: int, repeats: int) -> float:
    """ms per loop iteration with every slot denoising, past its canvas's first step."""
    state, done = denoising_state(engine, compiled, prompt_ids, slots)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done += iterations
        state = compiled.run(engine.weights, state, iterations)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) / iterations)
    assert int(jax.device_get(state.iteration)) == done and bool(jax.device_get(state.slots.active).all())
    return 1e3 * min(times)


def kernel_kind(name: str) -> str:
    """What a traced kernel is: the Pallas grouped GEMM, the Pallas cache-attention kernel,
    another GEMM (cuBLAS, cuDNN, XLA's Triton GEMM fusions: with the attention on XLA its GEMMs
    count here), or the rest (norms, routing, the sampler, copies, XLA's softmax passes)."""
    if "grouped_matmul" in name:
        return "grouped GEMM (experts)"
    if name.startswith("cache_attention"):
        return "attention"
    if is_gemm_kernel(name):
        return "other GEMMs"
    return "rest"


def profile_steps(engine, compiled, prompt_ids, slots: int, iterations: int) -> dict:
    """A device trace of `iterations` denoising iterations: busy ms per iteration, by kind and
    per kernel name (the 150 longest)."""
    state, _ = denoising_state(engine, compiled, prompt_ids, slots)
    state = jax.block_until_ready(compiled.run(engine.weights, state, 1))  # the traced program warm
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(compiled.run(engine.weights, state, iterations))
        wall = (time.perf_counter() - start) / iterations
        events = device_events(Path(tmp))
    kernels = per_kernel(events, iterations)
    ops = collections.defaultdict(collections.Counter)  # kernel -> the HLO ops the trace names for it
    for e in events:
        args = e.get("args", {})
        ops[e["name"]][str(args.get("hlo_op") or args.get("long_name") or args.get("name", ""))[:120]] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:150]
    return {
        "iterations": iterations,
        "wall_ms_profiled": 1e3 * wall,
        "device_busy_ms": sum(ms for ms, _ in kernels.values()),
        "kernels_per_iteration": sum(n for _, n in kernels.values()),
        "by_kind": by_kind(kernels, kernel_kind),
        "top": [
            {"name": name[:160], "ms": ms, "calls": n, "ops": dict(ops[name].most_common(4))} for name, (ms, n) in top
        ],
        "event_args": sorted({k for e in events[:2000] for k in e.get("args", {})}),
    }


def lowering(compiled) -> dict:
    """How the experts' grouped GEMMs run: ragged dots left and cuDNN fusions in the optimized
    program (a dense rewrite leaves neither), and the Pallas grouped GEMM's kernel calls
    (backend "auto" on an NVIDIA GPU: Kernels.experts, pallas_kernels.matmul.grouped_matmul)."""
    text = compiled.call.as_text() or ""
    kernels = sum(
        1 for line in text.splitlines() if "custom-call(" in line and "triton" in line and "grouped_matmul" in line
    )
    return {
        "ragged_dot": text.count("ragged-dot("),
        "cudnn_calls": text.count("__cudnn$"),
        "grouped_matmul": kernels,
        "backend": compiled.loop.kernels.name + (" +experts" if compiled.loop.kernels.experts else ""),
    }


def loop_config(config: DiffusionGemmaConfig, slots: int, canvas_rows: int | None = None):
    """The DecodeConfig of a one-canvas loop of `slots` slots."""
    from dllm_jax.runtime.decode_config import DecodeConfig

    return DecodeConfig(
        method="diffusion_gemma", gen_length=config.canvas_length, batch_size=slots, canvas_rows=canvas_rows
    )


def compile_and_time(engine, config, slots: int, prompt_ids, iterations: int, row: dict, args, canvas_rows=None):
    """Compile the loop for `slots` (with the engine's memory check; cached when compiled
    before), then its step time."""
    decode_config = loop_config(config, slots, canvas_rows)
    compiled = engine.compile(decode_config, len(prompt_ids), num_slots=slots)
    row.update(compile_s=compiled.compile_seconds, memory_gib=compiled.memory.total / 2**30, **lowering(compiled))
    row["sampler_slots"] = compiled.loop.sampler_slots
    row["step_ms"] = step_time(engine, compiled, prompt_ids, slots, iterations, args.repeats)
    return decode_config


def end_to_end(engine, config, decode_config, prompt_ids, args) -> dict:
    """The equal-work schedule on the loop compiled for decode_config: --requests one-canvas
    requests of --steps denoising steps each, through Engine.generate."""
    sampling = dataclasses.replace(no_stop(args.steps), max_new_tokens=config.canvas_length)
    out = engine.generate([prompt_ids] * args.requests, sampling, decode_config=decode_config)
    assert all(r.steps == args.steps for r in out.results), "every canvas runs --steps steps"
    # every request generates its whole canvas (an EOS the random weights write ends the
    # answer's text, not the work)
    tokens = args.requests * config.canvas_length
    return {
        "requests": args.requests,
        "tokens": tokens,
        "wall_s": out.stats.wall_seconds,
        "tokens_per_s": tokens / out.stats.wall_seconds,
        "iterations": out.stats.iterations,
    }


# ----- transformers' generate, in a child process run before JAX takes the device ------------


def transformers_model(tiny: bool):
    """transformers' DiffusionGemmaForBlockDiffusion of the shape, random weights (its own
    init), sdpa attention, on the GPU in bf16 when there is one (else the CPU in float32)."""
    import torch
    from transformers import DiffusionGemmaConfig as HFConfig
    from transformers import DiffusionGemmaForBlockDiffusion

    from dllm_jax.models.diffusion_gemma_config import diffusion_gemma_26b_a4b_hf_config

    hf = (
        {"model_type": "diffusion_gemma", "canvas_length": 8, "text_config": TINY_TEXT}
        if tiny
        else diffusion_gemma_26b_a4b_hf_config()
    )
    config = HFConfig.from_dict({**hf, "vision_config": TINY_VISION})
    # sdpa: transformers' generate builds its padded decoder mask from the int canvas, which its
    # eager mask cannot take
    config._attn_implementation = config.text_config._attn_implementation = "sdpa"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        model = built_with_ties(DiffusionGemmaForBlockDiffusion, config, device).eval()
    return model, device


def built_with_ties(model_class, config, device: str):
    """model_class(config) with its parameters made once on `device`, after the model has
    tied them (its encoder's to its decoder's), then given transformers' own init. Built
    directly, the model holds both copies until post_init ties them: 100 GB at 26B-A4B, more
    than an 80 GB card. Buffers (RoPE frequencies, scales) are built where they live."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        model = model_class(config)
    finally:
        torch.nn.Module.register_parameter = register
    made = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                module._parameters[name] = made[id(param)]
    with torch.no_grad():
        for module in model.modules():
            if any(p is not None for p in module._parameters.values()):
                model._init_weights(module)
    return model


def transformers_part(args, prompt_ids: list[int], out: Path) -> None:
    """Per batch size of --slots: transformers' generate of one canvas per row after the
    prompt, 1 and --steps denoising steps (no early stop); the denoising step's time is the
    difference over the extra steps. Written to transformers.json after each batch."""
    import torch
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    started = time.perf_counter()
    model, device = transformers_model(args.tiny)
    if device == "cuda":
        torch.cuda.synchronize()
    result = {"device": device, "build_s": time.perf_counter() - started, "rows": []}
    sampling = no_stop(args.steps)
    canvas = model.config.canvas_length

    def run(batch: int, steps: int) -> float:
        ids = torch.tensor([prompt_ids] * batch, device=device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=canvas,
                max_denoising_steps=steps,
                t_min=sampling.t_min,
                t_max=sampling.t_max,
                sampler_config=EntropyBoundSamplerConfig(entropy_bound=sampling.entropy_bound),
                stability_threshold=sampling.stability_threshold,
                confidence_threshold=sampling.confidence_threshold,
                eos_token_id=[1],
                pad_token_id=0,
                disable_compile=True,
            )
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(1, 1)  # warm-up: kernels, cuBLAS handles
    for batch in args.slots_counts:
        one, full = run(batch, 1), run(batch, args.steps)
        result["rows"].append(
            {
                "batch": batch,
                "one_step_s": one,
                "wall_s": full,
                "step_ms": 1e3 * (full - one) / max(args.steps - 1, 1),
                "tokens_per_s": batch * canvas / full,
            }
        )
        (out / "transformers.json").write_text(json.dumps(result, indent=2))
        print(f"transformers: {result['rows'][-1]}", flush=True)


def run_transformers(args, seconds: float) -> dict:
    """transformers_part in a child process (its GPU memory is freed when it exits), killed
    after `seconds`; what it wrote by then."""
    child = [sys.executable, str(Path(__file__).resolve()), "--transformers-child", *sys_argv_rest(args)]
    try:
        done = subprocess.run(child, timeout=seconds, capture_output=True, text=True)
        status = "finished" if done.returncode == 0 else f"failed (rc {done.returncode}): {done.stderr[-1500:]}"
    except subprocess.TimeoutExpired:
        status = f"stopped after {seconds:.0f} s"
    path = args.out / "transformers.json"
    result = json.loads(path.read_text()) if path.exists() else {"rows": []}
    result["status"] = status
    return result


def sys_argv_rest(args) -> list[str]:
    """The child's command line: the shape and schedule options of this run."""
    rest = ["--prompt", str(args.prompt), "--steps", str(args.steps), "--out", str(args.out)]
    rest += ["--slots", *map(str, args.slots_counts)]
    return rest + (["--tiny"] if args.tiny else [])


# ----- the report --------------------------------------------------------------------------


def write(out: Path, report: dict, show: bool = False) -> None:
    """The JSON report and the table (written as .md; printed when `show`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "diffusion_gemma_engine.json").write_text(json.dumps(report, indent=2, default=str))
    hf = {r["batch"]: r for r in report.get("transformers", {}).get("rows", [])}
    nan = float("nan")
    lines = [
        "| slots | step ms | weight floor ms (x) | FLOP floor ms (x) | compile s | e2e tokens/s | "
        "transformers step ms | transformers tokens/s | ragged dots / cuDNN / grouped GEMM kernels |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        theirs = hf.get(row["slots"], {})
        if "step_ms" not in row:
            lines.append(f"| {row['slots']} | {row.get('error', 'not run')[:200]} |")
            continue
        e2e = row.get("e2e", {})
        lines.append(
            f"| {row['slots']} | {row['step_ms']:.2f} | {row['weight_floor_ms']:.2f} "
            f"({row['step_ms'] / row['weight_floor_ms']:.2f}) | {row['flop_floor_ms']:.2f} "
            f"({row['step_ms'] / row['flop_floor_ms']:.2f}) | {row['compile_s']:.1f} | "
            f"{e2e.get('tokens_per_s', nan):.1f} | {theirs.get('step_ms', nan):.2f} | "
            f"{theirs.get('tokens_per_s', nan):.1f} | {row['ragged_dot']} / {row['cudnn_calls']} / "
            f"{row.get('grouped_matmul', 0)} |"
        )
        for rows, cached in row.get("canvas_rows", {}).items():
            if "step_ms" not in cached:
                lines.append(f"| {row['slots']}, canvas_rows {rows} | {cached.get('error', 'not run')[:200]} |")
                continue
            lines.append(
                f"| {row['slots']}, canvas_rows {rows} | {cached['step_ms']:.2f} | "
                f"({cached['step_ms'] / row['weight_floor_ms']:.2f}) | "
                f"({cached['step_ms'] / row['flop_floor_ms']:.2f}) | {cached['compile_s']:.1f} | | | | |"
            )
    for row in report["rows"]:
        profile = row.get("profile")
        if not profile:
            continue
        if "error" in profile:
            lines.append(f"\nprofile, {row['slots']} slots: {profile['error'][:300]}")
            continue
        lines.append(
            f"\nprofile, {row['slots']} slots: {profile['device_busy_ms']:.2f} ms busy of "
            f"{profile['wall_ms_profiled']:.2f} ms per iteration, {profile['kernels_per_iteration']:.0f} kernels"
        )
        lines += [
            "",
            "| kind or kernel | ms per iteration | calls | FLOP floor ms | over it ms |",
            "|---|---|---|---|---|",
        ]
        floor = row.get("flop_floor_ms_by_kind", {})
        for k, v in profile["by_kind"].items():
            f = floor.get(k, 0.0)
            lines.append(f"| **{k}** | {v['ms']:.2f} | {v['calls']:.0f} | {f:.2f} | {v['ms'] - f:.2f} |")
        lines += [f"| {k['name'][:100]} | {k['ms']:.3f} | {k['calls']:.0f} | | |" for k in profile["top"][:20]]
    if report.get("backend"):
        lines.append(f"\nbackend: {report['backend']}")
    groups = [f"{row['slots']} slots: {row['sampler_slots']}" for row in report["rows"] if "sampler_slots" in row]
    if groups:
        lines.append(f"denoising stage, slots per group: {', '.join(groups)}")
    if report.get("stopped"):
        lines.append(f"\nstopped {report['stopped']}")
    status = report.get("transformers", {}).get("status")
    if status:
        lines.append(f"\ntransformers' generate: {status}")
    if report.get("skipped"):
        lines.append(f"not run within the time: {', '.join(report['skipped'])}")
    text = "\n".join(lines) + "\n"
    (out / "diffusion_gemma_engine.md").write_text(text)
    if show:
        print(text, flush=True)


def watchdog(seconds: float, out: Path, report: dict) -> threading.Timer:
    """Writes what was measured and ends the process once `seconds` have passed."""

    def stop():
        report["stopped"] = f"at the hard limit of {seconds:.0f} s"
        try:
            write(out, report, show=True)
        finally:
            os._exit(0)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    return timer


def xla_option(text: str) -> tuple[str, bool | int | str]:
    """--xla-option's KEY=VALUE: the value as a bool (true/false), an int, or the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value


def kernel_switch(text: str) -> tuple[str, bool]:
    """--kernel's NAME=true|false: a Kernels field switched over the backend's choice."""
    from dllm_jax.runtime.kernel_routing import Kernels

    name, sep, value = text.partition("=")
    names = sorted(f.name for f in dataclasses.fields(Kernels) if f.type in ("bool", bool) and f.name != "interpret")
    if not sep or name not in names or value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=true|false, NAME one of {names}")
    return name, value.lower() == "true"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on any device (a smoke test)")
    p.add_argument("--slots", dest="slots_counts", type=int, nargs="+", default=None, help="default 1 8 32; tiny: 1 2")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; tiny: 8)")
    p.add_argument("--iterations", type=int, default=None, help="loop iterations per timed call (default 8)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=32, help="e2e: requests per slot count")
    p.add_argument("--steps", type=int, default=16, help="e2e: denoising steps per canvas")
    p.add_argument(
        "--canvas-rows", type=int, nargs="*", default=[], help="also time Flash-Cache on the canvas with these rows"
    )
    p.add_argument("--profile-slots", type=int, nargs="*", default=[], help="trace the step at these slot counts")
    p.add_argument("--profile-iterations", type=int, default=2, help="iterations in each trace")
    p.add_argument("--transformers-s", type=float, default=40.0, help="transformers' part's limit (0: skip it)")
    p.add_argument("--budget-s", type=float, default=140.0, help="no new part starts after this many seconds")
    p.add_argument("--hard-limit-s", type=float, default=190.0, help="write the report and exit at this time")
    p.add_argument("--out", type=Path, default=Path("diffusion_gemma_engine_out"))
    p.add_argument("--compile-threads", type=int, default=3, help="step loops compiled side by side (1: in turn)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="8-bit weights (made from bf16 ones)")
    p.add_argument("--backend", default="auto", help="the engine's backend (auto: the Pallas grouped GEMM on a GPU)")
    p.add_argument(
        "--xla-option",
        dest="xla_options",
        type=xla_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an XLA option the loops are compiled with, over the engine's defaults (repeatable; true/false/ints parsed)",
    )
    p.add_argument(
        "--kernel",
        dest="kernel_switches",
        type=kernel_switch,
        action="append",
        default=[],
        metavar="NAME=BOOL",
        help="switch one of the kernel routing's kernels (Kernels' field) on or off over --backend's choice (repeatable)",
    )
    p.add_argument(
        "--sampler-budget-bytes",
        type=int,
        default=None,
        help="the denoising stage's temporaries per group of slots (default: canvas_loop.SAMPLER_BUDGET_BYTES)",
    )
    p.add_argument(
        "--canvas-attention-max-head-dim",
        type=int,
        default=None,
        help="the widest heads the canvas attention kernel takes (default: canvas_attention.KERNEL_MAX_HEAD_DIM)",
    )
    p.add_argument(
        "--merged-dots-max-rows",
        type=int,
        default=None,
        help="past this many rows the dots that share an input read it apart "
        "(default: diffusion_gemma.MERGED_DOTS_MAX_ROWS)",
    )
    p.add_argument("--transformers-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    began = time.perf_counter()
    args.slots_counts = args.slots_counts or ([1, 2] if args.tiny else [1, 8, 32])
    args.prompt = args.prompt or (8 if args.tiny else 256)
    iterations = args.iterations or (2 if args.tiny else 8)
    args.out.mkdir(parents=True, exist_ok=True)
    config = model_config(args.tiny)
    prompt_ids = [int(t) for t in np.random.default_rng(0).integers(3, config.vocab_size, args.prompt)]
    if args.transformers_child:
        transformers_part(args, prompt_ids, args.out)
        return 0

    report = {"prompt": args.prompt, "steps": args.steps, "requests": args.requests, "rows": [], "skipped": []}
    report["quantization"] = args.quantization
    watchdog(args.hard_limit_s, args.out, report)
    if args.transformers_s > 0:  # first: JAX then takes the device's memory
        report["transformers"] = run_transformers(args, args.transformers_s)
        report["transformers_s"] = time.perf_counter() - began
        write(args.out, report)

    from dllm_jax.engine.engine import Engine
    from dllm_jax.runtime import canvas_loop
    from dllm_jax.runtime.compiler_options import default_compiler_options

    if args.sampler_budget_bytes is not None:  # read when a loop is traced
        canvas_loop.SAMPLER_BUDGET_BYTES = args.sampler_budget_bytes
    report["sampler_budget_bytes"] = canvas_loop.SAMPLER_BUDGET_BYTES
    from dllm_jax.runtime import canvas_attention

    if args.canvas_attention_max_head_dim is not None:  # read when a loop is traced
        canvas_attention.KERNEL_MAX_HEAD_DIM = args.canvas_attention_max_head_dim
    report["canvas_attention_max_head_dim"] = canvas_attention.KERNEL_MAX_HEAD_DIM
    from dllm_jax.models import diffusion_gemma

    if args.merged_dots_max_rows is not None:  # read when a loop is traced
        diffusion_gemma.MERGED_DOTS_MAX_ROWS = args.merged_dots_max_rows
    report["merged_dots_max_rows"] = diffusion_gemma.MERGED_DOTS_MAX_ROWS

    report.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    report["ceilings"] = ceilings(args.tiny)
    print(f"ceilings: {report['ceilings']}", flush=True)
    start = time.perf_counter()
    weights = random_weights(config)
    if args.quantization != "none":
        weights = quantized_layer_by_layer(weights, args.quantization)
        config = dataclasses.replace(config, quantization=args.quantization)
    jax.block_until_ready(weights)
    report["weights_s"] = time.perf_counter() - start
    report["weight_bytes"] = int(sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(weights)))
    print(f"weights: {report['weight_bytes'] / 1e9:.2f} GB in {report['weights_s']:.1f} s", flush=True)
    # one full-pass variant (all slots) for the cached-canvas loops: the exact loop has no other
    # off a GPU the kernels run in interpret mode (the CPU smoke: --tiny --backend pallas)
    interpret = jax.devices()[0].platform != "gpu"
    options = {**default_compiler_options(config.quantization), **dict(args.xla_options)}
    from dllm_jax.runtime.kernel_routing import resolve_kernels

    kernels = dataclasses.replace(resolve_kernels(args.backend, interpret), **dict(args.kernel_switches))
    engine = Engine(
        config,
        weights,
        None,
        backend=kernels,
        interpret=interpret,
        unroll_layers=True,
        full_pass_lanes=(),
        compiler_options=options,
    )
    report["compiler_options"] = options
    report["backend"] = engine.backend + (" +experts" if engine.kernels.experts else "")
    report["kernel_switches"] = dict(args.kernel_switches)
    rows = {
        slots: {"slots": slots, **floors(config, slots, args.prompt, report["ceilings"])} for slots in args.slots_counts
    }
    report["rows"] = list(rows.values())
    loops = {}
    if args.compile_threads > 1:  # XLA compiles without the GIL: the step loops side by side
        start = time.perf_counter()
        with ThreadPoolExecutor(args.compile_threads) as pool:
            compiles = [
                pool.submit(engine.compile, loop_config(config, slots), args.prompt, num_slots=slots)
                for slots in args.slots_counts
            ]
            wait(compiles)  # a failed compile fails again, reported, in its step part
        report["parallel_compile_s"] = time.perf_counter() - start
        print(f"compiled {args.slots_counts} slots in {report['parallel_compile_s']:.1f} s", flush=True)
    # the parts in order of need: every slot count's step, then the e2e schedules, then Flash-Cache
    parts = [("step", slots, None) for slots in args.slots_counts]
    parts += [("profile", slots, None) for slots in args.profile_slots if slots in args.slots_counts]
    parts += [("e2e", slots, None) for slots in sorted(args.slots_counts, reverse=True)]  # the quickest first
    parts += [("cached", slots, n) for n in args.canvas_rows for slots in args.slots_counts]
    for kind, slots, canvas_rows in parts:
        name = f"{kind} {slots}" + (f" canvas_rows {canvas_rows}" if canvas_rows else "")
        if kind != "step" and slots not in loops:
            continue  # its step failed
        if time.perf_counter() - began > args.budget_s:
            report["skipped"].append(name)
            continue
        row = rows[slots]
        try:
            if kind == "step":
                loops[slots] = compile_and_time(engine, config, slots, prompt_ids, iterations, row, args)
            elif kind == "e2e":
                row["e2e"] = end_to_end(engine, config, loops[slots], prompt_ids, args)
            elif kind == "profile":
                compiled = engine.compile(loops[slots], args.prompt, num_slots=slots)  # cached
                row["profile"] = profile_steps(engine, compiled, prompt_ids, slots, args.profile_iterations)
                with gzip.open(args.out / f"loop_{slots}.hlo.txt.gz", "wt") as f:  # the kernels' HLO
                    f.write(compiled.call.as_text() or "")
            else:
                cached = row.setdefault("canvas_rows", {}).setdefault(canvas_rows, {})
                compile_and_time(engine, config, slots, prompt_ids, iterations, cached, args, canvas_rows)
        except Exception as e:  # a failed part (compile, memory) is reported, the next one runs
            error = f"{type(e).__name__}: {str(e)[:2000]}"
            if kind == "step":
                row["error"] = error
            elif kind in ("e2e", "profile"):
                row[kind] = {"error": error}
            else:
                row["canvas_rows"][canvas_rows]["error"] = error
            print(f"{name} failed: {error}", flush=True)
        report["elapsed_s"] = time.perf_counter() - began
        write(args.out, report)
    write(args.out, report, show=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
