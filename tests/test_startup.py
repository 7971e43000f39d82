"""What a new user meets first: --model resolved one way by every command (a Hub id in the local
cache too), input checked before JAX is imported, compiled loops kept for the next run, and the
pages' commands those of the installed tools."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from dllm_jax.models.embedded import tiny_model_path

ROOT = Path(__file__).resolve().parent.parent
REPO_ID = "acme/tiny-llada"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache (as huggingface_hub lays it out) holding REPO_ID: the embedded
    model's Hugging Face folder as a snapshot."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(tiny_model_path(), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


class Loaded(Exception):
    """Raised instead of loading: the test has seen what would be loaded."""


# ----- --model, one way everywhere (34.1) ----------------------------------------------------------


def test_dllm_serve_loads_a_hub_id_from_the_local_cache(offline_cache, monkeypatch):
    from dllm_jax.engine.engine import Engine
    from dllm_jax.serve.cli import build, parse_args

    def from_pretrained(path, **kwargs):
        raise Loaded(path)

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    with pytest.raises(Loaded) as loaded:
        build(parse_args(["--model", REPO_ID]))
    assert Path(str(loaded.value)) == offline_cache / f"models--acme--tiny-llada/snapshots/{COMMIT}"


def test_dllm_generate_and_dllm_serve_resolve_the_same_names(offline_cache, monkeypatch):
    import dllm_jax.cli.generate
    import dllm_jax.serve.cli

    assert dllm_jax.cli.generate.resolve_model_path is dllm_jax.serve.cli.resolve_model_path
    resolve = dllm_jax.serve.cli.resolve_model_path
    assert resolve(REPO_ID).name == COMMIT
    assert resolve(None) == resolve("tiny-llada") == tiny_model_path()
    assert resolve(str(tiny_model_path())) == tiny_model_path()


def test_a_hub_id_missing_from_the_offline_cache_is_one_line_in_dllm_serve(offline_cache, capsys):
    from dllm_jax.serve.cli import main

    assert main(["--model", "acme/not-downloaded"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dllm-serve: acme/not-downloaded: not a local folder and not in the Hugging Face cache")
    assert err[-1].endswith("HF_HUB_OFFLINE is set, so it was not downloaded")


def test_the_served_name_of_a_hub_id_is_the_id():
    from dllm_jax.serve.cli import served_name

    assert served_name(REPO_ID, Path(f"/cache/snapshots/{COMMIT}")) == REPO_ID
    assert served_name(None, tiny_model_path()) == "tiny-llada"
    assert served_name(str(tiny_model_path()), tiny_model_path()) == "tiny-llada"


@pytest.mark.parametrize("module", ["dllm_jax.cli.generate", "dllm_jax.serve"])
def test_every_command_says_how_model_is_resolved(module):
    from dllm_jax.models.model_source import MODEL_HELP

    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    text = "".join(result.stdout.split())  # argparse wraps lines, also at hyphens
    assert "".join(MODEL_HELP.split()) in text
    assert "HuggingFaceHubid" in text and "HF_HUB_OFFLINE=1" in text


# ----- input checked before JAX is imported (34.5) ------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "x", "--steps", "3"], "steps=3 does not apply to method='flash_cache'"),
        (["--prompt", "x", "--model", "/nonexistent"], "/nonexistent: model folder not found"),
        (["--prompts-file", "/nonexistent.jsonl"], "prompts file not found"),
        (["--prompt", "sort: " + "9 " * 200], "--prompt 1: the prompt has"),
        (["--prompt", "x", "--output", "/nonexistent/a.jsonl"], "the folder /nonexistent does not exist"),
        (
            ["--prompt", "x", "--method", "llada", "--gen-length", "60"],
            "gen_length=60 is not a multiple of block_length=32",
        ),
    ],
)
def test_bad_input_is_reported_before_jax_is_imported(args, message):
    code = (
        "import sys; from dllm_jax.cli.generate import main; code = main(sys.argv[1:]); "
        "print(code, 'jax' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert result.stdout.split() == ["2", "False", "False"], result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


# ----- the compilation cache (34.5) ----------------------------------------------------------------


def test_the_cache_folder_follows_flags_then_the_variable_then_xdg(monkeypatch, tmp_path):
    from dllm_jax.runtime import compile_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(compile_cache.CACHE_ENV, raising=False)
    assert compile_cache.cache_dir_setting(None, False) == tmp_path / "xdg" / "dllm_jax" / "compiled"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.cache_dir_setting(None, False) == Path.home() / ".cache" / "dllm_jax" / "compiled"
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache.cache_dir_setting(None, False) == tmp_path / "mine"
    assert compile_cache.cache_dir_setting(str(tmp_path / "flag"), False) == tmp_path / "flag"
    assert compile_cache.cache_dir_setting(str(tmp_path / "flag"), True) is None
    for off in ("off", "0", "OFF", ""):
        monkeypatch.setenv(compile_cache.CACHE_ENV, off)
        assert compile_cache.cache_dir_setting(None, False) is None


def _generate(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {
        k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "DLLM_JAX_COMPILE_CACHE")
    }
    environment.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_LOG_COMPILES="1", **env)
    result = subprocess.run(
        [sys.executable, "-m", "dllm_jax.cli.generate", "--prompt", "sort: 3 9 1 4", "--no-progress", *args],
        capture_output=True,
        text=True,
        env=environment,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    assert result.returncode == 0 and result.stdout.startswith("### [0] sort: 3 9 1 4\n1 3 4 9\n"), result.stderr
    return result


def _hits(result: subprocess.CompletedProcess) -> int:
    return result.stderr.count("Persistent compilation cache hit for")


def test_the_second_run_reads_its_loops_from_the_cache(tmp_path):
    first = _generate(tmp_path)
    cache = tmp_path / "xdg" / "dllm_jax" / "compiled"
    programs = sorted(p.name for p in cache.glob("*-cache"))  # JAX's entries: NAME-KEY-cache (and -atime)
    assert _hits(first) == 0 and any(name.startswith("jit_loop_call-") for name in programs), programs
    second = _generate(tmp_path)
    assert _hits(second) == len(programs)  # every program compiled by the first run, read back
    assert sorted(p.name for p in cache.glob("*-cache")) == programs


def test_no_compile_cache_stores_nothing(tmp_path):
    result = _generate(tmp_path, "--no-compile-cache")
    assert _hits(result) == 0 and not (tmp_path / "xdg").exists()


# ----- the pages' commands (34.2, 34.11) ----------------------------------------------------------


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_pages_name_the_hub_cli_that_is_installed():
    text = "\n".join(page.read_text() for page in PAGES)
    assert "huggingface-cli" not in text  # huggingface_hub >= 1.0: "deprecated and no longer works. Use hf instead"
    commands = set(re.findall(r"`hf (\w+)", text))
    assert commands, "the pages say how to fill the Hugging Face cache"
    for command in commands:
        result = subprocess.run(
            [sys.executable, "-c", "from huggingface_hub.cli.hf import main; main()", command, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"hf {command}: {result.stderr[-500:]}"


def test_gitignore_covers_what_the_pages_examples_write():
    written = set()
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            written |= set(re.findall(r"> ([\w.-]+)\s*$", block, flags=re.M))
            written |= set(re.findall(r"--(?:output|out) ([\w.-]+)", block))
    assert {"questions.jsonl", "answers.jsonl", "tiny_tasks"} <= written
    result = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"],
        input="\n".join(sorted(written)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode == 128:
        pytest.skip(f"not a git checkout: {result.stderr.strip()}")
    assert set(result.stdout.split()) == written
