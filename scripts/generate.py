"""Generate answers with a masked diffusion LM.

  python scripts/generate.py --prompt "What is 12+7?"                     # embedded tiny model
  python scripts/generate.py --model PATH --prompts-file q.jsonl --method flash_cache --verify
  python scripts/generate.py --model PATH --prompt "Hi" --mesh data=2,tensor=4    # 8 devices

--model takes a Hugging Face LLaDA folder or a converted one (python -m convert.hf_to_jax).
--prompts-file: JSONL, one object per line with a "prompt" string. Prints each answer, then
a summary; --output writes one JSON object per request. Bad input: a message and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dllm_jax.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.decode_config import (  # noqa: E402
    ACCEPT_RULES,
    CACHES,
    DREAM_ALGORITHMS,
    METHODS,
    PIN_POLICIES,
    DecodeConfig,
)


def default_model() -> str | None:
    try:
        from dllm_jax.assets import tiny_model_path

        return str(tiny_model_path())
    except (ImportError, FileNotFoundError):
        return None


def resolve_model(name: str) -> tuple[str, bool]:
    """(folder, is an embedded tiny model) of a --model value: a folder, or tiny-llada / tiny-dream."""
    from dllm_jax.assets import EMBEDDED_MODELS, tiny_model_path

    if name in EMBEDDED_MODELS:
        try:
            return str(tiny_model_path(name)), True
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    return name, name == default_model()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=default_model(),
                   help="model folder (LLaDA or Dream), or tiny-llada / tiny-dream (default: the embedded tiny-llada)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    source.add_argument("--prompts-file", type=Path, help='JSONL file, one {"prompt": ...} per line')
    p.add_argument("--method", choices=METHODS, default="flash_cache")
    p.add_argument("--gen-length", type=int, default=None, help="generated positions (default: 64 on the tiny model, else 256)")
    p.add_argument("--block-length", type=int, default=None, help="block (llada, fast_dllm) or window (flash_cache) length")
    p.add_argument("--steps", type=int, default=None, help="llada / fast_dllm schedule: total denoising steps")
    p.add_argument("--threshold", type=float, default=None, help="confidence threshold (default 0.9; llada uses --steps)")
    p.add_argument("--cache", choices=CACHES, default="dual", help="fast_dllm cache")
    p.add_argument("--mask-num", type=int, default=4, help="flash_cache: masked blocks recomputed per step")
    p.add_argument("--track-num", type=int, default=4, help="flash_cache: tracked blocks per step (<0: refresh all)")
    p.add_argument("--verify", action="store_true", help="flash_cache: Flash-Verify")
    p.add_argument("--gamma", type=float, default=0.8, help="verify threshold")
    p.add_argument("--accept", choices=ACCEPT_RULES, default="cumprod", help="verify acceptance rule")
    p.add_argument("--pin", choices=PIN_POLICIES, default="all_commits", help="which commits are refreshed next step")
    p.add_argument("--alg", choices=DREAM_ALGORITHMS, default="entropy", help="dream: which positions to unmask")
    p.add_argument("--alg-temp", type=float, default=0.0, help="dream: positions drawn from softmax(confidence / alg_temp)")
    p.add_argument("--eps", type=float, default=1e-3, help="dream: end of the timestep schedule")
    p.add_argument("--top-p", type=float, default=1.0, help="dream: nucleus filter (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="dream: top-k filter (0 = off)")
    p.add_argument("--batch-size", type=int, default=8, help="slots decoded together")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--backend", choices=("auto", "xla", "pallas"), default="auto")
    p.add_argument("--mesh", help='decode over several devices, e.g. "data=2,tensor=2": slots split over data, '
                   "heads and MLP over tensor; the sizes multiply to the number of devices")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: float32 on the CPU, else bfloat16")
    p.add_argument("--output", type=Path, help="write results as JSONL here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.model is None:
        p.error("--model is required (the embedded tiny model is not installed)")
    return args


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return args.prompt
    path = args.prompts_file
    if not path.is_file():
        raise ValueError(f"{path}: prompts file not found")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{path}:{n}: expected an object with a "prompt" string')
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from dllm_jax.engine import Engine
    from dllm_jax.sharding import parse_mesh

    on_cpu = jax.devices()[0].platform == "cpu"
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    try:
        model, tiny = resolve_model(args.model)
        prompts = read_prompts(args)
        decode = DecodeConfig(
            method=args.method,
            gen_length=args.gen_length if args.gen_length is not None else (64 if tiny else 256),
            block_length=args.block_length,
            steps=args.steps,
            threshold=args.threshold,
            cache=args.cache,
            mask_num=args.mask_num,
            track_num=args.track_num,
            temperature=args.temperature,
            batch_size=args.batch_size,
            seed=args.seed,
            verify=args.verify,
            gamma=args.gamma,
            accept=args.accept,
            pin=args.pin,
            alg=args.alg,
            alg_temp=args.alg_temp,
            eps=args.eps,
            top_p=args.top_p,
            top_k=args.top_k,
        )
        mesh = parse_mesh(args.mesh) if args.mesh else None
        engine = Engine.from_pretrained(model, dtype=dtype, backend=args.backend, mesh=mesh)
        output = engine.generate(prompts, decode, chat=args.chat, progress=not args.no_progress)
    except ValueError as e:  # every input error of dllm_jax is a ValueError with a message
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, result in zip(prompts, output.results):
        print(f"### [{result.index}] {prompt}\n{result.text}\n")
    s = output.stats
    print(
        f"{s.num_requests} requests, {s.num_tokens} tokens in {s.wall_seconds:.2f} s "
        f"({s.tokens_per_second:.1f} tokens/s; compile {s.compile_seconds:.1f} s) | "
        f"{s.tokens_per_step:.2f} tokens/step | {s.steps} steps, {s.forward_passes} forward passes, "
        f"{s.iterations} loop iterations | method={decode.method} backend={engine.backend}"
        + (f" mesh={args.mesh}" if args.mesh else "")
    )
    if args.output:
        records = [
            {"index": r.index, "prompt": p, "text": r.text, "num_tokens": r.num_tokens, "steps": r.steps,
             "forward_passes": r.forward_passes, "verify_passes": r.verify_passes,
             "accepted_drafts": r.accepted_drafts, "seconds": r.seconds}
            for p, r in zip(prompts, output.results)
        ]
        write_text_atomically(args.output, "".join(json.dumps(record) + "\n" for record in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
