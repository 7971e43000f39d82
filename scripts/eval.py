"""Accuracy and speed of every decoding method on the same held-out problems.

    python scripts/eval.py                               # embedded tiny model, 256 problems
    python scripts/eval.py --model PATH --problems 64 --settings exact-one-per-step flash-track4-t0.9
    python scripts/eval.py --model tiny-llada tiny-dream --problems 64    # both families side by side

For each setting (a method with its options), decodes the held-out problems of
dllm_jax.evaluation.tiny_tasks (a seed and a hash split the training never sees) and reports exact-match
accuracy, tokens per step, forward passes, tokens/s and agreement with the exact decode (same
answer text). The exact decode commits one token per step (the most confident of the window)
and recomputes every position every step (no cache), over the same canvas as the cached
methods (keys up to the next multiple of 128, as the published Flash-dLLM code and the tiny
model's training sequences have). LLaDA's own sampler (one token per step, blocks, keys =
prompt + generation only) is reported beside it. Writes eval.json and eval.md to --out after
every setting; --resume keeps the settings an interrupted run of the same command finished.
--model takes any LLaDA, Dream or DiffusionGemma checkpoint, or the embedded tiny-llada /
tiny-dream / tiny-diffusiongemma; with several models each is evaluated on the same problems
and settings into --out/<model name>/, and the tables are printed one after the other. The
dream-* settings are Dream's own sampler (method "dream", one alg each), on either masked
diffusion family; the problems stay the tiny tasks. A DiffusionGemma model has its own settings
(method diffusion_gemma with the sampler values of the model's generation_config.json, seed 0:
request i draws stream i): its reference is diffusion_gemma-full (every canvas row recomputed
each denoising step), beside Flash-Cache on the canvas (diffusion_gemma-canvas_rows16).
--generation-config none decodes with SamplingParams' own defaults instead of the model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

from tqdm.auto import tqdm  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.evaluation import tiny_tasks  # noqa: E402
from dllm_jax.models.quantization import QUANTIZATIONS  # noqa: E402
from dllm_jax.runtime.decode_config import DecodeConfig  # noqa: E402
from dllm_jax.sampling.generation_defaults import GENERATION_CONFIG_MODES  # noqa: E402
from dllm_jax.sampling.params import SamplingParams  # noqa: E402

EXACT = "exact-one-per-step"
DIFFUSION_GEMMA_FULL = "diffusion_gemma-full"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One evaluated setting: the compiled configuration and the requests' values."""

    decode_config: DecodeConfig
    sampling: SamplingParams

    def describe(self) -> dict:
        """The setting as the report records it (what a resumed run must match)."""
        changed = {
            f.name: getattr(self.sampling, f.name)
            for f in dataclasses.fields(SamplingParams)
            if getattr(self.sampling, f.name) != f.default
        }
        return {**dataclasses.asdict(self.decode_config), **changed}


def setting(decode_config: DecodeConfig, threshold: float | None = None) -> Setting:
    return Setting(decode_config, SamplingParams(threshold=threshold))


def reference(family: str) -> str:
    """The setting every other's agreement is measured against, for a model family."""
    return DIFFUSION_GEMMA_FULL if family == "diffusion_gemma" else EXACT


