"""Does a request's result depend on the batch it runs in? Where does the batch leak in?

    PYTHONPATH=. python scripts/batch_invariance.py --smoke                   # CPU, tiny sizes
    PYTHONPATH=. python scripts/batch_invariance.py --what leak --others 7 31        # GPU: LLaDA-8B widths
    PYTHONPATH=. python scripts/batch_invariance.py --what problems --problems 240   # embedded tiny model
    add --batch-invariant for the engine's batch-invariant mode (sets XLA's deterministic flags)

``leak``: one request decoded alone (1 slot) and the same request among N others (N + 1
slots, the request in the middle slot), through the engine's real decode step (same backend,
same dtype). Per step it reports (a) whether the request's committed tokens after the step
and the logits of its candidate rows are bit-identical, and (b) the first op, in execution
order, where the request's rows differ: the embeddings, then per layer the pre-attention
norm, the q/k/v projections, q/k/v after RoPE, the attention output (and its tracking
scores), the attention's output projection, the MLP norm, gate, up and down projections and
the residual, then the logits (a debug pass of the same model code that also returns these
intermediates: cached_forward(taps=True)). It also compares the answers of Engine.generate.
The model is the embedded tiny one (--model-shape tiny) or random weights at a bench.py
shape (--model-shape llada-8b, --layers N keeps the widths and the first N layers: the
GEMM shapes, which decide the leaks, stay those of LLaDA-8B).

``problems``: the embedded tiny model's held-out problems decoded at several batch sizes per
method; counts the answers identical to batch 1's.

Writes batch_invariance.json and batch_invariance.md to --out (default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

# XLA reads its flags once, when the backend starts: the deterministic ones go in first.
if "--batch-invariant" in sys.argv:
    from dllm_jax.runtime.batch_invariance import deterministic_xla_flags  # noqa: E402 (imports no JAX backend)

    os.environ["XLA_FLAGS"] = deterministic_xla_flags()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.engine.compiled_loop import CompiledLoop  # noqa: E402
from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.evaluation import tiny_tasks  # noqa: E402
from dllm_jax.models.transformer import init_params  # noqa: E402
from dllm_jax.runtime.batch_invariance import LAYER_TAP_ORDER  # noqa: E402
from dllm_jax.runtime.decode_config import DecodeConfig  # noqa: E402

METHODS = ("llada", "fast_dllm", "flash_cache", "flash_verify")


def method_config(method: str, gen_length: int, batch_size: int) -> DecodeConfig:
    """The issue's settings: LLaDA one token per step (block 32), Fast-dLLM dual cache and
    Flash-Cache at threshold 0.9, Flash-Verify (gamma 0.8) on top of Flash-Cache."""
    common = dict(gen_length=gen_length, batch_size=batch_size)
    if method == "llada":
        return DecodeConfig(method="llada", block_length=32, steps=gen_length, **common)
    if method == "fast_dllm":
        return DecodeConfig(method="fast_dllm", cache="dual", block_length=32, **common)  # threshold 0.9: the default
    return DecodeConfig(method="flash_cache", mask_num=4, track_num=4, verify=method == "flash_verify", **common)


# ------------------------------------------------------------------------------ leak report


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """Bitwise comparison of two arrays of one shape: identical, elements that differ, the
    largest absolute difference and its size relative to the largest |a|."""
    same = _bits(a) == _bits(b)
    if same.all():
        return {"identical": True}
    a32, b32 = a.astype(np.float64), b.astype(np.float64)
    diff = float(np.nanmax(np.abs(a32 - b32)))
    scale = float(np.nanmax(np.abs(a32))) or 1.0
    return {
        "identical": False,
        "differing": int((~same).sum()),
        "of": int(same.size),
        "max_abs": diff,
        "max_rel": diff / scale,
    }


# jitted step and tap functions by (kind, loop, ...): the lone request's loop is the same for
# every N, so it compiles once
_JITS: dict = {}


def _jitted(key, make):
    if key not in _JITS:
        _JITS[key] = make()
    return _JITS[key]


class Run:
    """One decode (the request alone or among others) driven step by step.

    The request sits at slot `slot`; `taps(state)` returns its rows' intermediates of the pass
    the engine's next step runs for it, `step(state)` is the engine's real step."""

    def __init__(self, engine: Engine, decode: DecodeConfig, prompts: list[list[int]], slot: int):
        self.slot = slot
        longest = max(map(len, prompts))
        self.loop = loop = engine.decode_loop(decode, longest, len(prompts))
        self.weights = engine.weights
        # the engine's own request ring and initial state, without compiling the whole loop
        width = max(16, 1 << (longest - 1).bit_length())
        ring = CompiledLoop(
            loop,
            decode,
            max(16, 4 * len(prompts)),
            width,
            init=jax.jit(loop.init_state),
            call=None,
            packings=None,
            compile_seconds=0.0,
        )
        self.state = ring.initial_state(prompts)
        self.step = _jitted(("step", loop), lambda: jax.jit(loop._step))

    def _taps_fn(self, full: bool, lanes: int):
        key = ("taps", self.loop, self.slot, full, lanes)
        if key not in _JITS:
            loop, slot = self.loop, self.slot

            def run(params, state):
                slots = state.slots
                if full:
                    run_full = slots.active & slots.needs_full
                    *_, taps = loop._full_pass(params, slots, state.cache, run_full, lanes, taps=True)
                    group = jnp.argmax(taps.pop("group_slot") == slot)
                    rows = jnp.arange(loop.max_len) < slots.key_len[slot]
                else:
                    run_sparse = slots.active & ~slots.needs_full
                    *_, taps = loop._sparse_pass(params, slots, state.cache, run_sparse, taps=True)
                    group = slot
                    rows = jax.vmap(loop.policy.sparse_rows)(slots)[1][slot]
                candidates = jax.vmap(loop.policy.candidates)(slots)[1][slot]
                return {
                    "embed": taps["embed"][group],
                    "layers": {name: value[:, group] for name, value in taps["layers"].items()},
                    "logits": taps["logits"][group],
                    "rows": rows,
                    "candidates": candidates,
                }

            _JITS[key] = jax.jit(run)
        return _JITS[key]

    def taps(self) -> dict:
        slots = jax.device_get(self.state.slots)
        full = bool(slots.needs_full[self.slot])
        lanes = 0
        if full:
            n_full = int(np.sum(slots.active & slots.needs_full))
            lanes = next(n for n in self.loop.lane_sizes if n >= n_full)
        return jax.device_get(self._taps_fn(full, lanes)(self.weights, self.state)) | {
            "full_pass": full,
            "lanes": lanes,
        }

    def advance(self) -> None:
        self.state = self.step(self.weights, self.state)

    def slot_tokens(self) -> np.ndarray:
        return np.asarray(self.state.slots.tokens[self.slot])

    def done(self) -> bool:
        return not bool(self.state.slots.active[self.slot])


def first_difference(alone: dict, among: dict) -> dict | None:
    """The first op (in execution order) whose values on the request's rows differ."""
    rows = alone["rows"] & among["rows"]
    order = [("embed", None, alone["embed"], among["embed"])]
    n_layers = next(iter(alone["layers"].values())).shape[0]
    for layer in range(n_layers):
        for name in LAYER_TAP_ORDER:
            if name in alone["layers"]:
                order.append((name, layer, alone["layers"][name][layer], among["layers"][name][layer]))
    order.append(("logits", None, alone["logits"], among["logits"]))
    for name, layer, a, b in order:
        if name == "attention_scores":
            pass  # [max_len]: the score of every key of the slot
        elif name == "logits":
            ok = alone["candidates"] & among["candidates"]
            a, b = a[ok], b[ok]
        else:
            a, b = a[rows], b[rows]
        c = compare(a, b)
        if not c["identical"]:
            return {"op": name, "layer": layer, **c}
    return None


