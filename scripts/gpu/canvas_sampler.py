"""DiffusionGemma's sample per slot: the inverse-CDF draw against the Gumbel-max one, and its distribution on the device.

    PYTHONPATH=. python scripts/gpu/canvas_sampler.py --out OUT          # H200: about a minute
    PYTHONPATH=. python scripts/gpu/canvas_sampler.py --tiny --out OUT   # CPU smoke

The canvas loop's denoising stage (dllm_jax.runtime.canvas_loop) draws every canvas row's
sample. It was a Gumbel-max draw (one threefry number per row and token, then the argmax of
log-softmax + noise); it is now an inverse-CDF draw (dllm_jax.policies.entropy_bound.sample: one
uniform per row, a two-level cumulative sum). This times both on the same float32 logits [256,
V] (one slot at the 26B-A4B shape; median of --repeats timings of --calls chained calls). The
whole stage, with and without the canvas sampler kernel, is scripts/gpu/canvas_sampler_kernel.py's.

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

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dllm_jax.models.diffusion_gemma_config import diffusion_gemma_26b_a4b_config  # noqa: E402
from dllm_jax.policies import entropy_bound  # noqa: E402


def gumbel_sample(logits: jax.Array, gumbel: jax.Array) -> jax.Array:
    """The former draw: argmax of log-softmax plus Gumbel noise of the logits' shape."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.argmax(logp + gumbel, axis=-1).astype(jnp.int32)


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
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-draws", type=int, default=None, help="default 100000 (tiny: 20000)")
    p.add_argument("--out", type=Path, default=Path("canvas_sampler_out"))
    args = p.parse_args(argv)

    config = diffusion_gemma_26b_a4b_config()
    rows, vocab = config.canvas_length, config.vocab_size
    if args.tiny:
        rows, vocab = 16, 4096
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

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "canvas_sampler.json").write_text(json.dumps(report, indent=1))
    return 0 if report["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
