"""Synthetic tasks of the embedded tiny model, generated on the fly, each with an exact answer.

Two tasks with different dependency shapes:

* ``arith``: a chain of 2-4 operations on small integers, written as one expression with the
  fewest parentheses; the answer works it out left to right, one line per step, every
  intermediate value in [0, 20] (GSM8K in miniature: each line depends on the one above)::

      prompt  "(3+2)*4-7"
      answer  "3+2=5\\n5*4=20\\n20-7=13\\n#### 13"

* ``sort``: sort 4-10 digits; the answer lists them sorted, then joins them (every output
  position depends on the whole input, none on a previous line)::

      prompt  "sort: 5 3 9 1 5"
      answer  "1 3 5 5 9\\n#### 13559"

Held-out problems never appear in training: a problem belongs to the held-out split iff a
stable hash of its prompt falls in the lowest ``HELD_OUT_PER_MILLE`` of 1000 buckets (the prompt
determines the problem). The training stream skips those problems whatever its seed; the
held-out stream keeps only them and is drawn from its own seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Iterator, Mapping

TASKS = ("arith", "sort")
SPLITS = ("train", "heldout")
HELD_OUT_PER_MILLE = 100
HELD_OUT_SEED = 20_260_926
FINAL_MARKER = "####"

# Larger values (up to 99 was tried) leave too many facts for a CPU-sized run to learn.
_MAX_VALUE = 20
_ARITH_OPS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: the user text, the full answer text and the final answer it ends with."""

    task: str
    prompt: str
    answer: str
    final: str


def _apply(x: int, op: str, y: int) -> int:
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    return x * y


def make_arith(rng: random.Random) -> Problem:
    """A chain x0 op1 y1 op2 y2 ... evaluated left to right, every value in [0, 20]."""
    value = rng.randint(1, 20)
    expr, top_op = str(value), None
    steps = []
    for _ in range(rng.randint(2, 4)):
        choices = [
            (op, y)
            for op in _ARITH_OPS
            for y in range(2 if op == "*" else 1, 10)
            if 0 <= _apply(value, op, y) <= _MAX_VALUE
        ]
        op, y = rng.choice(choices)
        # The printed expression must evaluate, with the usual precedence, to the left-to-right chain.
        if op == "*" and top_op in ("+", "-"):
            expr = f"({expr})"
        expr, top_op = f"{expr}{op}{y}", op
        result = _apply(value, op, y)
        steps.append(f"{value}{op}{y}={result}")
        value = result
    final = str(value)
    return Problem("arith", expr, "\n".join(steps) + f"\n{FINAL_MARKER} {final}", final)


def make_sort(rng: random.Random) -> Problem:
    """Sort 4-10 random digits (repeats allowed)."""
    digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(4, 10))]
    ordered = sorted(digits)
    final = "".join(ordered)
    return Problem("sort", "sort: " + " ".join(digits), " ".join(ordered) + f"\n{FINAL_MARKER} {final}", final)


_MAKERS = {"arith": make_arith, "sort": make_sort}


def is_held_out(prompt: str) -> bool:
    """True iff the problem with this prompt belongs to the held-out split (stable across runs)."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1000 < HELD_OUT_PER_MILLE


def problems(split: str, seed: int, mix: Mapping[str, float] | None = None) -> Iterator[Problem]:
    """An endless, seed-determined stream of problems of one split.

    Args:
      split: "train" (never yields a held-out problem) or "heldout" (only held-out problems,
        each prompt at most once).
      seed: seeds the stream; the same seed gives the same problems in the same order.
      mix: task name -> relative weight; default equal weights over TASKS.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    mix = dict(mix) if mix is not None else {task: 1.0 for task in TASKS}
    unknown = set(mix) - set(TASKS)
    if unknown or not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
        raise ValueError(f"mix={mix!r}: expected non-negative weights over {TASKS}, not all zero")
    names, weights = list(mix), list(mix.values())
    rng = random.Random(f"{split}:{seed}")
    seen: set[str] = set()
    want_held_out = split == "heldout"
    while True:
        problem = _MAKERS[rng.choices(names, weights)[0]](rng)
        if is_held_out(problem.prompt) != want_held_out:
            continue
        if want_held_out:
            if problem.prompt in seen:
                continue
            seen.add(problem.prompt)
        yield problem


def held_out_problems(n: int, seed: int = HELD_OUT_SEED, mix: Mapping[str, float] | None = None) -> list[Problem]:
    """The first n distinct held-out problems of the held-out stream."""
    stream = problems("heldout", seed, mix)
    return [next(stream) for _ in range(n)]


def extract_final(generated_text: str) -> str | None:
    """The final answer: the text after the last "####" up to the end of that line, stripped."""
    _, marker, tail = generated_text.rpartition(FINAL_MARKER)
    if not marker:
        return None
    return tail.strip().split("\n", 1)[0].strip()


def is_correct(problem: Problem, generated_text: str) -> bool:
    """Exact match of the generated final answer with the problem's."""
    return extract_final(generated_text) == problem.final
