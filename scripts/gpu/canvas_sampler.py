"""DiffusionGemma's denoising stage per slot: the inverse-CDF sample against the Gumbel-max one.

    PYTHONPATH=. python scripts/gpu/canvas_sampler.py --out OUT          # H200: about a minute
    PYTHONPATH=. python scripts/gpu/canvas_sampler.py --tiny --out OUT   # CPU smoke

The canvas loop's denoising stage (dllm_jax.runtime.canvas_loop: the tied LM head, the
entropy-bound step of every canvas row, the self-conditioning softmax times the embedding
table) runs per group of slots (one slot at the 26B-A4B shape: 256 rows x 262144 tokens). Its
sample was a Gumbel-max draw (one threefry number per row and token, then the argmax of
log-softmax + noise); it is now an inverse-CDF draw (dllm_jax.policies.entropy_bound.sample: one
uniform per row, a two-level cumulative sum). This times, in one process on the same inputs
(median of --repeats timings of --calls chained calls):

  sample    the draw alone on float32 logits [rows, V]: "gumbel" and "inverse-cdf";
  stage     the whole stage for one group (final_logits, the policy's denoise, soft_embeddings)
            with either draw (the Gumbel variant swaps the policy's sample and noise for the old
            ones), ms per group and per slot.

It also checks the inverse-CDF draw against the exact distribution on the device: a chi-square
of --check-draws draws of one row of 4096 random logits over its 64 most likely tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dllm_jax.models import diffusion_gemma as dg  # noqa: E402
from dllm_jax.models.diffusion_gemma_config import diffusion_gemma_26b_a4b_config  # noqa: E402
from dllm_jax.policies import canvas as canvas_policy  # noqa: E402
from dllm_jax.policies import entropy_bound  # noqa: E402
from dllm_jax.policies.canvas import CanvasPolicy  # noqa: E402
from dllm_jax.runtime.canvas_slots import DENOISE, empty_canvas_slots  # noqa: E402
from dllm_jax.runtime.slots import SlotSampling, zero_sampling  # noqa: E402


def gumbel_sample(logits: jax.Array, gumbel: jax.Array) -> jax.Array:
    """The former draw: argmax of log-softmax plus Gumbel noise of the logits' shape."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.argmax(logp + gumbel, axis=-1).astype(jnp.int32)


def gumbel_step_noise(key, step, batch: int, length: int, vocab_size: int):
    """The former noise: float32 [B, L, V] Gumbel noise and the renoising tokens."""
    sample_key, renoise_key = jax.random.split(jax.random.fold_in(key, step + 1))
    gumbel = jax.random.gumbel(sample_key, (batch, length, vocab_size), jnp.float32)
    return gumbel, jax.random.randint(renoise_key, (batch, length), 0, vocab_size, jnp.int32)


