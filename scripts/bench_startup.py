"""Start-up times of dllm-generate: a first run (empty compilation cache), a second run (the
cache the first filled), and bad input reported before any work.

  python scripts/bench_startup.py --runs 3                       # this checkout
  python scripts/bench_startup.py --runs 3 --tree /tmp/old-main  # another checkout, side by side

Each case runs ``python -m dllm_jax.cli.generate`` in a fresh process (PYTHONPATH = the tree)
and is timed from the outside: wall seconds, and the CPU seconds the process used (user +
system, which another load on the machine changes less than the wall time). Trees are run
interleaved, run by run, so a change of load affects them alike. The medians go to stdout as a
Markdown table.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = ["--prompt", "sort: 3 9 1 4", "--no-progress"]
CASES = (
    ("first run (empty cache)", PROMPT, 0),
    ("second run (cache from the first)", PROMPT, 0),
    ("bad option value (--temperature -1)", ["--prompt", "x", "--temperature", "-1"], 2),
    ("option of another method (--steps 3)", ["--prompt", "x", "--steps", "3"], 2),
    ("missing model folder", ["--prompt", "x", "--model", "/nonexistent"], 2),
)


def timed(tree: Path, args: list[str], cache: Path, expected: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of dllm-generate from ``tree``."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "DLLM_JAX_COMPILE_CACHE")}
    env.update(PYTHONPATH=str(tree), XDG_CACHE_HOME=str(cache), JAX_PLATFORMS="cpu")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "dllm_jax.cli.generate", *args],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != expected:
        raise SystemExit(f"{tree}: {args}: exit status {result.returncode}, expected {expected}\n{result.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to measure (repeat; default: this one)")
    args = parser.parse_args(argv)
    trees = args.tree or [ROOT]
    times: dict[tuple[Path, str], list[tuple[float, float]]] = {}
    for _ in range(args.runs):
        for tree in trees:
            cache = Path(tempfile.mkdtemp(prefix="bench-startup-cache-"))
            try:
                for name, case_args, expected in CASES:
                    times.setdefault((tree, name), []).append(timed(tree, case_args, cache, expected))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    print(f"median of {args.runs} runs, wall s / CPU s; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print()
    print("| case | " + " | ".join(str(t) for t in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for name, *_ in CASES:
        cells = []
        for tree in trees:
            walls, cpus = zip(*times[(tree, name)])
            cells.append(f"{statistics.median(walls):.2f} / {statistics.median(cpus):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