def settings(gen_length: int, batch_size: int, family: str = "llada") -> dict[str, Setting]:
    """The evaluated settings of a model family by name; reference(family) is the reference of
    the agreement column."""
    common = dict(gen_length=gen_length, batch_size=batch_size)
    if family == "diffusion_gemma":
        sampler = SamplingParams()  # the model's generation_config.json (Engine.generation_defaults)
        return {
            DIFFUSION_GEMMA_FULL: Setting(DecodeConfig(method="diffusion_gemma", **common), sampler),
            "diffusion_gemma-canvas_rows16": Setting(
                DecodeConfig(method="diffusion_gemma", canvas_rows=16, **common), sampler
            ),
        }
    flash = dict(method="flash_cache", mask_num=4, **common)
    verify = dict(flash, track_num=4, verify=True)  # gamma 0.8: the default
    grid = {
        EXACT: setting(DecodeConfig(track_num=-1, **flash), threshold=2.0),
        "llada-one-per-step-block32": setting(
            DecodeConfig(method="llada", block_length=32, steps=gen_length, **common)
        ),
        "llada-one-per-step-block64": setting(
            DecodeConfig(method="llada", block_length=gen_length, steps=gen_length, **common)
        ),
        "fast_dllm-prefix-t0.9": setting(
            DecodeConfig(method="fast_dllm", cache="prefix", block_length=32, **common), threshold=0.9
        ),
        "fast_dllm-dual-t0.9": setting(
            DecodeConfig(method="fast_dllm", cache="dual", block_length=32, **common), threshold=0.9
        ),
        "fast_dllm-dual-t0.7": setting(
            DecodeConfig(method="fast_dllm", cache="dual", block_length=32, **common), threshold=0.7
        ),
        "flash-exact-refresh-t0.9": setting(DecodeConfig(track_num=-1, **flash), threshold=0.9),
        "flash-track0-t0.9": setting(DecodeConfig(track_num=0, **flash), threshold=0.9),
        "flash-track1-t0.9": setting(DecodeConfig(track_num=1, **flash), threshold=0.9),
        "flash-track4-t0.9": setting(DecodeConfig(track_num=4, **flash), threshold=0.9),
        "flash-track4-t0.7": setting(DecodeConfig(track_num=4, **flash), threshold=0.7),
        "flash-track4-t0.95": setting(DecodeConfig(track_num=4, **flash), threshold=0.95),
        "flash-track4-one-per-step": setting(DecodeConfig(track_num=4, **flash), threshold=2.0),
        "verify-cumprod-all_commits-t0.9": setting(
            DecodeConfig(accept="cumprod", pin="all_commits", **verify), threshold=0.9
        ),
        "verify-paper-all_commits-t0.9": setting(
            DecodeConfig(accept="paper", pin="all_commits", **verify), threshold=0.9
        ),
        "verify-cumprod-reference-t0.9": setting(
            DecodeConfig(accept="cumprod", pin="reference", **verify), threshold=0.9
        ),
        "verify-paper-reference-t0.9": setting(DecodeConfig(accept="paper", pin="reference", **verify), threshold=0.9),
        "verify-paper-all_commits-t0.7": setting(
            DecodeConfig(accept="paper", pin="all_commits", **verify), threshold=0.7
        ),
    }
    for alg in ("entropy", "maskgit_plus", "topk_margin", "origin"):
        grid[f"dream-{alg}-steps{gen_length}"] = setting(
            DecodeConfig(method="dream", alg=alg, steps=gen_length, **common)
        )
    grid[f"dream-entropy-steps{gen_length // 2}"] = setting(
        DecodeConfig(method="dream", alg="entropy", steps=gen_length // 2, **common)
    )
    return grid


def evaluate(engine, problems, setting: Setting, exact_texts: list[str] | None) -> dict:
    out = engine.generate(
        [p.prompt for p in problems], setting.sampling, decode_config=setting.decode_config, chat=True
    )
    texts = [r.text for r in out.results]
    correct = [tiny_tasks.is_correct(p, t) for p, t in zip(problems, texts)]
    by_task: dict[str, list[bool]] = {}
    for p, ok in zip(problems, correct):
        by_task.setdefault(p.task, []).append(ok)
    s = out.stats
    return {
        "accuracy": sum(correct) / len(problems),
        "accuracy_by_task": {task: sum(v) / len(v) for task, v in sorted(by_task.items())},
        "agreement_with_exact": None
        if exact_texts is None
        else sum(a == b for a, b in zip(texts, exact_texts)) / len(problems),
        "tokens_per_step": s.tokens_per_step,
        "steps": s.steps,
        "forward_passes": s.forward_passes,
        "verify_passes": sum(r.verify_passes for r in out.results),
        "accepted_drafts": sum(r.accepted_drafts for r in out.results),
        "tokens": s.reference_num_tokens,
        "tokens_per_second": s.tokens_per_second,
        "wall_seconds": s.wall_seconds,
        "compile_seconds": s.compile_seconds,
        "texts": texts,
    }


def markdown(report: dict) -> str:
    lines = [
        f"model: {report['model']} ({report.get('family', 'llada')}) | {report['problems']} held-out problems (seed {report['seed']}) | "
        f"gen_length {report['gen_length']} | batch {report['batch_size']} | backend {report['backend']} | "
        f"quantization {report.get('quantization', 'none')} | {report['device']}",
        f"model defaults (--generation-config {report.get('generation_config', 'auto')}): "
        + (", ".join(f"{k}={v}" for k, v in report.get("generation_defaults", {}).items()) or "none"),
        "",
    ]
    baseline = report.get("baseline")
    head = "| setting | accuracy | by task | agreement with exact | tokens/step | steps | forward passes | accepted drafts | tokens/s |"
    if baseline:
        head += " accuracy change vs baseline | same answer as baseline |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in report["results"].items():
        tasks = ", ".join(f"{t} {a:.3f}" for t, a in r["accuracy_by_task"].items())
        agree = "-" if r["agreement_with_exact"] is None else f"{r['agreement_with_exact']:.3f}"
        line = (
            f"| {name} | {r['accuracy']:.3f} | {tasks} | {agree} | {r['tokens_per_step']:.2f} | {r['steps']} | "
            f"{r['forward_passes']} | {r['accepted_drafts']} | {r['tokens_per_second']:.1f} |"
        )
        if baseline:
            change = r.get("accuracy_change_vs_baseline")
            same = r.get("same_answer_as_baseline")
            line += " - | - |" if same is None else f" {100 * change:+.1f} pt | {same:.3f} |"
        lines.append(line)
    return "\n".join(lines)


_KEY_DEFAULTS = {"quantization": "none", "generation_config": "auto"}
SAME_RUN_KEYS = (
    "model",
    "problems",
    "seed",
    "gen_length",
    "batch_size",
    "backend",
    "dtype",
    "quantization",
    "generation_config",
    "device",
)


def finished_results(path: Path, report: dict) -> dict:
    """The results of `path` for settings whose options match `report`'s; {} if there is no file
    or the exact decode's options changed (every agreement figure was measured against it).

    Raises ValueError naming the first option that differs (a resumed table must be one run's).
    """
    if not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--resume: {path} is not valid JSON ({e})") from e
    for key in SAME_RUN_KEYS:
        # reports from before a key existed ran with its default
        was, now = (r.get(key, _KEY_DEFAULTS.get(key)) for r in (old, report))
        if was != now:
            raise ValueError(f"--resume: {path} was run with {key}={was!r}, this run has {now!r}")
    kept = {
        name: result
        for name, result in old.get("results", {}).items()
        if name in report["settings"] and old["settings"].get(name) == report["settings"][name]
    }
    return kept if reference(report.get("family", "llada")) in kept else {}


def read_baseline(path: Path, problems: int, seed: int) -> dict:
    """The per-setting results of a baseline eval.json run on the same problems."""
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--baseline: cannot read {path} ({e})") from None
    if old.get("problems") != problems or old.get("seed") != seed:
        raise ValueError(
            f"--baseline: {path} scored {old.get('problems')} problems of seed {old.get('seed')}, "
            f"this run {problems} of seed {seed}"
        )
    return old.get("results", {})


def parse_args(argv):
    from dllm_jax.models.embedded import tiny_model_path

    grid_names = [name for family in ("llada", "diffusion_gemma") for name in settings(64, 8, family)]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        nargs="+",
        default=[str(tiny_model_path())],
        help="LLaDA, Dream or DiffusionGemma checkpoint(s), or tiny-llada / tiny-dream / tiny-diffusiongemma "
        "(default: the embedded tiny-llada)",
    )
    p.add_argument("--problems", type=int, default=256, help="held-out problems")
    p.add_argument("--seed", type=int, default=tiny_tasks.HELD_OUT_SEED, help="seed of the held-out stream")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--settings", nargs="+", choices=grid_names, default=None, help="default: every setting of the model's family"
    )
    p.add_argument("--backend", choices=("auto", "xla", "pallas"), default="auto")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: float32 on CPU")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="8-bit block projections and int8 embedding (dllm_jax.models.quantization); compare with --baseline",
    )
    p.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        default="auto",
        help="auto: what a setting leaves unset takes the model's generation_config.json values; none: "
        "SamplingParams' own defaults",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="an eval.json of the same problems (e.g. unquantized): adds each setting's accuracy change "
        "and same-answer rate against it",
    )
    p.add_argument("--out", type=Path, default=Path("out/eval"))
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished settings of --out/eval.json when it was run with the same options",
    )
    args = p.parse_args(argv)
    if args.problems <= 0:
        p.error("--problems must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.baseline is not None and len(args.model) > 1:
        print("error: --baseline compares one model's run; give one --model", file=sys.stderr)
        return 2
    tables = []
    for model in args.model:
        out = args.out if len(args.model) == 1 else args.out / Path(model).name
        status, table = evaluate_model(args, model, out)
        if status:
            return status
        tables.append(table)
    print("\n\n".join(tables))
    return 0


def evaluate_model(args, model_name: str, out_dir: Path) -> tuple[int, str]:
    """Evaluates one model (a folder or an embedded name) into out_dir; (exit status, markdown table)."""
    import jax

    from dllm_jax.engine.engine import Engine

    dtype = args.dtype or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")
    try:
        engine = Engine.from_pretrained(
            model_name,
            dtype=dtype,
            backend=args.backend,
            quantization=args.quantization,
            generation_config=args.generation_config,
        )
        baseline = read_baseline(args.baseline, args.problems, args.seed) if args.baseline else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2, ""
    args = argparse.Namespace(**{**vars(args), "model": model_name, "out": out_dir})
    problems = tiny_tasks.held_out_problems(args.problems, seed=args.seed)
    family = engine.config.family
    grid, exact = settings(args.gen_length, args.batch_size, family), reference(family)
    other = [n for n in args.settings or grid if n not in grid]
    if other:
        print(
            f"error: --settings {' '.join(other)}: not settings of a {family} model ({', '.join(grid)})",
            file=sys.stderr,
        )
        return 2, ""
    names = [exact] + [n for n in args.settings or grid if n != exact]
    report = {
        "model": args.model,
        "family": engine.config.family,
        "problems": args.problems,
        "seed": args.seed,
        "gen_length": args.gen_length,
        "batch_size": args.batch_size,
        "backend": engine.backend,
        "dtype": dtype,
        "quantization": args.quantization,
        "generation_config": args.generation_config,
        "generation_defaults": dict(engine.generation_defaults.values),
        "baseline": None if baseline is None else str(args.baseline),
        "device": str(jax.devices()[0].device_kind),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "settings": {n: grid[n].describe() for n in names},
        "results": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume:
        try:
            report["results"] = finished_results(args.out / "eval.json", report)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2, ""
    exact_texts = report["results"].get(exact, {}).get("texts")
    for name in tqdm(names, desc="settings"):
        if name in report["results"]:
            continue
        result = evaluate(engine, problems, grid[name], exact_texts)
        if name == exact:
            exact_texts = result["texts"]
            result["agreement_with_exact"] = 1.0
        if baseline is not None and name in baseline:
            base = baseline[name]
            result["accuracy_change_vs_baseline"] = result["accuracy"] - base["accuracy"]
            result["same_answer_as_baseline"] = sum(a == b for a, b in zip(result["texts"], base["texts"])) / len(
                problems
            )
        report["results"][name] = result
        write_text_atomically(args.out / "eval.json", json.dumps(report, indent=1))
        write_text_atomically(args.out / "eval.md", markdown(report) + "\n")
    return 0, markdown(report)


if __name__ == "__main__":
    sys.exit(main())
