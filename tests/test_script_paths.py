"""scripts/gpu/repo_root.py: a script run with PYTHONPATH naming another tree imports that
tree's packages (the BENCHMARKS A/B against an older tree in .old/), not this checkout's.

Until 2026-12-08 the scripts put the checkout's root at sys.path[0], ahead of PYTHONPATH (the
GPU scripts themselves, and scripts/profile_step.py and bench.py again when a GPU script
imported them), so "PYTHONPATH=$PWD/.old python3 scripts/gpu/NAME.py" measured this checkout a
second time."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_SCRIPTS = ROOT / "scripts" / "gpu"


def _other_tree(tmp_path: Path) -> Path:
    """A tree whose dllm_jax and pallas_kernels stop the process, naming the tree, on import."""
    tree = tmp_path / "old"
    for package in ("dllm_jax", "pallas_kernels"):
        (tree / package).mkdir(parents=True)
        (tree / package / "__init__.py").write_text(f"raise SystemExit('imported the other tree: {package}')\n")
    return tree


def _run(args: list[str], tree: Path | None, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


SCRIPTS = sorted([*(ROOT / "scripts").glob("*.py"), *GPU_SCRIPTS.glob("*.py")])
# at module level: the packages a tree provides, or a script module that imports them
TREE_IMPORT = re.compile(r"^(from|import) (dllm_jax|pallas_kernels|bench|profile_step)\b", re.MULTILINE)


@pytest.mark.unit
def test_every_script_that_sets_sys_path_leaves_pythonpath_first():
    """No script in scripts/ or scripts/gpu puts a folder at sys.path[0] at module level, and
    every one that touches sys.path calls put_checkout_on_path (step_against_old_tree.py puts
    its --tree there on purpose)."""
    offenders = []
    for script in SCRIPTS:
        if script.name in ("repo_root.py", "step_against_old_tree.py"):
            continue
        text = script.read_text()
        if re.search(r"^sys\.path\.insert\(0,", text, re.MULTILINE) or (
            "sys.path" in text and "put_checkout_on_path()" not in text
        ):
            offenders.append(script.name)
    assert offenders == []


@pytest.mark.integration
@pytest.mark.parametrize(
    "script", [s for s in sorted(GPU_SCRIPTS.glob("*.py")) if TREE_IMPORT.search(s.read_text())], ids=lambda s: s.name
)
def test_a_gpu_script_imports_the_tree_on_pythonpath(tmp_path, script):
    """Directly or through the script modules it imports first (profile_step, bench)."""
    done = _run([str(script), "--help"], _other_tree(tmp_path), tmp_path)
    assert done.returncode == 1 and "imported the other tree: " in done.stderr, done.stderr[-2000:]


@pytest.mark.integration
def test_without_pythonpath_a_gpu_script_finds_this_checkout(tmp_path):
    done = _run([str(GPU_SCRIPTS / "canvas_sampler.py"), "--help"], None, tmp_path)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-2000:]


@pytest.mark.integration
def test_put_checkout_on_path_goes_after_the_pythonpath_entries(tmp_path):
    tree = _other_tree(tmp_path)
    probe = (
        f"import sys; sys.path.insert(0, {str(GPU_SCRIPTS)!r}); "
        "from repo_root import ROOT, put_checkout_on_path; put_checkout_on_path(); "
        "put_checkout_on_path(); "
        "print(sys.path.index(str(ROOT)), sys.path.index(str(ROOT / 'scripts')), "
        f"sys.path.index({str(tree)!r}), sys.path.count(str(ROOT)))"
    )
    done = _run(["-c", probe], tree, tmp_path)
    root, scripts, other, copies = map(int, done.stdout.split())
    assert other < root < scripts and copies == 1, done.stdout
