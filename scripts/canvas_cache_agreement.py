"""Flash-Cache on the canvas against full recomputation: the same requests, the same seeds.

    PYTHONPATH=. python scripts/canvas_cache_agreement.py --model tiny-diffusiongemma --canvas-rows 8 16 24
    PYTHONPATH=. python scripts/canvas_cache_agreement.py --model PATH --problems 64 --out agreement.json

Every held-out problem of the tiny tasks (dllm_jax.evaluation.tiny_tasks; chat-templated when
the tokenizer has a template) is answered by the exact loop (DecodeConfig canvas_rows=None: every
canvas row recomputed every step, read-only) and by a loop per --canvas-rows value (each
denoising step after a canvas's first recomputes that many rows, the others keep their K/V and
last-layer rows); both loops draw the same noise per request. Reported per loop: the share of
answer positions equal to the exact loop's (over the exact answer's length), the share of
answers equal to it, the tasks' accuracy, denoising steps and model passes per request, tokens
per second. The agreement is the measurement; timing on a CPU says little (GPU step times:
scripts/gpu/diffusion_gemma_engine.py --canvas-rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()


def agreement(exact: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of the exact answers' positions where the other answer has the same token, share
    of answers equal as a whole)."""
    positions = sum(len(e) for e in exact)
    same = sum(sum(a == b for a, b in zip(e, o)) for e, o in zip(exact, other))
    return same / max(positions, 1), sum(e == o for e, o in zip(exact, other)) / max(len(exact), 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a DiffusionGemma folder or embedded model name")
    p.add_argument("--canvas-rows", type=int, nargs="+", required=True, help="rows recomputed per step")
    p.add_argument("--problems", type=int, default=32, help="held-out problems")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--canvases", type=int, default=1, help="the generation bucket, in canvases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-denoising-steps", type=int, default=None, help="default: SamplingParams'")
    p.add_argument("--dtype", default=None, help="default: float32 on the CPU, else bfloat16")
    p.add_argument("--out", type=Path, help="write the report as JSON")
    args = p.parse_args(argv)

    from dllm_jax.engine.engine import Engine
    from dllm_jax.evaluation.tiny_tasks import held_out_problems, is_correct
    from dllm_jax.models.loading import resolve_model_path
    from dllm_jax.runtime.decode_config import DecodeConfig
    from dllm_jax.sampling.params import SamplingParams

    engine = Engine.from_pretrained(str(resolve_model_path(args.model)), dtype=args.dtype)
    if engine.config.family != "diffusion_gemma":
        raise SystemExit(f"{args.model}: a {engine.config.family} model; this compares DiffusionGemma loops")
    problems = held_out_problems(args.problems)
    chat = engine.tokenizer is not None and engine.tokenizer.has_chat_template
    prompts = [pr.prompt for pr in problems]
    sampling = (
        SamplingParams()
        if args.max_denoising_steps is None
        else SamplingParams(max_denoising_steps=args.max_denoising_steps)
    )
    length = args.canvases * engine.config.canvas_length
    report = {"model": args.model, "problems": len(problems), "chat": chat, "loops": []}
    exact_ids = None
    for rows in [None, *args.canvas_rows]:
        decode_config = DecodeConfig(
            method="diffusion_gemma", gen_length=length, batch_size=args.batch_size, canvas_rows=rows
        )
        out = engine.generate(prompts, sampling, decode_config=decode_config, chat=chat, seed=args.seed)
        ids = [r.token_ids for r in out.results]
        exact_ids = ids if rows is None else exact_ids
        positions, answers = agreement(exact_ids, ids)
        loop = {
            "canvas_rows": rows,
            "position_agreement": positions,
            "answer_agreement": answers,
            "accuracy": sum(is_correct(pr, r.text or "") for pr, r in zip(problems, out.results)) / len(problems),
            "steps_per_request": out.stats.steps / len(problems),
            "passes_per_request": out.stats.forward_passes / len(problems),
            "tokens_per_s": out.stats.tokens_per_second,
        }
        report["loops"].append(loop)
        print(json.dumps(loop), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
