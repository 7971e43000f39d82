"""What recording commit log-probabilities costs a decode step (issue 34, item 4).

    python3 scripts/gpu/logprobs_cost.py --out $OUT/logprobs/cost.json            # GPU, LLaDA-8B shape
    python3 scripts/gpu/logprobs_cost.py --smoke --out /tmp/logprobs.json          # CPU, tiny model

In one process, on one engine (random per-layer bf16 weights at LLaDA-8B shape, backend auto),
the steady flash_cache step (one token per step, all slots decoding; bench.py's
steady_step_time) of four loops side by side: max_logprobs=None (the library's default loop:
no recording compiled), max_logprobs=0 with no request asking (dllm-serve's default loop: the
chosen tokens' logsumexp and gather, branch-free), max_logprobs=20 with no request asking
(a top-20 over the vocabulary per step too) and max_logprobs=20 with every request asking for
20 alternatives. Each is timed twice; the table gives the better median and the ratio to the
first loop, and the count of conditionals in each compiled loop (the recording adds none).
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

import bench  # noqa: E402
from step_against_old_tree import control_flow  # noqa: E402

VARIANTS = (
    ("max_logprobs=None (no records)", None, None),
    ("max_logprobs=0, none asking", 0, None),
    ("max_logprobs=20, none asking", 20, None),
    ("max_logprobs=20, all asking 20", 20, 20),
)


def measure(slots_list: list[int], smoke: bool) -> dict:
    import jax

    config = bench.tiny_config() if smoke else bench.llada_8b_config()
    gen_length, prompt_len = (32, 16) if smoke else (256, 256)
    params = jax.block_until_ready(bench.init_params_per_layer(config, jax.random.key(0)))
    engine = bench.Engine(config, params, backend="xla" if smoke else "auto", full_pass_lanes=())
    report = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "backend": engine.backend,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "runs": [],
    }
    for slots in slots_list:
        prompts = bench.random_prompts(slots, prompt_len, config.vocab_size, seed=slots)
        for name, max_logprobs, asking in VARIANTS:
            decode = dataclasses.replace(
                bench.decode_config("flash_cache", "one", gen_length, slots), max_logprobs=max_logprobs
            )
            sampling = dataclasses.replace(bench.schedule_sampling("flash_cache", "one"), logprobs=asking)
            timings = [bench.steady_step_time(engine, decode, prompts, 8, 3, sampling) for _ in range(2)]
            run = {
                "slots": slots,
                "variant": name,
                "step_ms": 1e3 * min(t["step_s"] for t in timings),
                "step_samples_ms": [1e3 * s for t in timings for s in t["step_samples_s"]],
                "compile_s": timings[0]["compile_s"],
                **control_flow(engine.compile(decode, prompt_len).run),
            }
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
            engine._executables.clear()  # noqa: SLF001 - one executable alive at a time
    return report


def table(report: dict) -> str:
    lines = [
        f"{report['device']}, jax {report['jax']}, backend {report['backend']}, {report['date']}",
        "",
        "| slots | loop | step ms | / first loop | conditionals |",
        "|---|---|---|---|---|",
    ]
    first = {}
    for run in report["runs"]:
        base = first.setdefault(run["slots"], run["step_ms"])
        lines.append(
            f"| {run['slots']} | {run['variant']} | {run['step_ms']:.2f} | {run['step_ms'] / base:.3f} | "
            f"{run['conditional']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", nargs="+", type=int, default=None, help="default 1 8 (smoke: 2)")
    p.add_argument("--smoke", action="store_true", help="tiny model, backend xla: a CPU check of the script")
    p.add_argument("--out", type=Path, default=None, help="JSON report (and the table beside it, .md)")
    opts = p.parse_args(argv)
    report = measure(opts.slots or ([2] if opts.smoke else [1, 8]), opts.smoke)
    print(table(report))
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(report, indent=1))
        opts.out.with_suffix(".md").write_text(table(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
