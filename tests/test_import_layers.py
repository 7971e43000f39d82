"""The packages import each other one way, bottom-up:

  pallas_kernels   (jax only: the kernels and the jnp references they share with the model)
  dllm_jax         (the model, checkpoints, engine; its front ends dllm_jax.cli and
                    dllm_jax.serve sit on top of the rest of dllm_jax)
  convert          (the conversion command-line tools)
  scripts          (benchmarks, evaluation, training)

Every import statement counts, also one inside a function: a lazy import hides a cycle from
Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("pallas_kernels", "dllm_jax", "convert", "scripts")
# front ends inside dllm_jax: nothing else in dllm_jax may import them
FRONT_ENDS = ("dllm_jax.cli", "dllm_jax.serve")


def imported_modules(source: str, module: str) -> list[str]:
    """Absolute names of every module `source` (the text of `module`) imports."""
    names = []
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            else:
                names.append(node.module)
    return names


def _layer(name: str) -> int | None:
    top = name.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def _is_front_end(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FRONT_ENDS)


def violations(source: str, module: str) -> list[str]:
    """Imports of `module` that point up the layers (or into a front end from below it)."""
    own = _layer(module)
    found = []
    for name in imported_modules(source, module):
        layer = _layer(name)
        if layer is None:
            continue
        if layer > own:
            found.append(f"{module} imports {name} (a layer above)")
        elif layer == own and _is_front_end(name) and not _is_front_end(module):
            found.append(f"{module} imports the front end {name}")
    return found


def _modules():
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1] + ["__init__"]
            yield ".".join(parts), path


def test_no_package_imports_one_above_it():
    found = []
    for module, path in _modules():
        found += violations(path.read_text(), module)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "module, source, bad",
    [
        ("pallas_kernels.cache_attention", "from dllm_jax.attention import x", True),
        ("pallas_kernels.cache_attention", "def f():\n    import dllm_jax.model\n", True),
        ("dllm_jax.loading", "def f():\n    from convert.checkpoint import x\n", True),
        ("dllm_jax.engine", "from dllm_jax.serve.app import x", True),
        ("dllm_jax.engine", "from .serve import app", True),
        ("dllm_jax.serve.app", "from dllm_jax.engine import Engine", False),
        ("dllm_jax.model", "from pallas_kernels.reference.rope import apply_rope", False),
        ("convert.hf_to_jax", "from dllm_jax.checkpoint.hf_reader import read_checkpoint", False),
        ("scripts.bench", "import convert.jax_to_hf", False),
    ],
)
def test_the_checker_flags_upward_imports(module, source, bad):
    assert bool(violations(source, module)) == bad
