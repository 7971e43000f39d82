"""Which decoded rows Flash-Cache should refresh: every tracking rule at every budget, measured.

    python scripts/tracking_study.py                                  # both embedded models, 256 problems
    python scripts/tracking_study.py --models tiny-llada --problems 64 --probe-problems 32 --budgets 0 1 4

For each model (the embedded tiny-llada and tiny-dream by default) and each budget
(track_num = 0, 1, 2, 4, 8 blocks of 16 rows), decodes the held-out problems of
dllm_jax.evaluation.tiny_tasks with every tracking rule (SamplingParams.track_rule: attention,
recent, random, drift, none; one compiled loop per budget serves all of them) and reports
accuracy, agreement with exact refresh (the same schedule with every position recomputed every
step, track_num=-1: the same answer text), steps and tokens per step. At budget 0 every rule is
the same decode and runs once.

Then, over the first --probe-problems problems of each rule and budget > 0, it drives the same
compiled loop one step at a time and, before each step, runs the staleness probe
(dllm_jax.runtime.tracking_probe): for every decoded row of every slot about to take a sparse
step, its attention from the window's queries, the drift of its cached K/V from an exact
recomputation and the error its staleness alone injects into the window's attention output
(summed over layers; attention averaged over them; "attention x drift" is the per-layer product,
summed). From these: the rank correlation (Spearman) of each predictor with the error, within
each slot's step and pooled; which share of the error the rule's refreshed rows remove against
the best rows of the same number; and, among the rows not pinned, the error each predictor's
top rows would remove at the rule's free budget, as a share of the best possible.

Writes study.json, study.md and two plots (accuracy_vs_budget.png, error_vs_attention_drift.png)
to --out after every run; --resume keeps the runs a previous call of the same options finished;
--merge combines runs made apart (one process per model) into one report. Needs matplotlib and
scipy (the `study` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import numpy as np  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.evaluation import tiny_tasks  # noqa: E402
from dllm_jax.runtime.decode_config import DecodeConfig  # noqa: E402
from dllm_jax.sampling.params import TRACK_RULES, SamplingParams  # noqa: E402

PREDICTORS = ("attention", "drift", "attention_x_drift", "tracking_score", "last_refresh_drift")
PROBED_RULES = tuple(r for r in TRACK_RULES if r != "none")  # "none" refreshes nothing to probe
MIN_ROWS = 5  # slot steps with fewer decoded rows give no within-step correlation
PLOT_POINTS = 4000  # rows per model in the scatter plot
# marker and line per rule, so that rules with equal accuracy stay visible
RULE_STYLES = tuple(
    {"marker": m, "linestyle": ls, "markersize": ms}
    for m, ls, ms in (("o", "-", 9), ("s", "--", 7), ("^", "-.", 6), ("D", ":", 5), ("x", "-", 7))
)


@dataclasses.dataclass(frozen=True)
class Options:
    gen_length: int
    batch_size: int
    mask_num: int
    threshold: float

    def decode_config(self, track_num: int) -> DecodeConfig:
        return DecodeConfig(
            method="flash_cache",
            gen_length=self.gen_length,
            batch_size=self.batch_size,
            mask_num=self.mask_num,
            track_num=track_num,
        )


def decode_problems(engine, problems, decode_config: DecodeConfig, sampling: SamplingParams, exact_texts) -> dict:
    """Accuracy, agreement with `exact_texts` (None: this is the exact decode), steps, tokens/step."""
    start = time.perf_counter()
    out = engine.generate([p.prompt for p in problems], sampling, decode_config=decode_config, chat=True)
    texts = [r.text for r in out.results]
    correct = [tiny_tasks.is_correct(p, t) for p, t in zip(problems, texts)]
    return {
        "accuracy": sum(correct) / len(problems),
        "agreement_with_exact": 1.0
        if exact_texts is None
        else sum(a == b for a, b in zip(texts, exact_texts)) / len(problems),
        "steps": out.stats.steps,
        "tokens_per_step": out.stats.tokens_per_step,
        "seconds": time.perf_counter() - start,
        "texts": texts,
    }


# ----- the probe runs ------------------------------------------------------------------------


def probe_run(
    engine, prompt_ids: list[list[int]], longest: int, decode_config: DecodeConfig, sampling: SamplingParams
) -> list[dict]:
    """Decodes the prompts step by step in the engine's compiled loop for prompts of up to
    `longest` tokens (the one generate() used); before each step, the staleness probe.
    Returns one record per slot and sparse step: numpy arrays over the slot's decoded rows
    (error, the PREDICTORS, tracked: refreshed by this step, pinned)."""
    import jax

    from dllm_jax.models.logit_alignment import with_predictor_rows
    from dllm_jax.runtime.tracking_probe import probe_staleness

    compiled = engine.compile(decode_config, longest)
    loop = compiled.loop
    probe = jax.jit(functools.partial(probe_staleness, loop))

    @jax.jit
    def query_rows(slots):
        """The sparse pass's query positions (with a shifted model's predictor rows, as the loop)."""
        positions, valid = jax.vmap(loop.policy.sparse_rows)(slots)
        if loop.model.logit_shift:
            candidates, candidate_valid = jax.vmap(loop.policy.candidates)(slots)
            positions, valid = with_predictor_rows(
                positions, valid, candidates, candidate_valid, loop.model.logit_shift
            )
        return positions, valid

    records = []
    for start in range(0, len(prompt_ids), compiled.queue_capacity):
        state = compiled.initial_state(prompt_ids[start : start + compiled.queue_capacity], sampling)
        while True:
            slots = jax.device_get(state.slots)
            queue = jax.device_get(state.queue)
            if not slots.active.any() and queue.next >= queue.count:
                break
            staleness = jax.device_get(probe(engine.weights, state))
            positions, valid = jax.device_get(query_rows(state.slots))
            records += _slot_records(slots, staleness, positions, valid)
            state = compiled.run(engine.weights, state, 1)
    return records


def _slot_records(slots, staleness, positions, valid) -> list[dict]:
    out = []
    for b in np.flatnonzero(staleness.rows.any(axis=1)):
        rows = staleness.rows[b]
        refreshed = np.zeros_like(rows)
        refreshed[positions[b][valid[b]]] = True
        attention = staleness.attention[:, b, rows]
        drift = staleness.drift[:, b, rows]
        out.append(
            {
                "error": staleness.error[:, b, rows].sum(axis=0),
                "attention": attention.mean(axis=0),
                "drift": drift.sum(axis=0),
                "attention_x_drift": (attention * drift).sum(axis=0),
                "tracking_score": slots.scores[b, rows],
                "last_refresh_drift": slots.drift[b, rows],
                "tracked": refreshed[rows],
                "pinned": slots.pinned[b, rows],
            }
        )
    return out


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.stats import spearmanr

    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)


def _top_share(key: np.ndarray, error: np.ndarray, k: int) -> float:
    """Error of the k rows of highest key, as a share of the k largest errors' (ties by position)."""
    best = np.sort(error)[::-1][:k].sum()
    chosen = error[np.argsort(-key, kind="stable")[:k]].sum()
    return float(chosen / best) if best > 0 else float("nan")