def leak_report(engine: Engine, decode: DecodeConfig, request: list[int], others: list[list[int]], steps: int) -> dict:
    """Request alone vs among `others` for up to `steps` engine steps (see module docstring)."""
    slot = len(others) // 2
    alone = Run(engine, decode, [request], 0)
    among = Run(engine, decode, others[:slot] + [request] + others[slot:], slot)
    per_step = []
    for t in range(steps):
        ta, tb = alone.taps(), among.taps()
        ok = ta["candidates"] & tb["candidates"]
        logits = compare(ta["logits"][ok], tb["logits"][ok])
        first = first_difference(ta, tb)
        alone.advance()
        among.advance()
        same_tokens = bool(np.array_equal(alone.slot_tokens(), among.slot_tokens()))
        per_step.append(
            {
                "step": t,
                "pass": "full" if ta["full_pass"] else "sparse",
                "lanes_alone": ta["lanes"],
                "lanes_among": tb["lanes"],
                "logits_identical": logits["identical"],
                "logits": logits,
                "committed_identical": same_tokens,
                "first_difference": first,
                # for run-to-run comparisons (the same command in another process must give the same digests)
                "sha256": {
                    "logits_alone": _digest(ta["logits"]),
                    "logits_among": _digest(tb["logits"]),
                    "tokens_among": _digest(among.slot_tokens()),
                },
            }
        )
        if not same_tokens or alone.done() or among.done():
            break
    return {"slots_alone": 1, "slots_among": len(others) + 1, "slot": slot, "steps": per_step}