def timed(fn, args, calls: int, repeats: int) -> float:
    """Median ms per call of `calls` chained asynchronous calls."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(times)


def denoise_slots(group: int, rows: int, d_model: int) -> object:
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
    assert isinstance(sampling, SlotSampling)
    return slots.replace(
        active=jnp.ones((group,), bool),
        phase=jnp.full((group,), DENOISE, jnp.int32),
        denoise_step=jnp.full((group,), 3, jnp.int32),
        gen_end=jnp.full((group,), 2 * rows, jnp.int32),
        sampling=sampling,
    )


def stage(config, policy: CanvasPolicy):
    """The canvas loop's denoising stage for one group (as CanvasLoop._denoise's `group`)."""

    def run(weights, slots, hidden):
        logits = dg.final_logits(config, weights, hidden)
        finite = jnp.all(jnp.isfinite(logits), axis=(1, 2))
        stepped, processed = jax.vmap(policy.denoise)(slots, logits)
        soft = dg.soft_embeddings(config, weights, processed.astype(config.jnp_dtype))
        return stepped.noisy, soft, finite

    return jax.jit(run)


CHECK_VOCAB = 4096  # the draws' logits are broadcast: draws x 4096 floats


def check_distribution(draws: int, vocab: int) -> dict:
    """Chi-square of inverse-CDF draws of one row against its softmax, over its 64 likeliest
    tokens and the rest pooled (65 cells, 64 degrees of freedom)."""
    logits = jax.random.normal(jax.random.key(0), (vocab,), jnp.float32) * 3.0
    uniform = jax.random.uniform(jax.random.key(1), (draws,), jnp.float32)
    drawn = jax.jit(entropy_bound.sample)(jnp.broadcast_to(logits, (draws, vocab)), uniform)
    probs = np.asarray(jax.nn.softmax(logits), np.float64)
    top = np.argsort(-probs)[:64]
    counts = np.bincount(np.asarray(drawn), minlength=vocab)
    observed = np.append(counts[top], draws - counts[top].sum())
    expected = draws * np.append(probs[top], 1.0 - probs[top].sum())
    chi2 = float(np.sum((observed - expected) ** 2 / expected))
    # 64 degrees of freedom: mean 64, standard deviation 11.3
    return {"draws": draws, "chi2": chi2, "dof": 64, "ok": chi2 < 64 + 5 * 11.3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke)")
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2], help="slots per group timed")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-draws", type=int, default=None, help="default 100000 (tiny: 20000)")
    p.add_argument("--out", type=Path, default=Path("canvas_sampler_out"))
    args = p.parse_args(argv)

    config = diffusion_gemma_26b_a4b_config()
    rows, vocab, d_model = config.canvas_length, config.vocab_size, config.d_model
    if args.tiny:
        rows, vocab, d_model = 16, 4096, 64
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows, "vocab": vocab}
    report["check"] = check_distribution(args.check_draws or (20_000 if args.tiny else 100_000), CHECK_VOCAB)
    print(json.dumps(report["check"]), flush=True)

    logits = jax.random.normal(jax.random.key(2), (rows, vocab), jnp.float32) * 4.0
    uniform = jax.random.uniform(jax.random.key(3), (rows,), jnp.float32)
    report["sample_ms"] = {
        "gumbel (noise drawn in the call)": timed(
            jax.jit(lambda x, k: gumbel_sample(x, jax.random.gumbel(k, x.shape, jnp.float32))),
            (logits, jax.random.key(4)),
            args.calls,
            args.repeats,
        ),
        "inverse-cdf": timed(jax.jit(entropy_bound.sample), (logits, uniform), args.calls, args.repeats),
    }
    print(json.dumps(report["sample_ms"]), flush=True)

    embed = (jax.random.normal(jax.random.key(5), (vocab, d_model), jnp.float32) * 0.02).astype(jnp.bfloat16)
    weights = {"embed_tokens": {"embedding": embed}, "norm": {"weight": jnp.ones((d_model,), jnp.bfloat16)}}
    tiny_config = config if not args.tiny else _tiny_config(config, vocab, d_model, rows)
    policy = CanvasPolicy(canvas_length=rows, vocab_size=vocab, max_stability=1, eos_ids=(1,), pad_id=0)
    report["stage_ms"] = []
    for group in args.groups:
        slots = denoise_slots(group, rows, d_model)
        hidden = jax.random.normal(jax.random.key(6), (group, rows, d_model), jnp.float32).astype(jnp.bfloat16)
        row = {"group": group}
        for name in ("inverse-cdf", "gumbel"):
            if name == "gumbel":
                swapped = canvas_policy.sample, canvas_policy.step_noise
                canvas_policy.sample, canvas_policy.step_noise = gumbel_sample, gumbel_step_noise
            try:
                row[name] = timed(stage(tiny_config, policy), (weights, slots, hidden), args.calls, args.repeats)
            finally:
                if name == "gumbel":
                    canvas_policy.sample, canvas_policy.step_noise = swapped
        row["inverse-cdf per slot"] = row["inverse-cdf"] / group
        row["gumbel per slot"] = row["gumbel"] / group
        row["ratio"] = row["inverse-cdf"] / row["gumbel"]
        report["stage_ms"].append(row)
        print(json.dumps(row), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "canvas_sampler.json").write_text(json.dumps(report, indent=1))
    return 0 if report["check"]["ok"] else 1


def _tiny_config(config, vocab: int, d_model: int, rows: int):
    import dataclasses

    return dataclasses.replace(
        config, vocab_size=vocab, d_model=d_model, canvas_length=rows, image_token_id=None, dtype="float32"
    )


if __name__ == "__main__":
    sys.exit(main())