def summarise_probe(records: list[dict]) -> dict:
    """The probe's numbers of one rule and budget (see the module docstring)."""
    within = {name: [] for name in PREDICTORS}
    within_unpinned = {name: [] for name in PREDICTORS}
    capture = {name: [] for name in PREDICTORS + ("random",)}
    refreshed, best = [], []
    for r in records:
        error = r["error"]
        free = ~r["pinned"]
        if len(error) >= MIN_ROWS:
            for name in PREDICTORS:
                within[name].append(_spearman(r[name], error))
        if int(free.sum()) >= MIN_ROWS:
            for name in PREDICTORS:
                within_unpinned[name].append(_spearman(r[name][free], error[free]))
        total = error.sum()
        n = int(r["tracked"].sum())
        if total > 0:
            refreshed.append(error[r["tracked"]].sum() / total)
            best.append(np.sort(error)[::-1][:n].sum() / total)
        k = n - int((r["tracked"] & r["pinned"]).sum())
        if 0 < k < int(free.sum()):
            for name in PREDICTORS:
                capture[name].append(_top_share(r[name][free], error[free], k))
            oracle = np.sort(error[free])[::-1][:k].sum()
            if oracle > 0:
                capture["random"].append(k * error[free].mean() / oracle)
    columns = PREDICTORS + ("error", "pinned")
    pooled = {name: np.concatenate([r[name] for r in records]) for name in columns} if records else {}
    free = ~pooled["pinned"] if records else None
    mean = lambda v: float(np.nanmean(v)) if len(v) and not np.all(np.isnan(v)) else float("nan")  # noqa: E731
    return {
        "slot_steps": len(records),
        "rows": int(sum(len(r["error"]) for r in records)),
        "spearman_within_step": {name: mean(v) for name, v in within.items()},
        "spearman_pooled": {
            name: _spearman(pooled[name], pooled["error"]) if records else float("nan") for name in PREDICTORS
        },
        "spearman_within_step_unpinned": {name: mean(v) for name, v in within_unpinned.items()},
        "spearman_pooled_unpinned": {
            name: _spearman(pooled[name][free], pooled["error"][free]) if records else float("nan")
            for name in PREDICTORS
        },
        "error_share_refreshed": mean(refreshed),
        "error_share_best_same_count": mean(best),
        "capture_at_free_budget": {name: mean(v) for name, v in capture.items()},
        "capture_steps": len(capture["attention"]),
    }


