"""The prompts the pages feature for the embedded tiny models are ones the models answer right:
every arithmetic chain keeps each step within the trained range [0, 20] (dllm_jax.evaluation.
tiny_tasks), and both models answer every featured prompt exactly, as the pages show it. The
playground's hint says in one line what the models can do."""

import re
from pathlib import Path

import pytest

from dllm_jax import DecodeConfig, Engine
from dllm_jax.models.embedded import tiny_model_path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "dllm_jax" / "serve" / "static" / "index.html",
    *sorted((ROOT / "dllm_jax" / "assets").glob("*/README.md")),
    ROOT / "dllm_jax" / "evaluation" / "tiny_tasks.py",
]
# a chain of two or more operations ("13+5-1-9", "(3+2)*4-7"), not a step of a worked answer
# ("3+2=5") nor a date ("2026-12-01": no + or *)
CHAIN = re.compile(r"(?<![\w=*+\-()])(?=[\d()\-]*[+*])\(?\d+\)?(?:[+\-*]\(?\d+\)?){2,}(?![\w=])")
SORT = re.compile(r"sort: \d(?: \d)+")
LOW, HIGH = 0, 20  # every value of a chain the models were trained on


def featured() -> dict[str, list[str]]:
    """Each featured prompt and the pages that show it."""
    prompts: dict[str, list[str]] = {}
    for page in PAGES:
        text = page.read_text()
        for prompt in CHAIN.findall(text) + SORT.findall(text):
            prompts.setdefault(prompt, []).append(page.relative_to(ROOT).as_posix())
    return prompts


def worked_answer(prompt: str) -> str:
    """The answer the tiny tasks train for: the chain left to right, one line per step, or the
    sorted digits; a step outside [0, 20] fails the test (the models never saw one)."""
    if prompt.startswith("sort: "):
        digits = sorted(prompt.removeprefix("sort: ").split())
        return f"{' '.join(digits)}\n#### {''.join(digits)}"
    tokens = re.findall(r"\d+|[+\-*]", prompt)
    value, lines = int(tokens[0]), []
    for op, operand in zip(tokens[1::2], map(int, tokens[2::2])):
        result = {"+": value + operand, "-": value - operand, "*": value * operand}[op]
        assert LOW <= result <= HIGH, f"{prompt!r}: the step {value}{op}{operand}={result} leaves [{LOW}, {HIGH}]"
        lines.append(f"{value}{op}{operand}={result}")
        value = result
    assert eval(prompt) == value, f"{prompt!r} does not read as the left-to-right chain"  # noqa: S307 (digits and + - * only)
    return "\n".join(lines) + f"\n#### {value}"


def test_the_pages_feature_both_tasks():
    prompts = featured()
    assert any(p.startswith("sort: ") for p in prompts) and any(CHAIN.fullmatch(p) for p in prompts), prompts
    assert {"13+5-1-9", "sort: 3 9 1 4", "(3+2)*4-7"} <= prompts.keys()


@pytest.mark.parametrize("prompt", sorted(featured()))
def test_every_featured_chain_stays_in_the_trained_range(prompt):
    worked_answer(prompt)


@pytest.mark.integration  # full tier: whole decodes of every featured prompt on both tiny models
@pytest.mark.parametrize("model", ["tiny-llada", "tiny-dream"])
def test_the_models_answer_every_featured_prompt(model):
    prompts = sorted(featured())
    engine = Engine.from_pretrained(tiny_model_path(model))
    out = engine.generate(prompts, decode_config=DecodeConfig(gen_length=64, batch_size=len(prompts)), chat=True)
    wrong = {p: r.text for p, r in zip(prompts, out.results) if r.text != worked_answer(p)}
    assert not wrong, f"{model} answers these featured prompts wrong: {wrong}"


def test_the_playground_says_in_one_line_what_the_model_can_do():
    page = (ROOT / "dllm_jax" / "serve" / "static" / "index.html").read_text()
    (hint,) = re.findall(r'<p class="hint">(.*?)</p>', page, flags=re.S)
    assert "sorts" in hint and "within 0-20" in hint
    assert SORT.search(hint) and CHAIN.search(hint)
