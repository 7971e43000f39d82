"""The code imports one way, bottom-up, floor by floor, and no modules import each other in a circle.

  pallas_kernels         the kernels and the jnp references they share with the model (jax only)
  dllm_jax.common        errors, argument checks, output files, logs, the platform probe
  dllm_jax.text          tokenizer and chat template
  dllm_jax.models        configs, families, layers, quantization, checkpoints, loading
  dllm_jax.sampling      SamplingParams (the request schema) and token sampling
  dllm_jax.runtime       the jitted decode loop, slots, flat cache, kernel routing, sharding
  dllm_jax.policies      what each method recomputes and commits
  dllm_jax.engine        requests, results, sessions, the Engine
  dllm_jax.serve / .cli / .evaluation    the front ends (none imports another)
  dllm_jax               the package's public names
  convert                the conversion command lines
  scripts                benchmarks, evaluation, training

A module may import its own floor or one below. Every import statement counts, also one inside a
function or under TYPE_CHECKING: a lazy import hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("pallas_kernels", "dllm_jax", "convert", "scripts")
FLOORS: tuple[tuple[str, ...], ...] = (
    ("pallas_kernels",),
    ("dllm_jax.common",),
    ("dllm_jax.text",),
    ("dllm_jax.models",),
    ("dllm_jax.sampling",),
    ("dllm_jax.runtime",),
    ("dllm_jax.policies",),
    ("dllm_jax.engine",),
    ("dllm_jax.serve", "dllm_jax.cli", "dllm_jax.evaluation"),
    ("dllm_jax",),
    ("convert",),
    ("scripts",),
)


def _room(name: str) -> str | None:
    """The most specific floor prefix `name` belongs to (None: not ours)."""
    best = None
    for floor in FLOORS:
        for prefix in floor:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
                best = prefix
    return best


def floor_of(name: str) -> int | None:
    room = _room(name)
    return None if room is None else next(i for i, floor in enumerate(FLOORS) if room in floor)


def imported_modules(source: str, module: str, known: frozenset[str] = frozenset()) -> list[str]:
    """Absolute names of every module `source` (the text of `module`) imports. ``from p import x``
    counts as an import of p.x where p.x is a module in `known`, else of p."""
    names = []
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            names += subs if len(subs) == len(node.names) else [base, *subs]
    return names


def violations(source: str, module: str, known: frozenset[str] = frozenset()) -> list[str]:
    """Imports of `module` that point up a floor, or from one front end into another."""
    own, room = floor_of(module), _room(module)
    found = []
    for name in imported_modules(source, module, known):
        floor = floor_of(name)
        if floor is None or own is None:
            continue
        if floor > own:
            found.append(f"{module} imports {name} (a floor above)")
        elif floor == own and len(FLOORS[own]) > 1 and _room(name) != room:
            found.append(f"{module} imports {name} (another front end)")
    return found


def _modules() -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of `sources` it imports (itself excluded)."""
    known = frozenset(sources)
    return {
        module: {name for name in imported_modules(text, module, known) if name in known and name != module}
        for module, text in sources.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_a_floor_above_it():
    modules = _modules()
    known = frozenset(modules)
    found = []
    for module, path in modules.items():
        found += violations(path.read_text(), module, known)
    assert not found, "\n".join(found)


def test_every_module_has_a_floor():
    assert [m for m in _modules() if floor_of(m) is None] == []


def test_no_import_circles():
    sources = {module: path.read_text() for module, path in _modules().items()}
    found = circles(import_graph(sources))
    assert not found, "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    "module, source, bad",
    [
        ("pallas_kernels.attention.cache_attention", "from dllm_jax.runtime import x", True),
        ("pallas_kernels.attention.cache_attention", "def f():\n    import dllm_jax.models.config\n", True),
        ("dllm_jax.models.loading", "def f():\n    from convert.hf_to_jax import x\n", True),
        ("dllm_jax.models.quantization", "from dllm_jax.runtime.kernel_routing import on_nvidia_gpu", True),
        ("dllm_jax.runtime.decode_loop", "from dllm_jax.policies.flash_cache import FlashCachePolicy", True),
        ("dllm_jax.engine.engine", "from dllm_jax.serve.app import x", True),
        ("dllm_jax.engine.engine", "from ..serve import app", True),
        ("dllm_jax.serve.cli", "from dllm_jax.cli.arguments import x", True),
        ("dllm_jax.serve.app", "from dllm_jax.engine.engine import Engine", False),
        ("dllm_jax.policies.block", "from dllm_jax.runtime.slots import Slots", False),
        ("dllm_jax.models.transformer", "from pallas_kernels.projection.rope import apply_rope", False),
        ("convert.hf_to_jax", "from dllm_jax.models.checkpoint.hf_reader import read_checkpoint", False),
        ("scripts.bench", "import convert.jax_to_hf", False),
    ],
)
def test_the_checker_flags_upward_imports(module, source, bad):
    assert bool(violations(source, module)) == bad


def test_the_checker_finds_circles_within_a_floor():
    sources = {
        "dllm_jax.engine.engine": "from dllm_jax.engine.session import GenerationSession",
        "dllm_jax.engine.session": "def f():\n    from dllm_jax.engine import engine\n",
        "dllm_jax.engine.results": "from dllm_jax.models.config import ModelConfig",
        "dllm_jax.models.config": "",
    }
    assert circles(import_graph(sources)) == [["dllm_jax.engine.engine", "dllm_jax.engine.session"]]
    sources["dllm_jax.engine.session"] = "from dllm_jax.engine.results import x"
    assert circles(import_graph(sources)) == []