def plot_sample(records: list[dict], rng: np.random.Generator, size: int) -> dict:
    """Up to `size` rows (error, attention x drift, pinned) drawn from the records."""
    columns = {name: np.concatenate([r[name] for r in records]) for name in ("error", "attention_x_drift", "pinned")}
    pick = rng.choice(len(columns["error"]), size=min(size, len(columns["error"])), replace=False)
    return {name: column[pick].tolist() for name, column in columns.items()}


# ----- report --------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    o = report["options"]
    lines = [
        f"{report['problems']} held-out problems (seed {report['seed']}), gen_length {o['gen_length']}, "
        f"{o['batch_size']} slots, mask_num {o['mask_num']}, threshold {o['threshold']}, float32, "
        f"backend xla, {report['device']}; probe over the first {report['probe_problems']} problems",
        "",
    ]
    for model, m in report["models"].items():
        exact = m.get("exact")
        lines += [f"#### {model}: accuracy, agreement with exact refresh, steps, tokens per step", ""]
        if exact:
            lines += [
                f"exact refresh (track_num -1): accuracy {exact['accuracy']:.3f}, {exact['steps']} steps, "
                f"{exact['tokens_per_step']:.2f} tokens/step; compiled loops: {m.get('compiled_loops', '-')}",
                "",
            ]
        budgets = sorted({int(k.split("/")[0]) for k in m["runs"]})
        head = "| rule | " + " | ".join(f"budget {b}" for b in budgets) + " |"
        lines += [head, "|" + "---|" * (len(budgets) + 1)]
        for rule in TRACK_RULES:
            cells = []
            for b in budgets:
                r = m["runs"].get(f"{b}/{rule if b else 'attention'}")
                cells.append(
                    "-"
                    if r is None
                    else f"{r['accuracy']:.3f} / {r['agreement_with_exact']:.3f} / {r['steps']} / {r['tokens_per_step']:.2f}"
                )
            lines.append(f"| {rule} | " + " | ".join(cells) + " |")
        lines += ["", "cells: accuracy / same answer as exact refresh / steps / tokens per step", ""]
        probes = m.get("probes", {})
        if probes:
            lines += [
                f"#### {model}: the refreshed rows against the error (probe)",
                "",
                "| budget / rule | slot steps | error share refreshed | best share, same count | "
                + " | ".join(f"capture: {p}" for p in PREDICTORS + ("random",))
                + " |",
                "|" + "---|" * (4 + len(PREDICTORS) + 1),
            ]
            for key, p in probes.items():
                cap = p["capture_at_free_budget"]
                lines.append(
                    f"| {key} | {p['slot_steps']} | {p['error_share_refreshed']:.3f} | "
                    f"{p['error_share_best_same_count']:.3f} | "
                    + " | ".join(f"{cap[name]:.3f}" for name in PREDICTORS + ("random",))
                    + " |"
                )
            lines += [
                "",
                "| predictor of the injected error | Spearman within a slot's step (mean) | pooled "
                "| older rows only (not pinned): within a step | pooled |",
                "|---|---|---|---|---|",
            ]
            all_probes = m.get("probe_all", {})
            for name in PREDICTORS:
                cells = [
                    all_probes.get(column, {}).get(name, float("nan"))
                    for column in (
                        "spearman_within_step",
                        "spearman_pooled",
                        "spearman_within_step_unpinned",
                        "spearman_pooled_unpinned",
                    )
                ]
                lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plots(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        m = report["models"][model]
        budgets = sorted({int(k.split("/")[0]) for k in m["runs"]})
        for rule, style in zip(TRACK_RULES, RULE_STYLES):
            points = [
                (b, m["runs"][f"{b}/{rule if b else 'attention'}"]["accuracy"])
                for b in budgets
                if f"{b}/{rule if b else 'attention'}" in m["runs"]
            ]
            if points:
                xs, ys = zip(*points)
                ax.plot([budgets.index(x) for x in xs], ys, label=rule, alpha=0.8, **style)
        if m.get("exact"):
            ax.axhline(m["exact"]["accuracy"], color="gray", linestyle="--", label="exact refresh")
        ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        ax.set_xlabel("tracking budget (blocks of 16 decoded rows)")
        ax.set_ylabel("accuracy")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_budget.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        sample = report["models"][model].get("plot_sample")
        if not sample:
            continue
        x, y = np.asarray(sample["attention_x_drift"]), np.asarray(sample["error"])
        pinned = np.asarray(sample["pinned"], bool)
        for rows, label in ((~pinned, "older rows"), (pinned, "fresh commits (pinned)")):
            keep = rows & (x > 0) & (y > 0)
            ax.scatter(x[keep], y[keep], s=3, alpha=0.3, label=label)
        ax.legend(fontsize=8, markerscale=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        rho = report["models"][model].get("probe_all", {}).get("spearman_pooled", {}).get("attention_x_drift")
        ax.set_title(f"{model} (Spearman {rho:.2f})" if rho is not None else model)
        ax.set_xlabel("attention x drift (per layer, summed)")
        ax.set_ylabel("error the stale row injects")
    fig.tight_layout()
    fig.savefig(out / "error_vs_attention_drift.png", dpi=120)
    plt.close(fig)


def write(report: dict, out: Path, with_plots: bool) -> None:
    write_text_atomically(out / "study.json", json.dumps(report, indent=1))
    write_text_atomically(out / "study.md", markdown(report) + "\n")
    if with_plots:
        plots(report, out)


# ----- main ------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny-llada", "tiny-dream"])
    p.add_argument("--problems", type=int, default=256)
    p.add_argument("--probe-problems", type=int, default=64, help="problems of each probe run (0: no probe)")
    p.add_argument("--seed", type=int, default=tiny_tasks.HELD_OUT_SEED)
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="track_num values (blocks)")
    p.add_argument("--rules", nargs="+", choices=TRACK_RULES, default=list(TRACK_RULES))
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--mask-num", type=int, default=4)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--out", type=Path, default=Path("out/tracking"))
    p.add_argument("--resume", action="store_true", help="keep the runs of --out/study.json made with the same options")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="only combine the study.json of earlier runs (e.g. one process per model) into --out",
    )
    args = p.parse_args(argv)
    if args.problems <= 0 or args.probe_problems < 0 or min(args.budgets) < 0:
        p.error("--problems must be positive, --probe-problems and --budgets not negative")
    return args


