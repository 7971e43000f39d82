"""Decode-step times, first full passes and the step's control flow of one code tree (issue 12).

    python3 scripts/gpu/step_against_old_tree.py --out $OUT/perf12/new.json                      # this tree
    PYTHONPATH=$PWD/.old python3 scripts/gpu/step_against_old_tree.py --tree .old --out $OUT/perf12/old.json
    python3 scripts/gpu/step_against_old_tree.py --compare $OUT/perf12/new.json $OUT/perf12/old.json
    python3 scripts/gpu/step_against_old_tree.py --smoke --out /tmp/perf12.json                  # CPU, tiny model
    python3 scripts/gpu/step_against_old_tree.py --model-shape dream-7b --out $OUT/dream/new.json  # Dream-7B shape

Runs bench.py's own ``steady_step_time`` of the given tree (flash_cache, one token per step,
backend auto, the full pass over all slots at once, random per-layer bf16 weights at LLaDA-8B
shape) twice per slot count on the same compiled loop: the first call's "prefill" is the
first full pass of a fresh executable (what bench.py reports), the second call's is the same
full pass once the executable has run ("warm"), so a one-time cost of the first execution
is told apart from a slower pass. It also counts the ``conditional`` and ``while``
instructions of the compiled decode loop (on XLA:GPU each conditional reads its predicate
back to the host and blocks: one sync per conditional per step), and its copies of 64 MiB or
more (a copy of the cache in the loop is a pass over it per step). Both trees' bench.py have
the same ``steady_step_time(engine, decode, prompts, iterations, repeats)``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np


def _import_tree(tree: Path):
    """bench (and through it dllm_jax) of the given tree."""
    sys.path.insert(0, str(tree.resolve()))
    sys.path.insert(0, str((tree / "scripts").resolve()))
    import bench

    return bench


# bytes per element of the dtypes a large copy can have
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1}


def control_flow(compiled) -> dict:
    """Counts of conditional and while instructions in a jax Compiled object's optimized HLO,
    and of its copies of 64 MiB or more (copy, copy-start or a fusion named for a copy: a copy
    of the K/V cache inside the loop costs a pass over it per step) with their total GiB."""
    text = compiled.as_text()
    large = []
    for name, dtype, dims, op in re.findall(r"%(\S+) = (\w+)\[([\d,]*)\]\S* (copy|copy-start|fusion)\(", text):
        if op == "fusion" and "copy" not in name:
            continue
        size = _DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
        if size >= 64 << 20:
            large.append(size)
    return {
        "conditional": len(re.findall(r"\sconditional\(", text)),
        "while": len(re.findall(r"\swhile\(", text)),
        "large_copies": len(large),
        "large_copy_gib": round(sum(large) / 2**30, 2),
    }


def measure(
    bench, slots_list, gen_length: int, prompt_len: int, backend: str, smoke: bool, model_shape: str = "llada-8b"
) -> dict:
    import jax

    config = bench.tiny_config() if smoke else bench.MODEL_SHAPES[model_shape]()
    start = time.perf_counter()
    params = jax.block_until_ready(bench.init_params_per_layer(config, jax.random.key(0)))
    report = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "tree": bench.__file__,
        "model_shape": "tiny" if smoke else model_shape,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "init_s": time.perf_counter() - start,
        "runs": [],
    }
    engine = bench.Engine(config, params, backend=backend, full_pass_lanes=())
    report["backend"] = engine.backend
    for slots in slots_list:
        decode = bench.decode_config("flash_cache", "one", gen_length, slots)
        prompts = bench.random_prompts(slots, prompt_len, config.vocab_size, seed=slots)
        first = bench.steady_step_time(engine, decode, prompts, 8, 3)
        second = bench.steady_step_time(engine, decode, prompts, 8, 3)
        compiled = engine.compile(decode, prompt_len)
        run = {
            "slots": slots,
            "compile_s": first["compile_s"],
            "first_full_pass_cold_ms": 1e3 * first["prefill_s"],
            "first_full_pass_warm_ms": 1e3 * second["prefill_s"],
            "step_ms": 1e3 * first["step_s"],
            "step_ms_again": 1e3 * second["step_s"],
            "step_samples_ms": [1e3 * s for s in first["step_samples_s"] + second["step_samples_s"]],
            # the jax Compiled object: `call` since the loop runs one packed call per dispatch, `run` before
            **control_flow(getattr(compiled, "call", None) or compiled.run),
        }
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
        engine._executables.clear()  # noqa: SLF001 - one executable alive at a time
    report["cutoff_kernel"] = time_cutoff_kernel(config.vocab_size, smoke)
    return report


def time_cutoff_kernel(vocab: int, smoke: bool) -> list[dict] | None:
    """Milliseconds per call of the top-p/top-k cutoff kernel (None: this tree has none) over
    1 and 32 slots' candidate rows, with no row and with every row asking."""
    try:
        from pallas_kernels.sampling.top_p_top_k import top_p_top_k_cutoff
    except ImportError:
        return None
    import jax
    import jax.numpy as jnp

    out = []
    for rows in (16,) if smoke else (16, 512):
        logits = jax.random.normal(jax.random.key(rows), (rows, vocab), jnp.bfloat16) * 3
        temperature, top_p = jnp.full((rows,), 0.7), jnp.full((rows,), 0.9)
        top_k = jnp.full((rows,), 50, jnp.int32)
        for asking in (False, True):
            wants = jnp.full((rows,), asking)
            call = jax.jit(lambda x, w: top_p_top_k_cutoff(x, temperature, top_p, top_k, w, interpret=smoke))
            jax.block_until_ready(call(logits, wants))
            start = time.perf_counter()
            for _ in range(10):
                result = call(logits, wants)
            jax.block_until_ready(result)
            out.append({"rows": rows, "asking": asking, "ms": 1e3 * (time.perf_counter() - start) / 10})
            print(json.dumps(out[-1]), flush=True)
    return out


