"""Measure the peak host memory of converting and loading a ~1.3 GB random LLaDA checkpoint.

  nice python scripts/measure_conversion_memory.py [--work-dir /tmp/dllm_jax_memory]

Writes a random bf16 checkpoint in several shards (kept in the work dir and reused), then runs
each step as its own process under ``/usr/bin/time -v``:
  baseline    python importing what the steps import (jax, orbax, safetensors, transformers)
  convert     python -m convert.hf_to_jax --hf-dir HF --out CONVERTED
  load conv.  load_model(CONVERTED)
  load HF     load_model(HF), converted in memory
For each it reports the maximum RSS from ``time -v`` and, sampled from /proc every 20 ms, the
peak anonymous memory (heap: what conversion allocates) and the peak file-backed memory (pages
of memory-mapped shards, which the kernel can drop at any time). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

# ~645 M parameters = 1.29 GB in bf16: 10 blocks of d_model 2048, MLP 5632, vocab 32000.
CONFIG = dict(
    d_model=2048,
    n_layers=10,
    n_heads=16,
    n_kv_heads=16,
    mlp_hidden_size=5632,
    vocab_size=32000,
    mask_token_id=31999,
    eos_token_id=31998,
    pad_token_id=31998,
    dtype="bfloat16",
)
SHARD_BYTES = 300 * 10**6

_IMPORTS = (
    "import jax, jax.numpy as jnp; import convert.hf_to_jax, dllm_jax.models.loading; jnp.zeros(1).block_until_ready()"
)


def _gb(kb: int) -> float:
    return kb * 1024 / 1e9


def make_checkpoint(hf_dir: Path) -> None:
    import jax

    from convert.jax_to_hf import save_hf_checkpoint
    from dllm_jax.models.config import ModelConfig
    from dllm_jax.models.transformer import init_params

    config = ModelConfig(**CONFIG)
    save_hf_checkpoint(hf_dir, config, init_params(config, jax.random.key(0)), max_shard_bytes=SHARD_BYTES)


def largest_leaf_bytes() -> int:
    import jax

    from dllm_jax.models.config import ModelConfig
    from dllm_jax.models.transformer import abstract_params

    leaves = jax.tree.leaves(abstract_params(ModelConfig(**CONFIG)))
    return max(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    """Children, grandchildren, ...: the converter does its work in a child process of its own."""
    found, queue = [], _children(pid)
    while queue:
        child = queue.pop()
        found.append(child)
        queue.extend(_children(child))
    return found


def _status_kb(pid: int, field: str) -> int:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


def run_measured(argv: list[str]) -> dict[str, float]:
    """Runs ``argv`` under /usr/bin/time -v; returns GB figures and the wall time."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(["/usr/bin/time", "-v", *argv], env=env, stderr=subprocess.PIPE, text=True)
    peaks = {"RssAnon": 0, "RssFile": 0}

    def sample() -> None:
        while proc.poll() is None:
            # the largest process's figures (the command, or the conversion process it runs)
            for child in _descendants(proc.pid):
                for field in peaks:
                    peaks[field] = max(peaks[field], _status_kb(child, field))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    start = time.time()
    sampler.start()
    _, stderr = proc.communicate()
    sampler.join()
    wall = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} failed:\n{stderr}")
    max_rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1))
    return {
        "max_rss": _gb(max_rss_kb),
        "anon": _gb(peaks["RssAnon"]),
        "file": _gb(peaks["RssFile"]),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/dllm_jax_memory"))
    args = parser.parse_args()
    hf_dir, out_dir = args.work_dir / "hf", args.work_dir / "converted"
    if not hf_dir.exists():
        make_checkpoint(hf_dir)
    shutil.rmtree(out_dir, ignore_errors=True)

    shard_sizes = [p.stat().st_size for p in sorted(hf_dir.glob("*.safetensors"))]
    python = sys.executable
    steps = {
        "baseline (imports only)": [python, "-c", _IMPORTS],
        "convert (python -m convert.hf_to_jax)": [
            python,
            "-m",
            "convert.hf_to_jax",
            "--hf-dir",
            str(hf_dir),
            "--out",
            str(out_dir),
        ],
        "load_model(converted folder)": [
            python,
            "-c",
            f"from dllm_jax.models.loading import load_model; load_model({str(out_dir)!r})",
        ],
        "load_model(HF folder)": [
            python,
            "-c",
            f"from dllm_jax.models.loading import load_model; load_model({str(hf_dir)!r})",
        ],
    }
    print(
        f"checkpoint: {sum(shard_sizes) / 1e9:.3f} GB in {len(shard_sizes)} shards, "
        f"largest shard {max(shard_sizes) / 1e9:.3f} GB, largest params leaf {largest_leaf_bytes() / 1e9:.3f} GB"
    )
    print()
    print("| step | max RSS (time -v) | peak anon | peak file-backed | wall |")
    print("|---|---|---|---|---|")
    for name, argv in steps.items():
        r = run_measured(argv)
        print(f"| {name} | {r['max_rss']:.2f} GB | {r['anon']:.2f} GB | {r['file']:.2f} GB | {r['wall']:.1f} s |")
    converted = sum(p.stat().st_size for p in (out_dir / "params").rglob("*") if p.is_file())
    print()
    print(f"converted params on disk: {converted / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
