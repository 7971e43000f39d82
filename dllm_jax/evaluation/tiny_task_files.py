"""lm-eval tasks over the embedded tiny model's held-out problems, as local files (no Hub).

    python -m dllm_jax.evaluation.tiny_task_files --out /tmp/tiny_tasks --problems 64

writes into one folder (pass it to lm-eval as ``--include_path``):

* ``tiny_problems.jsonl``: one held-out problem per line (dllm_jax.evaluation.tiny_tasks): task, prompt,
  answer, final, and for the multiple-choice task the answer among three wrong ones
  (``choices``, ``label``; see wrong_answers);
* ``tiny_gen.yaml``: ``generate_until`` over the prompts, stopped at the end-of-turn token
  (``--end-of-turn``: tiny-llada's ``<|eot_id|>`` by default, tiny-diffusiongemma's is
  ``<end_of_turn>``), scored as scripts/eval.py scores (the text after the last ``####`` equals
  the final answer);
* ``tiny_mc.yaml``: ``multiple_choice`` over the full answers (each ending with the end-of-turn
  token, as the model writes them), scored by ``acc`` through loglikelihood;
* ``tiny_task_scoring.py``: the generative task's process_results.

The tiny models were trained on chat-formatted prompts: evaluate with ``--apply_chat_template``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from dllm_jax.common.atomic_write import write_text_atomically
from dllm_jax.evaluation import tiny_tasks

GEN_TASK = "tiny_gen"
MC_TASK = "tiny_mc"
END_OF_TURN = "<|eot_id|>"
_DISTRACTORS = 3

_SCORING = '''"""process_results of the tiny_gen task: exact match of the final answer (scripts/eval.py's rule)."""

from dllm_jax.evaluation import tiny_tasks


def process_results(doc, results):
    return {"exact_match": float(tiny_tasks.extract_final(results[0]) == doc["final"])}
'''

_GEN_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{final}}}}"
generation_kwargs:
  until: ["{eot}"]
  do_sample: false
  temperature: 0.0
process_results: !function tiny_task_scoring.process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

_MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def wrong_answers(problem: tiny_tasks.Problem, rng: random.Random) -> list[str]:
    """Three distinct answers that differ from the right one only in its result.

    arith: the last step gets another value with as many digits, preferring values that
    appear nowhere else in the problem (so the choice tests the arithmetic, not copying a
    number or a length); sort: two different digits swapped (or, all digits equal, one changed).
    """
    lines = problem.answer.split("\n")
    wrong: list[str] = []
    if problem.task == "arith":
        step, _ = lines[-2].rsplit("=", 1)
        seen = set(re.findall(r"[0-9]+", problem.prompt + "\n" + problem.answer))
        same_length = [v for v in range(100) if len(str(v)) == len(problem.final) and str(v) != problem.final]
        fresh = [v for v in same_length if str(v) not in seen]
        rng.shuffle(fresh)
        values = (fresh + [v for v in same_length if v not in fresh])[:_DISTRACTORS]
        for value in values:
            wrong.append("\n".join(lines[:-2] + [f"{step}={value}", f"{tiny_tasks.FINAL_MARKER} {value}"]))
    else:
        digits = lines[0].split(" ")
        swaps = [(i, j) for i in range(len(digits)) for j in range(i + 1, len(digits)) if digits[i] != digits[j]]
        rng.shuffle(swaps)
        for i, j in swaps[:_DISTRACTORS]:
            d = list(digits)
            d[i], d[j] = d[j], d[i]
            wrong.append(" ".join(d) + f"\n{tiny_tasks.FINAL_MARKER} {''.join(d)}")
        while len(wrong) < _DISTRACTORS:  # all digits equal: change one of them instead
            d = list(digits)
            d[len(wrong)] = str((int(d[len(wrong)]) + 1 + len(wrong)) % 10)
            wrong.append(" ".join(d) + f"\n{tiny_tasks.FINAL_MARKER} {''.join(d)}")
    return wrong


def problem_records(problems: int, seed: int = tiny_tasks.HELD_OUT_SEED, end_of_turn: str = END_OF_TURN) -> list[dict]:
    """The JSONL records: each problem with its right answer at a random position among wrong ones."""
    rng = random.Random(seed)
    records = []
    for p in tiny_tasks.held_out_problems(problems, seed=seed):
        choices = [a + end_of_turn for a in wrong_answers(p, rng)]
        label = rng.randrange(len(choices) + 1)
        choices.insert(label, p.answer + end_of_turn)
        records.append(
            {
                "task": p.task,
                "prompt": p.prompt,
                "answer": p.answer,
                "final": p.final,
                "choices": choices,
                "label": label,
            }
        )
    return records


def write_tiny_tasks(
    folder: str | Path, problems: int, seed: int = tiny_tasks.HELD_OUT_SEED, end_of_turn: str = END_OF_TURN
) -> Path:
    """Writes the data, the two task YAMLs and the scoring module into folder; returns it.
    end_of_turn: the text of the model's end-of-turn token (the stop string, and each choice's end)."""
    if problems < 1:
        raise ValueError(f"problems={problems}: expected >= 1")
    folder = Path(folder).resolve()
    data = folder / "tiny_problems.jsonl"
    records = problem_records(problems, seed, end_of_turn)
    write_text_atomically(data, "".join(json.dumps(r) + "\n" for r in records))
    write_text_atomically(folder / "tiny_task_scoring.py", _SCORING)
    write_text_atomically(
        folder / f"{GEN_TASK}.yaml",
        _GEN_YAML.format(task=GEN_TASK, data=json.dumps(str(data)), eot=json.dumps(end_of_turn)[1:-1]),
    )
    write_text_atomically(folder / f"{MC_TASK}.yaml", _MC_YAML.format(task=MC_TASK, data=json.dumps(str(data))))
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Writes lm-eval tasks over the tiny model's held-out problems.")
    p.add_argument("--out", type=Path, required=True, help="folder to write (lm-eval --include_path)")
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--seed", type=int, default=tiny_tasks.HELD_OUT_SEED)
    p.add_argument(
        "--end-of-turn",
        default=END_OF_TURN,
        help=f"the model's end-of-turn token as text (default {END_OF_TURN}, tiny-llada's; tiny-diffusiongemma: "
        "<end_of_turn>)",
    )
    args = p.parse_args(argv)
    if args.problems < 1:
        p.error("--problems must be >= 1")
    if not args.end_of_turn:
        p.error("--end-of-turn must not be empty")
    folder = write_tiny_tasks(args.out, args.problems, args.seed, args.end_of_turn)
    print(f"--include_path {folder} --tasks {GEN_TASK},{MC_TASK}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