def answers_identical(engine: Engine, decode: DecodeConfig, request: list[int], others: list[list[int]]) -> bool:
    """Engine.generate's answer of the request alone vs among the others (N + 1 slots)."""
    slot = len(others) // 2
    alone = engine.generate([request], decode_config=decode).results[0].token_ids
    together = engine.generate(
        others[:slot] + [request] + others[slot:], decode_config=dataclasses.replace(decode, batch_size=len(others) + 1)
    )
    return alone == together.results[slot].token_ids


def run_leak(args, engine: Engine, out: dict, save) -> None:
    """Fills out["method/among N"] one comparison at a time (save() after each)."""
    rng = np.random.RandomState(args.seed)
    if engine.tokenizer is not None:  # the tiny model: its held-out problems (random ids end at once)
        problems = iter(tiny_tasks.held_out_problems(1 + sum(args.others) * len(args.methods), seed=args.seed))
        prompt = lambda: engine.encode([next(problems).prompt], chat=True)[0]  # noqa: E731
    else:
        vocab = min(engine.config.vocab_size, engine.config.mask_token_id)
        prompt = lambda: [int(t) for t in rng.randint(0, vocab, args.prompt_len)]  # noqa: E731
    request = prompt()
    for method in args.methods:
        for n in args.others:
            others = [prompt() for _ in range(n)]
            decode = method_config(method, args.gen_length, n + 1)
            start = time.perf_counter()
            report = leak_report(engine, decode, request, others, args.steps)
            if args.answers:
                report["answers_identical"] = answers_identical(engine, decode, request, others)
            report["seconds"] = time.perf_counter() - start
            out[f"{method}/among {n}"] = report
            print(f"leak {method} among {n}: {summary_line(report)}", flush=True)
            save()


def summary_line(report: dict) -> str:
    steps = report["steps"]
    first = next(
        (s for s in steps if s["first_difference"] or not s["logits_identical"] or not s["committed_identical"]), None
    )
    answers = (
        ""
        if "answers_identical" not in report
        else f"; answers {'identical' if report['answers_identical'] else 'DIFFER'}"
    )
    if first is None:
        return f"bit-identical over {len(steps)} steps (logits, committed tokens, every tap){answers}"
    d = first["first_difference"]
    where = (
        "no tap differs"
        if d is None
        else (
            f"first difference: {d['op']}"
            + ("" if d["layer"] is None else f" of layer {d['layer']}")
            + f" ({d['differing']}/{d['of']} elements, max |diff| {d['max_abs']:.3g}, relative {d['max_rel']:.2g})"
        )
    )
    lanes = f", lanes {first['lanes_alone']} vs {first['lanes_among']}" if first["pass"] == "full" else ""
    return (
        f"step {first['step']} ({first['pass']} pass{lanes}): logits {'identical' if first['logits_identical'] else 'DIFFER'}, "
        f"committed tokens {'identical' if first['committed_identical'] else 'DIFFER'}; {where}{answers}"
    )


# ------------------------------------------------------------------------------ problems


def run_problems(args, engine: Engine, out: dict, save) -> None:
    """Fills out[method] method by method (save() after each)."""
    problems = tiny_tasks.held_out_problems(args.problems, seed=tiny_tasks.HELD_OUT_SEED)
    prompts = [p.prompt for p in problems]
    for method in args.methods:
        texts, seconds = {}, {}
        for batch in args.batches:
            start = time.perf_counter()
            result = engine.generate(prompts, decode_config=method_config(method, args.gen_length, batch), chat=True)
            texts[batch] = [r.text for r in result.results]
            seconds[batch] = time.perf_counter() - start
        base = texts[args.batches[0]]
        out[method] = {
            f"identical_to_batch_{args.batches[0]}": {
                b: sum(x == y for x, y in zip(base, texts[b])) for b in args.batches[1:]
            },
            "correct": {b: sum(tiny_tasks.is_correct(p, t) for p, t in zip(problems, texts[b])) for b in args.batches},
            "seconds": seconds,
        }
        counts = ", ".join(
            f"batch {b}: {n}/{len(problems)}" for b, n in out[method][f"identical_to_batch_{args.batches[0]}"].items()
        )
        print(f"problems {method}: identical to batch {args.batches[0]}: {counts}", flush=True)
        save()


# ------------------------------------------------------------------------------ report