def compare(new_path: Path, old_path: Path) -> str:
    new, old = (json.loads(Path(p).read_text()) for p in (new_path, old_path))
    lines = [
        f"new: {new['tree']} ({new['backend']}), old: {old['tree']} ({old['backend']}), {new['device']}, jax {new['jax']}",
        "",
        "| slots | old step ms | new step ms | new / old | first full pass cold, old / new ms | warm, old / new ms | conditionals old / new | copies of >= 64 MiB old / new (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, o in zip(new["runs"], old["runs"]):
        step_n = min(n["step_ms"], n["step_ms_again"])
        step_o = min(o["step_ms"], o["step_ms_again"])
        lines.append(
            f"| {n['slots']} | {step_o:.2f} | {step_n:.2f} | {step_n / step_o:.3f} | "
            f"{o['first_full_pass_cold_ms']:.0f} / {n['first_full_pass_cold_ms']:.0f} | "
            f"{o['first_full_pass_warm_ms']:.0f} / {n['first_full_pass_warm_ms']:.0f} | "
            f"{o['conditional']} / {n['conditional']} | "
            f"{o.get('large_copies', '-')} / {n.get('large_copies', '-')} "
            f"({o.get('large_copy_gib', '-')} / {n.get('large_copy_gib', '-')}) |"
        )
    lines.append("")
    lines.append("step: the better of the two calls' medians (8 iterations x 3 samples each)")
    if new.get("cutoff_kernel"):
        lines += [
            "",
            "top-p/top-k cutoff kernel (new): "
            + ", ".join(
                f"{r['rows']} rows {'asking' if r['asking'] else 'not asking'} {r['ms']:.3f} ms"
                for r in new["cutoff_kernel"]
            ),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tree",
        type=Path,
        default=Path(__file__).resolve().parents[2],
        help="the code tree whose bench.py and dllm_jax run (default: this one)",
    )
    p.add_argument("--slots", nargs="+", type=int, default=None, help="default 1 8 32 (smoke: 1 2)")
    p.add_argument("--smoke", action="store_true", help="tiny model, backend xla: a CPU check of the script")
    p.add_argument("--model-shape", default="llada-8b", help="bench.py's MODEL_SHAPES name (default llada-8b)")
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("NEW", "OLD"), help="print the table of two reports")
    opts = p.parse_args(argv)
    if opts.compare:
        print(compare(*opts.compare))
        return 0
    bench = _import_tree(opts.tree)
    if opts.model_shape not in bench.MODEL_SHAPES:
        p.error(f"--model-shape {opts.model_shape!r}: expected one of {', '.join(sorted(bench.MODEL_SHAPES))}")
    slots = opts.slots or ([1, 2] if opts.smoke else [1, 8, 32])
    gen_length, prompt_len = (32, 16) if opts.smoke else (256, 256)
    backend = "xla" if opts.smoke else "auto"
    report = measure(bench, slots, gen_length, prompt_len, backend, opts.smoke, opts.model_shape)
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
