import itertools
import random

import pytest

from dllm_jax.evaluation import tiny_tasks
from dllm_jax.evaluation.tiny_tasks import Problem, extract_final, held_out_problems, is_correct, is_held_out, problems

pytestmark = pytest.mark.unit


def take(stream, n):
    return list(itertools.islice(stream, n))


def test_streams_are_deterministic_per_seed():
    assert take(problems("train", 3), 50) == take(problems("train", 3), 50)
    assert take(problems("train", 3), 50) != take(problems("train", 4), 50)
    assert held_out_problems(30) == held_out_problems(30)


def test_held_out_problems_never_appear_in_training():
    held_out = held_out_problems(300)
    assert len({p.prompt for p in held_out}) == 300
    assert all(is_held_out(p.prompt) for p in held_out)
    # The training stream of any seed skips the held-out bucket, including the held-out seed itself.
    train = [p for seed in (0, 1, tiny_tasks.HELD_OUT_SEED) for p in take(problems("train", seed), 3000)]
    assert not any(is_held_out(p.prompt) for p in train)
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    # the held-out bucket is about a tenth of the problems the generators make
    rng = random.Random(0)
    raw = [maker(rng) for _ in range(2000) for maker in (tiny_tasks.make_arith, tiny_tasks.make_sort)]
    assert 0.07 < sum(is_held_out(p.prompt) for p in raw) / len(raw) < 0.13


def test_both_tasks_occur_and_the_mix_is_honoured():
    mixed = take(problems("train", 0), 400)
    assert {p.task for p in mixed} == set(tiny_tasks.TASKS)
    assert {p.task for p in take(problems("train", 0, mix={"sort": 1.0}), 50)} == {"sort"}


def test_arithmetic_steps_are_correct():
    for p in take(problems("train", 7, mix={"arith": 1.0}), 500):
        # the printed expression, with the usual precedence, equals the final answer
        assert eval(p.prompt) == int(p.final)
        *steps, last = p.answer.split("\n")
        assert 2 <= len(steps) <= 4 and last == f"#### {p.final}"
        previous = None
        for line in steps:
            lhs, result = line.split("=")
            assert eval(lhs) == int(result) and 0 <= int(result) <= 20
            if previous is not None:
                assert lhs.startswith(previous)  # each step continues from the previous result
            previous = result
        assert previous == p.final


def test_sort_answers_are_sorted_digits():
    for p in take(problems("train", 7, mix={"sort": 1.0}), 200):
        digits = p.prompt.removeprefix("sort: ").split(" ")
        assert 4 <= len(digits) <= 10
        assert p.answer == " ".join(sorted(digits)) + f"\n#### {''.join(sorted(digits))}"


def test_is_correct_is_an_exact_match_of_the_last_final_answer():
    p = Problem("arith", "(7+5)*3-9", "7+5=12\n12*3=36\n36-9=27\n#### 27", "27")
    assert is_correct(p, p.answer)
    assert is_correct(p, "7+5=12\n#### 12\n#### 27 \n")
    assert not is_correct(p, "7+5=12\n12*3=36\n36-9=27\n#### 270")
    assert not is_correct(p, "7+5=12\n12*3=36\n36-9=27\n27")
    assert not is_correct(p, "")
    assert extract_final("x\n####  1 2\nmore") == "1 2"


@pytest.mark.parametrize("split,mix", [("test", None), ("train", {"poetry": 1.0}), ("train", {"sort": 0.0})])
def test_bad_stream_arguments_are_refused(split, mix):
    with pytest.raises(ValueError):
        next(problems(split, 0, mix))
