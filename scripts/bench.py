"""Full-scale decode speed: every method at LLaDA-8B (and Dream-7B) shapes, side by side, against the roofline.

    PYTHONPATH=. python scripts/bench.py                         # GPU: LLaDA-8B, random bf16 weights
    PYTHONPATH=. python scripts/bench.py --model-shape llada-8b dream-7b   # both families in one run
    PYTHONPATH=. python scripts/bench.py --preset steps --slots 1 8 32
    PYTHONPATH=. python scripts/bench.py --tiny                  # CPU smoke test (tiny model)

Random weights make confidences meaningless, so the methods run equal-work schedules:
"one" = one token per step (threshold 2 > 1: the at-least-one rule; llada steps = gen_length)
and "window" = a whole window of W = 16 positions per step (threshold 0; llada steps =
gen_length / 16). Presets:
  steps    steady-state step time of flash_cache (128 recomputed rows per slot, one token per
           step) per backend and slot count, against its FLOP floor and weight-streaming floor;
  compare  end-to-end runs of llada, fast_dllm (dual cache), flash_cache and flash_cache +
           verify under both schedules: tokens/s, ms per iteration, rows per step, and the
           speed ratios between methods against the ratios of their FLOPs.
The two ceilings (a large bf16 matmul rate, a large elementwise pass's bandwidth counting
bytes read + written) are measured in the same run, after the decode runs so that their
buffers stay out of the reported peak memory (the allocator's peak over the process). Compile time is reported apart from run
time. Writes bench.json and bench.md to --out (default $OUT or ./out), updated after each run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

# --batch-invariant: XLA reads its (deterministic) flags once, when the backend starts
if "--batch-invariant" in sys.argv:
    from dllm_jax.runtime.batch_invariance import deterministic_xla_flags  # noqa: E402

    os.environ["XLA_FLAGS"] = deterministic_xla_flags()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import Shapes, measure_ceilings, time_chain  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.models.config import ModelConfig, dream_7b_config, llada_8b_config  # noqa: E402
from dllm_jax.models.quantization import (  # noqa: E402
    QUANTIZATIONS,
    quantize_embedding,
    quantize_kernel,
    quantizes_embedding,
    weight_bytes,
)
from dllm_jax.models.quantization import (  # noqa: E402
    QUANTIZED_MODULES as QUANTIZED,
)
from dllm_jax.models.transformer import init_params, init_params_per_layer  # noqa: E402
from dllm_jax.runtime.decode_config import DecodeConfig  # noqa: E402
from dllm_jax.runtime.sharding import parse_mesh  # noqa: E402
from dllm_jax.sampling.params import SamplingParams  # noqa: E402

WINDOW = 16
METHODS = ("llada", "fast_dllm", "flash_cache", "flash_verify")
SCHEDULES = ("one", "window")


def tiny_config(model: str = "llada-8b") -> ModelConfig:
    """A tiny model of the family of `model` (Dream: q/k/v biases, 4 query heads per kv head)."""
    base = ModelConfig(
        d_model=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        mlp_hidden_size=256,
        vocab_size=256,
        mask_token_id=255,
        eos_token_id=254,
        pad_token_id=254,
        max_sequence_length=1024,
        dtype="float32",
    )
    if model == "dream-7b":
        return dataclasses.replace(base, n_kv_heads=1, family="dream", qkv_bias=True)
    return base


def model_config(model: str, tiny: bool, dtype: str | None = None) -> ModelConfig:
    """The random-weight model of a --model-shape name (with --tiny: a tiny one of its family)."""
    config = tiny_config(model) if tiny else MODEL_SHAPES[model]()
    return dataclasses.replace(config, dtype=dtype or config.dtype)


def sparse_rows_per_slot(policy, config: ModelConfig, key_len: int) -> int:
    """Query rows of a sparse step: the policy's, plus the candidates' predictor rows for a
    model with shifted logits (dllm_jax.models.logit_alignment)."""
    extra = policy.num_candidates if config.logit_shift else 0
    return min(policy.num_sparse_rows, key_len) + extra


def mid_size_config(d_model: int, n_layers: int, n_heads: int, mlp: int) -> ModelConfig:
    """A LLaDA-shaped model of another size (LLaDA's vocabulary and special tokens)."""
    return ModelConfig(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        mlp_hidden_size=mlp,
        vocab_size=126464,
        rope_theta=500000.0,
        mask_token_id=126336,
        eos_token_id=126081,
        pad_token_id=126081,
        bos_token_id=126080,
        max_sequence_length=4096,
        dtype="bfloat16",
    )


# --model-shape: random-weight models by name (--tiny is the CPU smoke test's own)
MODEL_SHAPES = {
    "llada-8b": llada_8b_config,
    "dream-7b": dream_7b_config,
    "1b": lambda: mid_size_config(
        2048, 16, 32, 8192
    ),  # Llama-3.2-1B's widths: 1.59 B parameters (0.52 B embedding and head)
    "0.5b": lambda: mid_size_config(1024, 12, 16, 4096),  # 0.46 B parameters (0.26 B embedding and head)
}


def decode_config(method: str, schedule: str, gen_length: int, slots: int) -> DecodeConfig:
    """The equal-work DecodeConfig of a method under a schedule (with schedule_sampling's values)."""
    one = schedule == "one"
    common = dict(gen_length=gen_length, batch_size=slots, block_length=WINDOW)
    if method == "llada":
        return DecodeConfig(method="llada", steps=gen_length if one else gen_length // WINDOW, **common)
    if method == "fast_dllm":
        return DecodeConfig(method="fast_dllm", cache="dual", **common)
    return DecodeConfig(method="flash_cache", mask_num=4, track_num=4, verify=method == "flash_verify", **common)


def schedule_sampling(method: str, schedule: str) -> SamplingParams:
    """The requests' values of a schedule: threshold 2 (one token per step: the at-least-one
    rule) or 0 (the whole window) where the method commits by threshold."""
    if method == "llada":
        return SamplingParams()
    return SamplingParams(threshold=2.0 if schedule == "one" else 0.0)


def quantize_on_device(params, quantization: str):
    """quantize_params one projection (and then the embedding) at a time on the device (a
    whole-tree float32 copy of LLaDA-8B would not fit beside the bf16 weights)."""
    one = jax.jit(quantize_kernel, static_argnums=1)
    layers = params["layers"]
    per_layer = layers if isinstance(layers, (list, tuple)) else [layers]
    # a projection's other leaves (Dream's q/k/v biases) stay, as in quantize_params
    done = [
        {
            name: {**{k: v for k, v in sub.items() if k != "kernel"}, **one(sub["kernel"], quantization)}
            if "kernel" in sub and name in QUANTIZED
            else sub
            for name, sub in lp.items()
        }
        for lp in per_layer
    ]
    quantized = {**params, "layers": tuple(done) if isinstance(layers, (list, tuple)) else done[0]}
    if quantizes_embedding(quantization, weight_tying="lm_head" not in params):
        quantized["wte"] = jax.jit(quantize_embedding)(params["wte"]["embedding"])
    return quantized


def measure_fp8_matmul(n: int, repeats: int) -> float:
    """FP8 (e4m3 x e4m3 -> f32) matmul rate in FLOP/s at n x n x n, as the quantized projections
    call it (dllm_jax.models.quantization.quantized_matmul without the scales)."""
    a, b = jax.random.normal(jax.random.key(1), (2, n, n), jnp.float32)
    a, b = a.astype(jnp.float8_e4m3fn), (b / n**0.5).astype(jnp.float8_e4m3fn)
    contract = (((1,), (1,)), ((), ()))

    def step(i, c, b):
        return jax.lax.dot_general(c, b, contract, preferred_element_type=jnp.float32).astype(jnp.float8_e4m3fn)

    return 2 * n**3 / time_chain(step, a, b, inner=4, repeats=repeats)


# ----------------------------------------------------------------------------- FLOPs and bytes


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of model work, from the config (matmuls, attention, LM head).

    params_bytes: the weights' bytes as stored (None: every parameter in config.dtype); an
    8-bit model streams about half.
    """

    config: ModelConfig
    params_bytes: float | None = None

    @property
    def matmul_flops_per_row(self) -> float:
        c = self.config
        q_out = c.n_heads * c.head_dim
        per_layer = c.d_model * q_out * 2 + c.d_model * c.kv_dim * 2 + 3 * c.d_model * c.mlp_hidden_size
        return 2.0 * c.n_layers * per_layer

    def attention_flops(self, rows: float, keys: float) -> float:
        c = self.config
        return 4.0 * rows * keys * c.n_heads * c.head_dim * c.n_layers

    def head_flops(self, rows: float) -> float:
        return 2.0 * rows * self.config.d_model * self.config.vocab_size

    def pass_flops(self, rows: float, keys: float, logit_rows: float) -> float:
        return rows * self.matmul_flops_per_row + self.attention_flops(rows, keys) + self.head_flops(logit_rows)

    @property
    def weight_bytes(self) -> float:
        if self.params_bytes is not None:
            return float(self.params_bytes)
        return float(self.config.num_params() * self.config.jnp_dtype.itemsize)

    def cache_read_bytes(self, slots: float, keys: float) -> float:
        c = self.config
        return 2.0 * slots * keys * c.kv_dim * c.jnp_dtype.itemsize * c.n_layers

    def work(self, flops: float, passes: float, slots: float, keys: float) -> dict:
        """FLOPs and the fewest bytes of some work: weights once per pass plus each slot's
        cache read once per pass."""
        return {
            "flops": flops,
            "bytes": passes * (self.weight_bytes + self.cache_read_bytes(slots, keys)),
            "weight_bytes_moved": passes * self.weight_bytes,
        }


def add_floors(run: dict, ceilings: dict, cost: Cost) -> None:
    """Time floors (FLOPs at the matmul rate, bytes at the bandwidth) and the measured ratios.

    A compare run's floor is per pass: a lockstep batch's iterations are full passes, sparse
    steps and verify passes, each bound by its FLOPs or by streaming the weights and the
    cache, whichever is slower; the run's floor is the sum over its passes."""
    run["flop_floor_s"] = run["flops"] / ceilings["matmul_flops"]
    if run.get("quantization") == "fp8" and "fp8_matmul_flops" in ceilings:
        # the block projections run at the FP8 rate; attention and the LM head stay bf16
        projection = run["projection_flops"]
        run["flop_floor_s"] = (
            projection / ceilings["fp8_matmul_flops"] + (run["flops"] - projection) / ceilings["matmul_flops"]
        )
    run["byte_floor_s"] = run["bytes"] / ceilings["bandwidth_bytes"]
    run["weight_floor_s"] = run["weight_bytes_moved"] / ceilings["bandwidth_bytes"]
    if run["preset"] == "steps":
        run["step_over_flop_floor"] = run["step_s"] / run["flop_floor_s"]
        run["step_over_weight_floor"] = run["step_s"] / run["weight_floor_s"]
    else:
        run["floor_s"] = pass_floors(
            cost, run["work_per_request"], run["slots"], ceilings, run.get("quantization") == "fp8"
        )
        run["time_over_floor"] = run["wall_s"] / run["floor_s"]


def work_per_request(loop, decode: DecodeConfig, prompt_len: int, steps: int) -> dict:
    """Rows recomputed, logit rows and passes of one request, from its policy and step count.

    pass_types: (passes, rows, logit rows) of each kind of pass the request went through
    (full passes, sparse steps, verify passes), for the per-pass floors.
    """
    policy = loop.policy
    G, W = decode.gen_length, decode.window
    key_len = int(policy.key_length(jnp.int32(prompt_len), jnp.int32(prompt_len + G)))
    if decode.method == "llada":
        full, sparse = steps, 0
    elif decode.method == "fast_dllm":
        full = G // W
        sparse = steps - full
    else:
        full, sparse = 1, steps - 1
    C = policy.num_candidates
    pass_types = [(full, key_len, C), (sparse, sparse_rows_per_slot(policy, loop.model, key_len), C)]
    if decode.verify:
        pass_types.append((steps, policy.verify_rows, W // 2))
    rows = sum(n * r for n, r, _ in pass_types)
    return {
        "key_len": key_len,
        "full_passes": full,
        "sparse_steps": sparse,
        "rows": rows,
        "logit_rows": sum(n * c for n, _, c in pass_types),
        "rows_per_step": rows / steps,
        "pass_types": pass_types,
    }


def pass_floors(cost: Cost, work: dict, slots: int, ceilings: dict, fp8: bool = False) -> float:
    """Sum over the passes of a lockstep batch of max(FLOP floor, byte floor) of each pass;
    fp8: the block projections at the FP8 matmul rate (attention and the LM head at bf16's)."""
    key_len = work["key_len"]
    fp8_rate = ceilings.get("fp8_matmul_flops") if fp8 else None
    total = 0.0
    for passes, rows, logit_rows in work["pass_types"]:
        flops = cost.pass_flops(slots * rows, key_len, slots * logit_rows)
        flop_time = flops / ceilings["matmul_flops"]
        if fp8_rate:
            projection = slots * rows * cost.matmul_flops_per_row
            flop_time = projection / fp8_rate + (flops - projection) / ceilings["matmul_flops"]
        bytes_moved = cost.weight_bytes + cost.cache_read_bytes(slots, key_len)
        total += passes * max(flop_time, bytes_moved / ceilings["bandwidth_bytes"])
    return total


# ----------------------------------------------------------------------------- runs


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def host_peak_rss_bytes() -> int:
    """The process's peak resident memory (what a CPU device's arrays live in; CPUs report no
    device memory statistics)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, vocab - 2, length))) for _ in range(n)]


def initial_state(compiled, prompts: list[list[int]], sampling: SamplingParams):
    """The decode state of a compiled loop with these prompts in its request ring (all fit)."""
    return compiled.initial_state(prompts, sampling)


def key_len(compiled, prompt_len: int) -> int:
    """Keys a slot of this loop attends to for a prompt of prompt_len and a full-length answer."""
    end = prompt_len + compiled.loop.gen_length
    return int(compiled.loop.policy.key_length(jnp.int32(prompt_len), jnp.int32(end)))


def steady_step_time(
    engine: Engine, decode: DecodeConfig, prompts, iterations: int, repeats: int, sampling: SamplingParams | None = None
) -> dict:
    """Median seconds per loop iteration after the slots' first full pass (all slots decoding);
    sampling: the requests' values (None: one token per step)."""
    compiled = engine.compile(decode, len(prompts[0]))
    sampling = schedule_sampling(decode.method, "one") if sampling is None else sampling
    state = initial_state(compiled, prompts, sampling)
    start = time.perf_counter()
    state = jax.block_until_ready(compiled.run(engine.weights, state, 1))
    prefill = time.perf_counter() - start
    state = jax.block_until_ready(compiled.run(engine.weights, state, 2))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = jax.block_until_ready(compiled.run(engine.weights, state, iterations))
        samples.append((time.perf_counter() - start) / iterations)
    active = int(jnp.sum(state.slots.active))
    return {
        "prefill_s": prefill,
        "step_s": statistics.median(samples),
        "step_samples_s": samples,
        "active_slots_at_end": active,
        "compile_s": compiled.compile_seconds,
        "rows_per_slot": sparse_rows_per_slot(
            compiled.loop.policy, compiled.loop.model, key_len(compiled, len(prompts[0]))
        ),
        "key_len": key_len(compiled, len(prompts[0])),
    }


def steps_run(engine, backend, slots, gen_length, prompt_len, cost, opts) -> dict:
    decode = decode_config("flash_cache", "one", gen_length, slots)
    prompts = random_prompts(slots, prompt_len, engine.config.vocab_size, seed=slots)
    timing = steady_step_time(engine, decode, prompts, opts.iterations, opts.repeats)
    rows = slots * timing["rows_per_slot"]
    flops = cost.pass_flops(rows, timing["key_len"], slots * WINDOW)
    return {
        "preset": "steps",
        "method": "flash_cache",
        "schedule": "one",
        "backend": backend,
        "slots": slots,
        "quantization": engine.config.quantization,
        "projection_flops": rows * cost.matmul_flops_per_row,
        "gen_length": gen_length,
        "prompt_length": prompt_len,
        **timing,
        **cost.work(flops, 1, slots, timing["key_len"]),
        "peak_bytes": peak_bytes(),
    }


def compare_run(engine, method, schedule, backend, slots, gen_length, prompt_len, cost) -> dict:
    decode = decode_config(method, schedule, gen_length, slots)
    prompts = random_prompts(slots, prompt_len, engine.config.vocab_size, seed=7)
    engine.compile(decode, prompt_len)  # compile apart from the timed run
    compile_s = engine.compile(decode, prompt_len).compile_seconds
    out = engine.generate(prompts, schedule_sampling(method, schedule), decode_config=decode)
    s = out.stats
    loop = engine.decode_loop(decode, prompt_len)
    work = [work_per_request(loop, decode, prompt_len, r.steps) for r in out.results]
    rows = sum(w["rows"] for w in work)
    key_len = work[0]["key_len"]
    flops = cost.pass_flops(rows, key_len, sum(w["logit_rows"] for w in work))
    passes = s.iterations * (2 if decode.verify else 1)
    return {
        "preset": "compare",
        "method": method,
        "schedule": schedule,
        "backend": backend,
        "slots": slots,
        "quantization": engine.config.quantization,
        "projection_flops": rows * cost.matmul_flops_per_row,
        "gen_length": gen_length,
        "prompt_length": prompt_len,
        "tokens": s.reference_num_tokens,
        "wall_s": s.wall_seconds,
        "tokens_per_s": s.tokens_per_second,
        "tokens_per_step": s.tokens_per_step,
        "steps": s.steps,
        "iterations": s.iterations,
        "forward_passes": s.forward_passes,
        "ms_per_iteration": 1e3 * s.wall_seconds / s.iterations,
        "rows_per_step": rows / s.steps,
        "flops_per_token": flops / s.reference_num_tokens,
        "compile_s": compile_s,
        "cache_bytes": s.cache_bytes,
        "peak_bytes": peak_bytes(),
        "host_peak_rss_bytes": host_peak_rss_bytes(),
        **cost.work(flops, passes, slots, key_len),
        "work_per_request": work[0],
    }


def flop_ratio_checks(runs: list[dict]) -> list[dict]:
    """For each schedule/backend/slots group, every method against flash_cache: the measured
    speed ratio vs the ratio of their FLOPs, and vs the ratio of their per-pass floors (which
    also counts passes bound by streaming the weights rather than by FLOPs)."""
    checks = []
    base = {(r["schedule"], r["backend"], r["slots"], r["gen_length"]): r for r in runs if r["method"] == "flash_cache"}
    for r in runs:
        ref = base.get((r["schedule"], r["backend"], r["slots"], r["gen_length"]))
        if ref is None or r is ref:
            continue
        speed = ref["tokens_per_s"] / r["tokens_per_s"]
        flop = r["flops_per_token"] / ref["flops_per_token"]
        floor = (r["floor_s"] / r["tokens"]) / (ref["floor_s"] / ref["tokens"])
        checks.append(
            {
                "method": r["method"],
                "schedule": r["schedule"],
                "backend": r["backend"],
                "slots": r["slots"],
                "gen_length": r["gen_length"],
                "flash_speedup": speed,
                "flop_ratio": flop,
                "speed_over_flops": speed / flop,
                "floor_ratio": floor,
                "speed_over_floors": speed / floor,
            }
        )
    return checks


# ----------------------------------------------------------------------------- report


def _weight_bytes(report: dict, run: dict) -> float:
    """The weights of a run's model (reports before --models hold one number)."""
    weights = report["weight_bytes"]
    return weights[run.get("model", "llada-8b")] if isinstance(weights, dict) else weights


def markdown(report: dict) -> str:
    c = report["ceilings"]
    if c is None:
        return "(ceilings not measured yet)"
    lines = [
        f"Device: {report['device']} | jax {report['jax']} | model {report['model']} | "
        f"matmul {c['matmul_flops'] / 1e12:.0f} TFLOP/s, bandwidth {c['bandwidth_bytes'] / 1e12:.2f} TB/s (measured)"
        + (f", FP8 matmul {c['fp8_matmul_flops'] / 1e12:.0f} TFLOP/s" if "fp8_matmul_flops" in c else ""),
        "",
    ]
    by_quantization = report.get("weight_bytes_by_quantization", {})
    if len(by_quantization) > 1:
        lines += ["Weights: " + ", ".join(f"{q} {b / 1e9:.2f} GB" for q, b in by_quantization.items()), ""]
    steps = [r for r in report["runs"] if r["preset"] == "steps"]
    if steps:
        lines += [
            "| backend | slots | rows/slot | keys | step ms | FLOP floor ms | step/FLOP floor | weight floor ms | step/weight floor | prefill ms | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            lines.append(
                f"| {r['backend']} | {r['slots']} | {r['rows_per_slot']} | {r['key_len']} | {1e3 * r['step_s']:.2f} | "
                f"{1e3 * r['flop_floor_s']:.2f} | {r['step_over_flop_floor']:.2f} | {1e3 * r['weight_floor_s']:.2f} | "
                f"{r['step_over_weight_floor']:.2f} | {1e3 * r['prefill_s']:.1f} | {r['compile_s']:.1f} |"
            )
        lines.append("")
    compare = [r for r in report["runs"] if r["preset"] == "compare"]
    if compare:
        lines += [
            "| method | schedule | backend | slots | gen | tokens/s | tokens/step | ms/iteration | rows/step | GFLOP/token | time/floor | peak GiB | weights+cache GiB | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in compare:
            rss = r.get("host_peak_rss_bytes")
            peak = f"{r['peak_bytes'] / 2**30:.1f}" if r["peak_bytes"] else f"RSS {rss / 2**30:.1f}" if rss else "n/a"
            lines.append(
                f"| {r['method']} | {r['schedule']} | {r['backend']} | {r['slots']} | {r['gen_length']} | "
                f"{r['tokens_per_s']:.1f} | {r['tokens_per_step']:.2f} | {r['ms_per_iteration']:.2f} | {r['rows_per_step']:.0f} | "
                f"{r['flops_per_token'] / 1e9:.1f} | {r['time_over_floor']:.2f} | {peak} | "
                f"{(_weight_bytes(report, r) + r['cache_bytes']) / 2**30:.1f} | {r['compile_s']:.1f} |"
            )
        lines += [
            "",
            "| method | schedule | backend | slots | gen | flash_cache speed-up | FLOP ratio | speed-up / FLOP ratio | floor ratio | speed-up / floor ratio |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["flop_ratio_checks"]:
            lines.append(
                f"| {r['method']} | {r['schedule']} | {r['backend']} | {r['slots']} | {r['gen_length']} | "
                f"{r['flash_speedup']:.2f} | {r['flop_ratio']:.2f} | {r['speed_over_flops']:.2f} | "
                f"{r['floor_ratio']:.2f} | {r['speed_over_floors']:.2f} |"
            )
    for e in report["errors"]:
        lines.append(f"\nERROR {e['run']}: {e['error']}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tiny", action="store_true", help="CPU smoke test on a tiny model (of each --model-shape's family)"
    )
    p.add_argument(
        "--model-shape",
        nargs="+",
        choices=tuple(MODEL_SHAPES),
        default=["llada-8b"],
        help="random-weight model(s), benchmarked one after the other in this run (e.g. llada-8b dream-7b)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="weights and activations (default: the model's own; float32 suits CPUs)",
    )
    p.add_argument(
        "--reanalyse",
        type=Path,
        default=None,
        help="recompute the floors and tables of an earlier bench.json (no device needed); writes next to it",
    )
    p.add_argument("--preset", nargs="+", choices=("steps", "compare"), default=["steps", "compare"])
    p.add_argument("--backends", nargs="+", choices=("auto", "xla", "pallas"), default=None)
    p.add_argument("--mesh", default=None, help='decode over several devices, e.g. "data=2" or "tensor=2"')
    p.add_argument(
        "--quantizations",
        nargs="+",
        choices=QUANTIZATIONS,
        default=["none"],
        help="weight formats to run (dllm_jax.models.quantization); 8-bit ones are made from the bf16 weights",
    )
    p.add_argument(
        "--layers",
        choices=("stacked", "per_layer"),
        default="per_layer",
        help="weights stacked (layer loop scanned) or one array per layer (loop unrolled)",
    )
    p.add_argument("--slots", nargs="+", type=int, default=None)
    p.add_argument("--compare-slots", nargs="+", type=int, default=None)
    p.add_argument("--gen-lengths", nargs="+", type=int, default=None)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--prompt-length", type=int, default=None)
    p.add_argument("--iterations", type=int, default=8, help="iterations per step-time sample")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ceiling-repeats", type=int, default=10)
    p.add_argument(
        "--compiler-options",
        type=json.loads,
        default=None,
        help="XLA options of the decode loops as JSON, e.g. '{\"xla_gpu_enable_triton_gemm\": true}' "
        "(default: the quantization's own, dllm_jax.models.quantization.compiler_options; {} = XLA's defaults)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the engine's batch-invariant mode (dllm_jax.runtime.batch_invariance; sets XLA's deterministic flags)",
    )
    p.add_argument("--budget-s", type=float, default=None, help="skip runs once this much time has passed")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    tiny = opts.tiny
    opts.backends = opts.backends or (["xla"] if tiny else ["xla", "auto"])
    opts.slots = opts.slots or ([1, 2] if tiny else [1, 8, 32])
    opts.compare_slots = opts.compare_slots or ([2] if tiny else [8])
    opts.gen_lengths = opts.gen_lengths or ([32] if tiny else [256, 512])
    opts.prompt_length = opts.prompt_length or (16 if tiny else 256)
    return opts


def reanalyse(path: Path) -> int:
    """Floors and tables of a recorded report, recomputed with this script's formulas."""
    from dllm_jax.models.transformer import abstract_params

    report = json.loads(path.read_text())
    tiny = report["model"] == "tiny" or report.get("tiny", False)
    # reports before several models per run name their one model at the top
    legacy = "llada-8b" if report["model"] == "LLaDA-8B" else report["model"]
    costs, engines = {}, {}
    for run in report["runs"]:
        model = run.get("model", legacy)
        if model not in costs:
            config = model_config(model, tiny, report.get("dtype"))
            costs[model], engines[model] = Cost(config), Engine(config, abstract_params(config), backend="xla")
        cost, engine = costs[model], engines[model]
        if run["preset"] == "compare" and "work_per_request" not in run:
            decode = decode_config(run["method"], run["schedule"], run["gen_length"], run["slots"])
            loop = engine.decode_loop(decode, run["prompt_length"])
            run["work_per_request"] = work_per_request(loop, decode, run["prompt_length"], run["steps"] // run["slots"])
        add_floors(run, report["ceilings"], cost)
    report["flop_ratio_checks"] = flop_ratio_checks([r for r in report["runs"] if r["preset"] == "compare"])
    report["reanalysed"] = time.strftime("%Y-%m-%d")
    write_text_atomically(path.with_name(path.stem + "_reanalysed.json"), json.dumps(report, indent=1))
    write_text_atomically(path.with_name(path.stem + "_reanalysed.md"), markdown(report) + "\n")
    print(markdown(report))
    return 0


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.reanalyse is not None:
        return reanalyse(opts.reanalyse)
    started = time.perf_counter()
    first = model_config(opts.model_shape[0], opts.tiny, opts.dtype)
    shapes = Shapes(
        d_model=first.d_model,
        n_heads=first.n_heads,
        n_kv_heads=first.n_kv_heads,
        n_layers=1,
        rows_per_slot=128,
        max_len=128,
        cache_slots=1,
        slot_counts=(),
        key_lengths=(),
        verify_rows=32,
        matmul_size=256 if opts.tiny else 8192,
        copy_elements=2**16 if opts.tiny else 2**28,
        sweep_size=0,
    )
    if opts.layers == "per_layer" and "pallas" in opts.backends:
        raise SystemExit("--backends pallas (fused projection kernel) needs --layers stacked")
    several = len(opts.model_shape) > 1
    costs = {}  # (model, quantization) -> Cost
    report = {
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "mesh": opts.mesh,
        "model": "tiny" if opts.tiny and not several else ", ".join(opts.model_shape),
        "tiny": opts.tiny,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "layers": opts.layers,
        "dtype": first.dtype,
        "ceilings": None,
        "weight_bytes": {m: Cost(model_config(m, opts.tiny, opts.dtype)).weight_bytes for m in opts.model_shape},
        "weight_bytes_by_quantization": {},
        "runs": [],
        "errors": [],
        "flop_ratio_checks": [],
    }
    opts.out.mkdir(parents=True, exist_ok=True)

    def save():
        if report["ceilings"] is not None:
            for run in report["runs"]:
                add_floors(run, report["ceilings"], costs[(run["model"], run.get("quantization", "none"))])
            report["flop_ratio_checks"] = flop_ratio_checks([r for r in report["runs"] if r["preset"] == "compare"])
        write_text_atomically(opts.out / "bench.json", json.dumps(report, indent=1))
        write_text_atomically(opts.out / "bench.md", markdown(report) + "\n")

    for model in opts.model_shape:
        # one model's weights on the device at a time
        config = model_config(model, opts.tiny, opts.dtype)
        init_start = time.perf_counter()
        if opts.layers == "per_layer":
            params = jax.block_until_ready(init_params_per_layer(config, jax.random.key(0)))
        else:
            params = jax.block_until_ready(init_params(config, jax.random.key(0)))
        print(f"{model}: random weights on {jax.devices()[0]} in {time.perf_counter() - init_start:.1f} s", flush=True)
        jobs = []
        weights = {"none": params}
        for quantization in opts.quantizations:
            if quantization not in weights:
                weights[quantization] = jax.block_until_ready(quantize_on_device(params, quantization))
            label = quantization if not several else f"{model} {quantization}"
            report["weight_bytes_by_quantization"][label] = weight_bytes(weights[quantization])
        for quantization, backend in itertools.product(opts.quantizations, opts.backends):
            q_config = dataclasses.replace(config, quantization=quantization)
            cost = costs[(model, quantization)] = Cost(q_config, params_bytes=weight_bytes(weights[quantization]))
            engine = Engine(
                q_config,
                weights[quantization],
                backend=backend,
                interpret=opts.tiny and backend == "pallas",
                full_pass_lanes=(),
                mesh=parse_mesh(opts.mesh) if opts.mesh else None,
                compiler_options=opts.compiler_options,
                batch_invariant=opts.batch_invariant,
            )
            report.setdefault("compiler_options", {})[quantization if not several else f"{model} {quantization}"] = (
                engine.compiler_options
            )
            # the model is part of the backend label, so tables and ratio checks keep the families apart
            backend = (f"{model} " if several else "") + engine.backend + (f" mesh {opts.mesh}" if opts.mesh else "")
            backend += f" {quantization}" if quantization != "none" else ""
            if "steps" in opts.preset:
                for slots in opts.slots:
                    jobs.append(
                        (
                            f"steps {backend} slots={slots}",
                            lambda e=engine, b=backend, s=slots, c=cost: steps_run(
                                e, b, s, opts.gen_lengths[0], opts.prompt_length, c, opts
                            ),
                        )
                    )
            if "compare" in opts.preset:
                for gen in opts.gen_lengths:
                    for slots in opts.compare_slots:
                        for schedule in opts.schedules:
                            for method in opts.methods:
                                jobs.append(
                                    (
                                        f"compare {method} {schedule} {backend} slots={slots} gen={gen}",
                                        lambda e=engine, m=method, sc=schedule, b=backend, s=slots, g=gen, c=cost: (
                                            compare_run(e, m, sc, b, s, g, opts.prompt_length, c)
                                        ),
                                    )
                                )
        for name, job in jobs:
            if opts.budget_s is not None and time.perf_counter() - started > opts.budget_s:
                report["errors"].append({"run": name, "error": "skipped: time budget spent"})
                continue
            t = time.perf_counter()
            try:
                report["runs"].append({"model": model, **job()})
            except Exception as e:  # a failed run is reported, the others still run
                report["errors"].append({"run": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
            save()
        del jobs, engine, params, weights
    # measured last, so that their buffers do not count in the runs' peak memory
    report["ceilings"] = measure_ceilings(shapes, repeats=3 if opts.tiny else opts.ceiling_repeats)
    if "fp8" in opts.quantizations:
        report["ceilings"]["fp8_matmul_flops"] = measure_fp8_matmul(
            shapes.matmul_size, 3 if opts.tiny else opts.ceiling_repeats
        )
    save()
    print(markdown(report))
    return 1 if report["errors"] and not any("skipped" in e["error"] for e in report["errors"]) else 0


if __name__ == "__main__":
    sys.exit(main())