def markdown(report: dict) -> str:
    lines = [
        f"# Batch invariance: {report['mode']} mode ({report['backend']}, {report['dtype']}, {report['device']}, {report['date']})",
        "",
        f"`{report['command']}`",
        "",
        f"XLA_FLAGS: `{report['xla_flags'] or '(none)'}`",
        "",
    ]
    if report.get("leak"):
        lines += [
            f"## A request alone (1 slot) vs among N others (N + 1 slots): {report['leak_model']}",
            "",
            "| method / others | result |",
            "|---|---|",
        ]
        lines += [f"| {name} | {summary_line(r)} |" for name, r in report["leak"].items()]
        lines.append("")
    if report.get("problems"):
        lines += [
            f"## {report['problems_count']} held-out problems of the embedded tiny model: answers identical to batch "
            f"{report['batches'][0]}",
            "",
            "| method | "
            + " | ".join(f"batch {b}" for b in report["batches"][1:])
            + " | correct at "
            + " / ".join(map(str, report["batches"]))
            + " |",
            "|---|" + "---|" * len(report["batches"]),
        ]
        for method, r in report["problems"].items():
            same = r[f"identical_to_batch_{report['batches'][0]}"]
            lines.append(
                f"| {method} | "
                + " | ".join(f"{same[b]}/{report['problems_count']}" for b in report["batches"][1:])
                + " | "
                + " / ".join(str(r["correct"][b]) for b in report["batches"])
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def build_leak_engine(args) -> tuple[Engine, str]:
    kwargs = dict(backend=args.backend, batch_invariant=args.batch_invariant)
    if args.model_shape == "tiny":
        from dllm_jax.models.embedded import tiny_model_path

        return Engine.from_pretrained(str(tiny_model_path()), dtype=args.dtype, **kwargs), "the embedded tiny model"
    from bench import MODEL_SHAPES

    full = MODEL_SHAPES[args.model_shape]()
    config = dataclasses.replace(full, dtype=args.dtype, n_layers=args.layers or full.n_layers)
    params = jax.block_until_ready(init_params(config, jax.random.key(0)))
    what = f"random weights at {args.model_shape} widths, {config.n_layers} of {full.n_layers} layers"
    return Engine(config, params, **kwargs), what


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--what", nargs="+", choices=("leak", "problems"), default=["leak", "problems"], help="what to measure"
    )
    p.add_argument("--smoke", action="store_true", help="CPU smoke test: tiny sizes everywhere")
    p.add_argument(
        "--batch-invariant", action="store_true", help="the engine's batch-invariant mode (+ deterministic XLA flags)"
    )
    p.add_argument("--backend", choices=("auto", "xla", "pallas"), default="auto")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument(
        "--methods", nargs="+", choices=METHODS, default=None, help="default: leak flash_cache; problems: all"
    )
    p.add_argument("--model-shape", choices=("tiny", "llada-8b", "1b", "0.5b"), default="llada-8b", help="leak's model")
    p.add_argument("--layers", type=int, default=4, help="leak at a bench shape: layers kept (0: all)")
    p.add_argument("--others", type=int, nargs="+", default=[7, 31], help="leak: requests beside the probed one")
    p.add_argument("--prompt-len", type=int, default=128, help="leak with random weights: prompt tokens")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="leak: engine steps compared (the first is the full pass)")
    p.add_argument(
        "--no-answers", dest="answers", action="store_false", help="leak: skip the Engine.generate comparison"
    )
    p.add_argument("--problems", type=int, default=240)
    p.add_argument(
        "--batches", type=int, nargs="+", default=[1, 5, 16], help="problems: batch sizes (the first is the reference)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = p.parse_args(argv)
    if args.smoke:
        args.model_shape, args.others, args.prompt_len, args.gen_length, args.steps = "tiny", [3], 12, 32, 3
        args.problems, args.batches = min(args.problems, 6), [1, 3]
    for name in ("problems", "steps", "prompt_len", "gen_length"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if any(n <= 0 for n in args.others + args.batches) or args.layers < 0:
        p.error("--others, --batches must be positive and --layers >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = "batch-invariant" if args.batch_invariant else "default"
    report = {
        "mode": mode,
        "dtype": args.dtype,
        "device": str(jax.devices()[0].device_kind),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "batches": args.batches,
        "problems_count": args.problems,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"batch_invariance_{mode}"

    def save():
        write_text_atomically(args.out / f"{name}.json", json.dumps(report, indent=1, default=str))
        write_text_atomically(args.out / f"{name}.md", markdown(report) + "\n")

    try:
        if "leak" in args.what:
            args.methods_all = args.methods
            args.methods = args.methods or ["flash_cache"]
            engine, report["leak_model"] = build_leak_engine(args)
            report["backend"] = engine.backend
            report["leak"] = {}
            run_leak(args, engine, report["leak"], save)
            args.methods = args.methods_all
            del engine
        if "problems" in args.what:
            from dllm_jax.models.embedded import tiny_model_path

            engine = Engine.from_pretrained(
                str(tiny_model_path()), dtype=args.dtype, backend=args.backend, batch_invariant=args.batch_invariant
            )
            report["backend"] = engine.backend
            args.methods = args.methods or list(METHODS)
            report["problems"] = {}
            run_problems(args, engine, report["problems"], save)
    except ValueError as e:  # GenerationError, DecodeConfigError, ConfigError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
