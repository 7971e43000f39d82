"""The code blocks of README.md and docs/*.md, extracted from the pages and run as printed, so
the pages and the code cannot drift.

Every ```bash and ```python block runs, section (``## `` heading) by section, each section in
its own empty folder (blocks of a section share it, in order: docs/conversion.md's loading
block loads what its conversion wrote). A ```text block right after a code block is that
block's expected stdout. What is not run as printed, and why:

* the Quick start's install segment (``python3 -m venv ... && .venv/bin/pip install ...``)
  and its test-suite line (``.venv/bin/python -m pytest``): the test runs inside that suite.
  The segment after the install (``.venv/bin/dllm-generate ...``) runs as printed.
* console scripts: the folder holds ``.venv/bin/dllm-generate`` and ``.venv/bin/dllm-convert``
  (also on PATH), which run ``python -m dllm_jax.cli.generate`` / ``python -m convert.hf_to_jax``
  from this checkout, as pip's wrappers would from an installed one.
* the placeholder ``PATH/TO/LLaDA-8B-Instruct`` (a Hugging Face LLaDA folder) is replaced by
  the embedded tiny model's folder, which is one.
* ``python`` is the suite's interpreter (a shim in the folder's ``.venv/bin``, first on PATH,
  as in an activated virtual environment), and ``pretrained=dllm_jax/assets/tiny-llada`` (the
  embedded model, relative to the checkout) names the checkout's folder.
* a block whose first line is ``# needs: ...`` says what it needs that a test machine does not
  have (a model's real weights and the Hub's datasets; a server left running in a terminal;
  a GPU): it is not run; the tests named in the page run its equivalents.
* a ```text block that follows no code block (a usage summary, a layout) is not run.
* the processes see 4 CPU devices (JAX_NUM_CPU_DEVICES=4), as the rest of the suite does.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_jax.models.embedded import tiny_model_path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = {
    "PATH/TO/LLaDA-8B-Instruct": str(tiny_model_path()),
    "pretrained=dllm_jax/assets/tiny-llada": f"pretrained={tiny_model_path()}",
}
NEEDS = "# needs: "
SCRIPTS = {"dllm-generate": "dllm_jax.cli.generate", "dllm-convert": "convert.hf_to_jax"}
INSTALL_PREFIX = "python3 -m venv .venv && .venv/bin/pip install"
SUITE_COMMAND = ".venv/bin/python -m pytest"
RUN = {"bash", "python"}

pytestmark = pytest.mark.integration  # every block starts a process that compiles a decode loop


def page_blocks(page: Path) -> dict[str, list[dict]]:
    """Section title -> its code blocks in order: {"lang", "code", "expected" (the next text block or None)}."""
    sections: dict[str, list[dict]] = {}
    title, fence, lines = None, None, []
    for line in page.read_text().splitlines():
        if fence is None and line.startswith("## "):
            title = line[3:].strip()
        elif fence is None and line.startswith("```"):
            fence, lines = line[3:].strip(), []
        elif fence is not None and line == "```":
            blocks = sections.setdefault(title, [])
            code = "\n".join(lines) + "\n"
            if fence == "text" and blocks and blocks[-1]["lang"] in RUN and blocks[-1]["expected"] is None:
                blocks[-1]["expected"] = code
            else:
                blocks.append({"lang": fence, "code": code, "expected": None})
            fence = None
        elif fence is not None:
            lines.append(line)
    return sections


def runs(block: dict) -> bool:
    return block["lang"] in RUN and not block["code"].startswith(NEEDS)


SECTIONS = [
    (page.relative_to(ROOT).as_posix(), title)
    for page in PAGES
    for title, blocks in page_blocks(page).items()
    if any(runs(b) for b in blocks)
]


def test_the_pages_have_the_blocks_this_test_runs():
    assert {
        ("README.md", "Quick start"),
        ("README.md", "Generating"),
        ("README.md", "The library"),
        ("docs/conversion.md", "Converting a checkpoint"),
        ("docs/kernels.md", "Several devices"),
    } <= set(SECTIONS)
    quick = page_blocks(ROOT / "README.md")["Quick start"][0]["code"].splitlines()
    assert quick[0].startswith(INSTALL_PREFIX) and ".venv/bin/dllm-generate" in quick[0]
    assert quick[1].startswith(SUITE_COMMAND)


def test_every_skipped_block_says_what_it_needs():
    for page in PAGES:
        for title, blocks in page_blocks(page).items():
            for block in blocks:
                if block["lang"] in RUN and block["code"].startswith(NEEDS):
                    assert len(block["code"].splitlines()[0]) > len(NEEDS) + 10, (
                        f"{page.name}, {title}: say what the block needs"
                    )


def as_run(code: str) -> str:
    """The block as the test runs it: the Quick start's install and suite commands left out."""
    lines = []
    for line in code.splitlines():
        if line.startswith(SUITE_COMMAND):
            continue
        if line.startswith(INSTALL_PREFIX):
            line = " && ".join(s for s in line.split(" && ") if s.startswith(".venv/bin/dllm-"))
        for placeholder, value in PLACEHOLDERS.items():
            line = line.replace(placeholder, value)
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def compilation_cache():
    """The session's JAX compilation cache (tests/conftest.py) for the blocks' processes: blocks
    that decode as another block or test did compile once (a speed-up only; every block still
    runs in full)."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.fixture
def workdir(tmp_path, compilation_cache):
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, module in SCRIPTS.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        script.chmod(0o755)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "4",
        "JAX_COMPILATION_CACHE_DIR": str(compilation_cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    return tmp_path, env


@pytest.mark.parametrize("page, section", SECTIONS, ids=[f"{p}: {s}" for p, s in SECTIONS])
def test_section_runs_as_printed(page, section, workdir):
    cwd, env = workdir
    for block in page_blocks(ROOT / page)[section]:
        if not runs(block):
            continue
        code = as_run(block["code"])
        command = ["bash", "-euo", "pipefail", "-c", code] if block["lang"] == "bash" else [sys.executable, "-c", code]
        result = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600
        )
        assert result.returncode == 0, f"{page}, {section}: {code}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, result.stderr
        if block["expected"] is not None:
            assert result.stdout.strip() == block["expected"].strip(), f"{page}, {section}: {code}"
    if (page, section) == ("README.md", "Generating"):
        check_answers(cwd / "answers.jsonl")


def check_answers(path: Path) -> None:
    """The Generating section's output: ids kept, and the embedded model's right answers."""
    import json

    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in records] == ["q1", "q2"]
    assert records[0]["text"].endswith("#### 8") and records[1]["text"].endswith("#### 1349")