def merge(paths: list[Path], out: Path, with_plots: bool) -> dict:
    """One report of several runs' study.json (their models side by side; the options of the first)."""
    reports = [json.loads((p / "study.json" if p.is_dir() else p).read_text()) for p in paths]
    merged = {**reports[0], "models": {}, "command": [r["command"] for r in reports]}
    for r in reports:
        merged["models"].update(r["models"])
    out.mkdir(parents=True, exist_ok=True)
    write(merged, out, with_plots)
    return merged


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        print(markdown(merge(args.merge, args.out, not args.no_plots)))
        return 0
    import jax

    from dllm_jax.engine.engine import Engine

    options = Options(args.gen_length, args.batch_size, args.mask_num, args.threshold)
    report = {
        "problems": args.problems,
        "probe_problems": min(args.probe_problems, args.problems),
        "seed": args.seed,
        "options": dataclasses.asdict(options),
        "device": str(jax.devices()[0].device_kind),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "scripts/tracking_study.py", *(argv if argv is not None else sys.argv[1:])]),
        "models": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    previous = _previous(args.out / "study.json", report) if args.resume else {}
    problems = tiny_tasks.held_out_problems(args.problems, seed=args.seed)
    rng = np.random.default_rng(0)
    for model in args.models:
        engine = Engine.from_pretrained(model, dtype="float32", backend="xla")
        m = report["models"].setdefault(model, previous.get(model, {"runs": {}, "probes": {}}))
        m.setdefault("probes", {})
        sampling = lambda rule: SamplingParams(threshold=args.threshold, track_rule=rule)  # noqa: E731
        if "exact" not in m:
            m["exact"] = decode_problems(
                engine, problems, options.decode_config(-1), SamplingParams(threshold=args.threshold), None
            )
            print(f"{model} exact: {m['exact']['accuracy']:.3f}", flush=True)
            write(report, args.out, False)
        exact_texts = m["exact"]["texts"]
        for budget in args.budgets:
            for rule in args.rules if budget else ["attention"]:
                key = f"{budget}/{rule}"
                if key in m["runs"]:
                    continue
                m["runs"][key] = decode_problems(
                    engine, problems, options.decode_config(budget), sampling(rule), exact_texts
                )
                r = m["runs"][key]
                print(
                    f"{model} {key}: {r['accuracy']:.3f} agree {r['agreement_with_exact']:.3f} steps {r['steps']}",
                    flush=True,
                )
                write(report, args.out, False)
        # loops compiled for this model's decodes in this call: one per budget (and the exact one)
        m["compiled_loops"] = engine.num_compilations
        if report["probe_problems"]:
            ids = engine.encode([p.prompt for p in problems], chat=True)
            longest = max(map(len, ids))
            ids = ids[: report["probe_problems"]]
            pooled = []
            for budget in [b for b in args.budgets if b > 0]:
                for rule in [r for r in args.rules if r in PROBED_RULES]:
                    key = f"{budget}/{rule}"
                    records = probe_run(engine, ids, longest, options.decode_config(budget), sampling(rule))
                    pooled += records
                    m["probes"][key] = summarise_probe(records)
                    print(f"{model} probe {key}: {m['probes'][key]['slot_steps']} slot steps", flush=True)
                    write(report, args.out, False)
            if pooled:
                m["probe_all"] = summarise_probe(pooled)
                m["plot_sample"] = plot_sample(pooled, rng, PLOT_POINTS)
        write(report, args.out, not args.no_plots)
    print(markdown(report))
    return 0


def _previous(path: Path, report: dict) -> dict:
    """The models of an earlier study.json of the same options (the probes are always rerun)."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    same = all(old.get(k) == report[k] for k in ("problems", "seed", "options", "probe_problems"))
    if not same:
        raise SystemExit(f"--resume: {path} was made with other options")
    return {name: {**m, "probes": {}} for name, m in old.get("models", {}).items()}


if __name__ == "__main__":
    sys.exit(main())
