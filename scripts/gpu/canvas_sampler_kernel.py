"""DiffusionGemma's denoising stage: XLA's path against the canvas sampler kernel, per slot.

    PYTHONPATH=. python scripts/gpu/canvas_sampler_kernel.py --out OUT           # H200: a few minutes
    PYTHONPATH=. python scripts/gpu/canvas_sampler_kernel.py --tiny --out OUT    # CPU smoke (interpret mode)

At the 26B-A4B shape (256 canvas rows per slot, V = 262144, bf16), in one process on the same
inputs (median of --repeats timings of --calls chained calls, ms):

  sampler   the statistics alone on bf16 logits [g * 256, V] (the LM head's output): "xla" =
            canvas_sampler_reference (today's math as XLA compiles it: the soft-cap's float32
            copy, argmax, entropy, the inverse-CDF sample, the finite check, the softmax in
            bf16), "kernel" = canvas_sampler, each block-size variant of --variants;
  stage     the canvas loop's whole denoising stage for g slots (CanvasLoop._denoise: the LM
            head, the statistics, the policy's step, the soft embeddings' GEMM), with
            Kernels() and with Kernels(canvas_sampler=True);
and how well they agree: argmax, sample and finite equal (fraction of rows), entropy (largest
absolute and relative difference), probs (the fraction of equal entries, the largest relative
difference where the reference's probability exceeds 1e-6, and the largest absolute one); for
the stage, the next canvas's tokens equal and the soft embeddings' relative L2 difference.
Expect the sampler's argmax and sample to agree on all but a few rows in a thousand (Triton's
tanh, division and exp and XLA's differ in the last bits, which moves near-ties and draws within
rounding of a token boundary). probs: the code rounds the processed logits to bf16 before the
softmax (as transformers' bf16 model does), the kernel too, but XLA drops that float32 -> bf16 ->
float32 round trip (xla_allow_excess_precision), so against the "xla" reference most probs
differ, by up to a factor exp(one bf16 unit of the logit) (13% at |p| in [16, 32));
"vs_rounded_softmax" compares them with the softmax rounded as written (lax.reduce_precision,
which XLA keeps): there expect most probs equal and the others a unit or two of bf16 apart (an
entry whose float32 logit differs in its last bit can still round the other way).
The soft embeddings' relative L2 difference says whether any of it matters.

--ablations (a study of where the kernel's time goes, not a result to use): the default kernel
again with one part of its per-element math replaced by a cheaper one, by swapping the module's
function for the trace (its outputs then differ; only the time is reported):
  no-tanh      the soft-cap left out (the logits as float32)
  exp-tanh     cap * tanh(x / cap) as cap - 2 cap / (exp(2 x / cap) + 1)
  no-rounding  the processed logits not rounded to bf16 before the softmax's exp
  cvt-rounding the rounding as a conversion to bf16 and back (the GPU's cvt.rn) instead of
               the kernel's integer operations on the bits (equal results on the GPU)
  times-1/T    the processed logits as capped * (1 / T) instead of capped / T
  all          no-tanh, no-rounding and times-1/T together
beside "read", XLA's row max of the logits (one read of [R, V] bf16, the pass's memory floor).

Writes canvas_sampler_kernel.json and .md in --out (after every case, so a run cut short keeps
what it measured); a case that fails is recorded with its error; no new case starts after
--budget-s seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.sampling.canvas_sampler as sampler_module  # noqa: E402
from dllm_jax.models.diffusion_gemma_config import diffusion_gemma_26b_a4b_config  # noqa: E402
from dllm_jax.policies.canvas import CanvasPolicy  # noqa: E402
from dllm_jax.runtime.canvas_loop import CanvasLoop  # noqa: E402
from dllm_jax.runtime.canvas_slots import DENOISE, empty_canvas_slots  # noqa: E402
from dllm_jax.runtime.kernel_routing import Kernels  # noqa: E402
from dllm_jax.runtime.slots import zero_sampling  # noqa: E402
from pallas_kernels.sampling.canvas_sampler import (  # noqa: E402
    SamplerBlockSizes,
    canvas_sampler,
    canvas_sampler_reference,
    default_sampler_block_sizes,
)
from pallas_kernels.sampling.inverse_cdf import soft_cap  # noqa: E402
from scripts.gpu.canvas_sampler import timed  # noqa: E402

# block-size variants timed besides the default: (block_v, num_splits, num_warps, num_stages;
# None: the default's splits). 512 = one inverse-CDF block per chunk, whose block sum needs no
# [block_v] -> [block_v / 512, 512] reshape in the kernel.
VARIANTS = ((2048, None, 4, 2), (8192, None, 8, 2), (4096, 1, 8, 3), (4096, 4, 8, 2), (512, None, 4, 3))


def denoise_slots(group: int, rows: int, d_model: int):
    """`group` slots denoising step 3 of 16 of their first canvas."""
    slots = empty_canvas_slots(group, 2 * rows, rows, 1, d_model, jnp.bfloat16)
    sampling = zero_sampling((group,)).replace(
        t_min=jnp.full((group,), 0.4, jnp.float32),
        t_span=jnp.full((group,), 0.4, jnp.float32),
        max_denoising_steps=jnp.full((group,), 16, jnp.int32),
        entropy_bound=jnp.full((group,), 0.1, jnp.float32),
        stability_threshold=jnp.ones((group,), jnp.int32),
        confidence_threshold=jnp.full((group,), 0.005, jnp.float32),
        seed=jnp.arange(group, dtype=jnp.int32),
    )
    return slots.replace(
        active=jnp.ones((group,), bool),
        phase=jnp.full((group,), DENOISE, jnp.int32),
        denoise_step=jnp.full((group,), 3, jnp.int32),
        gen_end=jnp.full((group,), 2 * rows, jnp.int32),
        sampling=sampling,
    )


def sampler_inputs(rows: int, vocab: int, seed: int = 0):
    """bf16 logits [rows, V] like an LM head's (normal, scale 4, a few peaked rows), per-row
    temperatures of a 16-step schedule between 0.4 and 0.8, uniforms."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    logits = jax.random.normal(k1, (rows, vocab), jnp.float32) * 4.0
    # every 8th row peaked on one token (a confident canvas position)
    peak = jnp.arange(rows) % 8 == 0
    logits = jnp.where(peak[:, None] & (jnp.arange(vocab) == 17 * jnp.arange(rows)[:, None] % vocab), 40.0, logits)
    temperature = 0.4 + 0.4 * jax.random.randint(k2, (rows,), 1, 17).astype(jnp.float32) / 16
    uniform = jax.random.uniform(k3, (rows,), jnp.float32)
    return logits.astype(jnp.bfloat16), temperature, uniform


