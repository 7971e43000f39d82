"""The checkout the scripts belong to, put on sys.path behind PYTHONPATH.

A script run as ``python3 scripts/gpu/NAME.py`` (or ``scripts/NAME.py``) sees its own folder
first on sys.path, then the PYTHONPATH entries. ``put_checkout_on_path`` adds the checkout's
root and its scripts/ after those entries (not before them), so ``PYTHONPATH=$PWD/.old python3
scripts/gpu/NAME.py`` runs the older tree's dllm_jax and pallas_kernels under this checkout's
script: the A/B the BENCHMARKS commands use. Every script in scripts/ and scripts/gpu calls it
before importing either package (scripts/ as ``gpu.repo_root``); one that inserted the root at
sys.path[0], as all did until 2026-12-08, shadowed PYTHONPATH for the whole process, so such an
"old" run measured this checkout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def put_checkout_on_path() -> None:
    """ROOT and ROOT/scripts on sys.path right after the last PYTHONPATH entry (after
    sys.path[0], the script's folder, without one); entries already there are left alone."""
    wanted = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    seen = [i for i, p in enumerate(sys.path) if p and os.path.abspath(p) in wanted]
    at = max(seen) + 1 if seen else min(1, len(sys.path))
    present = {os.path.abspath(p) for p in sys.path if p}
    for path in (str(ROOT / "scripts"), str(ROOT)):
        if path not in present:
            sys.path.insert(at, path)