def rounded_softmax(logits: jax.Array, temperature: jax.Array, softcap: float) -> jax.Array:
    """The self-conditioning probs as the code writes them: softmax of the processed logits
    rounded to the logits' dtype, the rounding by lax.reduce_precision, which XLA keeps (it
    drops an astype round trip: xla_allow_excess_precision)."""
    processed = soft_cap(logits, softcap) / temperature[:, None]
    info = jnp.finfo(logits.dtype)
    rounded = jax.lax.reduce_precision(processed, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return jax.nn.softmax(rounded, axis=-1).astype(logits.dtype)


def agreement(got, want) -> dict:
    """How the kernel's statistics agree with the reference's (see the module doc)."""
    got, want = jax.device_get(got), jax.device_get(want)
    probs, expected = np.asarray(got.probs, np.float64), np.asarray(want.probs, np.float64)
    seen = expected > 1e-6
    entropy, entropy_ref = np.asarray(got.entropy, np.float64), np.asarray(want.entropy, np.float64)
    return {
        "argmax_equal": float(np.mean(got.argmax == want.argmax)),
        "sample_equal": float(np.mean(got.sample == want.sample)),
        "finite_equal": float(np.mean(got.finite == want.finite)),
        "entropy_max_abs": float(np.max(np.abs(entropy - entropy_ref))),
        "entropy_max_rel": float(np.max(np.abs(entropy - entropy_ref) / np.maximum(np.abs(entropy_ref), 1e-6))),
        "probs_equal": float(np.mean(probs == expected)),
        "probs_max_rel_above_1e-6": float(np.max(np.abs(probs - expected)[seen] / expected[seen])),
        "probs_max_abs": float(np.max(np.abs(probs - expected))),
    }


def sampler_case(group: int, rows: int, vocab: int, args, interpret: bool) -> dict:
    """The statistics alone for `group` slots: XLA, the kernel's default and its variants."""
    logits, temperature, uniform = sampler_inputs(group * rows, vocab)
    softcap = 30.0
    out = {"case": "sampler", "group": group, "rows": group * rows, "vocab": vocab}
    reference = jax.jit(lambda x, t, u: canvas_sampler_reference(x, t, u, softcap=softcap))
    out["xla_ms"] = timed(reference, (logits, temperature, uniform), args.calls, args.repeats)
    want = reference(logits, temperature, uniform)
    probs_as_written = jax.jit(lambda x, t: rounded_softmax(x, t, softcap))(logits, temperature)
    default = default_sampler_block_sizes(group * rows, vocab)
    variants = [default]
    if not args.tiny:
        for block_v, splits, warps, stages in VARIANTS:
            chunks = -(-vocab // block_v)
            splits = splits or default.num_splits
            if chunks % splits == 0:
                variants.append(SamplerBlockSizes(block_v, splits, warps, stages))
    out["kernel"] = []
    for blocks in variants:
        row = {"block_sizes": dataclasses.asdict(blocks), "default": blocks == default}
        try:
            kernel = jax.jit(
                lambda x, t, u, blocks=blocks: canvas_sampler(
                    x, t, u, softcap=softcap, interpret=interpret, block_sizes=blocks
                )
            )
            row["ms"] = timed(kernel, (logits, temperature, uniform), args.calls, args.repeats)
            row["speedup"] = out["xla_ms"] / row["ms"]
            got = kernel(logits, temperature, uniform)
            row.update(agreement(got, want))
            row["vs_rounded_softmax"] = agreement(got, want._replace(probs=probs_as_written))
        except Exception as e:  # noqa: BLE001 (a failing variant is reported)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["kernel"].append(row)
        print(json.dumps(row), flush=True)
    out["xla_ms_per_slot"] = out["xla_ms"] / group
    return out


def _exp_tanh(logits: jax.Array, cap: float) -> jax.Array:
    cap = jnp.float32(cap)
    return cap - 2 * cap / (jnp.exp(2 * logits.astype(jnp.float32) / cap) + 1)


def _times_reciprocal(logits_ref, temperature, row, start, *, vocab: int, softcap: float, block_v: int):
    valid = start + jnp.arange(block_v, dtype=jnp.int32) < vocab
    x = sampler_module.plgpu.load(logits_ref.at[row, sampler_module.pl.ds(start, block_v)], mask=valid, other=0)
    capped = sampler_module.soft_cap(x, softcap)
    return capped, jnp.where(valid, capped * (1 / temperature), -jnp.inf), valid


# name -> the module attributes swapped for the trace
ABLATIONS = {
    "no-tanh": {"soft_cap": lambda x, cap: x.astype(jnp.float32)},
    "exp-tanh": {"soft_cap": _exp_tanh},
    "no-rounding": {"_rounded": lambda x, dtype: x},
    "times-1/T": {"_load_processed": _times_reciprocal},
    "cvt-rounding": {"_rounded": lambda x, dtype: x.astype(dtype).astype(jnp.float32)},
}
ABLATIONS["all"] = {
    "soft_cap": lambda x, cap: x.astype(jnp.float32),
    "_rounded": lambda x, dtype: x,
    "_load_processed": _times_reciprocal,
}


def ablation_case(group: int, rows: int, vocab: int, args, interpret: bool) -> dict:
    """The default kernel with each of ABLATIONS swapped in (see the module doc), and one read."""
    logits, temperature, uniform = sampler_inputs(group * rows, vocab)
    out = {"case": "ablation", "group": group, "rows": group * rows}
    out["read_ms"] = timed(
        jax.jit(lambda x: jnp.max(x.astype(jnp.float32), axis=1)), (logits,), args.calls, args.repeats
    )
    for name, swaps in (("default", {}), *ABLATIONS.items()):
        saved = {attr: getattr(sampler_module, attr) for attr in swaps}
        try:
            for attr, fn in swaps.items():
                setattr(sampler_module, attr, fn)
            jax.clear_caches()
            kernel = jax.jit(lambda x, t, u: sampler_module.canvas_sampler(x, t, u, softcap=30.0, interpret=interpret))
            out[f"{name}_ms"] = timed(kernel, (logits, temperature, uniform), args.calls, args.repeats)
        except Exception as e:  # noqa: BLE001 (a failing ablation is reported)
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            for attr, fn in saved.items():
                setattr(sampler_module, attr, fn)
            jax.clear_caches()
    return out


def stage_case(group: int, config, args, interpret: bool) -> dict:
    """CanvasLoop._denoise for `group` slots, with and without the kernel."""
    rows, vocab, d_model = config.canvas_length, config.vocab_size, config.d_model
    embed = (jax.random.normal(jax.random.key(5), (vocab, d_model), jnp.float32) * 0.02).astype(config.jnp_dtype)
    weights = {"embed_tokens": {"embedding": embed}, "norm": {"weight": jnp.ones((d_model,), config.jnp_dtype)}}
    policy = CanvasPolicy(canvas_length=rows, vocab_size=vocab, max_stability=1, eos_ids=(1,), pad_id=0)
    slots = denoise_slots(group, rows, d_model)
    hidden = jax.random.normal(jax.random.key(6), (group, rows, d_model), jnp.float32).astype(config.jnp_dtype)
    out = {"case": "stage", "group": group}
    results = {}
    for name, kernels in (("xla", Kernels()), ("kernel", Kernels(canvas_sampler=True, interpret=interpret))):
        loop = CanvasLoop(
            model=config, policy=policy, num_slots=group, max_len=2 * rows, gen_length=rows, kernels=kernels
        )
        run = jax.jit(loop._denoise)
        out[f"{name}_ms"] = timed(run, (weights, slots, hidden), args.calls, args.repeats)
        out[f"{name}_ms_per_slot"] = out[f"{name}_ms"] / group
        out["sampler_slots"] = loop.sampler_slots
        results[name] = jax.device_get(run(weights, slots, hidden))
    out["speedup"] = out["xla_ms"] / out["kernel_ms"]
    (xla_slots, xla_finite), (kernel_slots, kernel_finite) = results["xla"], results["kernel"]
    out["noisy_equal"] = float(np.mean(xla_slots.noisy == kernel_slots.noisy))
    out["argmax_equal"] = float(np.mean(xla_slots.history[:, -1] == kernel_slots.history[:, -1]))
    soft, soft_ref = (np.asarray(s.soft, np.float64) for s in (kernel_slots, xla_slots))
    out["soft_rel_l2"] = float(np.linalg.norm(soft - soft_ref) / max(np.linalg.norm(soft_ref), 1e-30))
    out["finite_equal"] = bool(np.all(xla_finite == kernel_finite))
    return out


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "canvas_sampler_kernel.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"# Canvas sampler kernel ({report['device']}, jax {report['jax']}, V={report['vocab']})",
        "",
        "| case | slots | xla ms/slot | kernel ms/slot | speedup | argmax eq | sample/noisy eq | other |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in report["cases"]:
        if "error" in case:
            lines.append(f"| {case['case']} | {case.get('group')} | error: {case['error'][:120]} | | | | | |")
        elif case["case"] == "ablation":
            times = ", ".join(f"{k[:-3]} {v:.3f}" for k, v in case.items() if k.endswith("_ms"))
            lines.append(f"| ablation (ms per call) | {case['group']} | {times} | | | | | |")
        elif case["case"] == "sampler":
            for row in case["kernel"]:
                blocks = row["block_sizes"]
                label = (
                    f"bv {blocks['block_v']} s {blocks['num_splits']} w {blocks['num_warps']} st {blocks['num_stages']}"
                )
                label += " (default)" if row["default"] else ""
                if "error" in row:
                    lines.append(f"| sampler {label} | {case['group']} | | error: {row['error'][:120]} | | | | |")
                    continue
                exact = row["vs_rounded_softmax"]
                other = f"entropy abs {row['entropy_max_abs']:.2e}, probs equal {row['probs_equal']:.4f}"
                other += (
                    f" (rounded as written {exact['probs_equal']:.4f}, rel {exact['probs_max_rel_above_1e-6']:.2e})"
                )
                lines.append(
                    f"| sampler {label} | {case['group']} | {case['xla_ms_per_slot']:.3f} | "
                    f"{row['ms'] / case['group']:.3f} | {row['speedup']:.2f} | {row['argmax_equal']:.4f} | "
                    f"{row['sample_equal']:.4f} | {other} |"
                )
        else:
            lines.append(
                f"| stage | {case['group']} | {case['xla_ms_per_slot']:.3f} | {case['kernel_ms_per_slot']:.3f} | "
                f"{case['speedup']:.2f} | {case['argmax_equal']:.4f} | {case['noisy_equal']:.4f} | "
                f"soft rel L2 {case['soft_rel_l2']:.2e}, finite equal {case['finite_equal']} |"
            )
    (out / "canvas_sampler_kernel.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes, the kernel in interpret mode (a CPU smoke)")
    p.add_argument("--groups", type=int, nargs="+", default=None, help="slots per call (default 1 2 4; tiny: 1 2)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ablations", action="store_true", help="time the kernel's parts (see the module doc) only")
    p.add_argument("--budget-s", type=float, default=600.0, help="no new case starts after this many seconds")
    p.add_argument("--out", type=Path, default=Path("canvas_sampler_kernel_out"))
    args = p.parse_args(argv)
    start = time.time()

    config = diffusion_gemma_26b_a4b_config("bfloat16")
    if args.tiny:
        config = dataclasses.replace(config, vocab_size=4096, d_model=64, canvas_length=16, image_token_id=None)
        args.calls, args.repeats = min(args.calls, 2), min(args.repeats, 2)
    groups = args.groups or ([1, 2] if args.tiny else [1, 2, 4])
    interpret = jax.devices()[0].platform != "gpu"
    report = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "rows_per_slot": config.canvas_length,
        "vocab": config.vocab_size,
        "interpret": interpret,
        "cases": [],
    }
    cases = [("sampler", g) for g in groups] + [("stage", g) for g in groups]
    if args.ablations:
        cases = [("ablation", g) for g in groups]
    for kind, group in cases:
        if time.time() - start > args.budget_s:
            report["cases"].append({"case": kind, "group": group, "error": "skipped: --budget-s spent"})
            continue
        try:
            if kind == "ablation":
                case = ablation_case(group, config.canvas_length, config.vocab_size, args, interpret)
            elif kind == "sampler":
                case = sampler_case(group, config.canvas_length, config.vocab_size, args, interpret)
            else:
                case = stage_case(group, config, args, interpret)
        except Exception as e:  # noqa: BLE001 (a failing case is reported, the others still run)
            case = {"case": kind, "group": group, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        report["cases"].append(case)
        print(json.dumps({k: v for k, v in case.items() if k != "kernel"}), flush=True)
        write_report(report, args.out)
    report["wall_s"] = time.time() - start
    write_report(report, args.out)
    print((args.out / "canvas_sampler_kernel.md").read_text())
    return 0 if not any("error" in c for c in report["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
