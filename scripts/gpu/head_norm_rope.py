"""DiffusionGemma's per-head q/k/v norm + RoPE on the GPU: XLA's passes against the one-pass kernel.

    PYTHONPATH=. python scripts/gpu/head_norm_rope.py --out OUT           # GPU: about 1 minute
    PYTHONPATH=. python scripts/gpu/head_norm_rope.py --tiny --out OUT    # CPU smoke (interpret mode)

For each slot count (256 canvas rows a slot) and each of the 26B-A4B layer's tensors (sliding
q [N, 16, 256] and k [N, 8, 256]; full q [N, 16, 512] and k [N, 2, 512]; bf16, a weight, a
rotation: full layers rotate a quarter of the pairs), this times (median of --repeats samples
of chained calls, scripts/bench_kernels.time_chain) pallas_kernels.norm.head_norm_rope's
jnp reference as XLA compiles it alone, the kernel's default tiling and a few others, and
prints each one's rate in TB/s of its bytes (x read once, the result written once) and the
share of elements that differ from XLA's: the kernel rounds the normed rows to bf16 before
rotating them, as the model's code does, and XLA:GPU (excess precision) does not, so about a
third of the rotated elements differ by one bf16 step (H100, 2026-12-07); on a CPU, none.
Inside the model XLA fuses the reference with its neighbours (the projection's layout, the
attention's transpose), so the step, not this table, decides (diffusion_gemma_engine.py).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()
from bench_kernels import row_block_tilings, time_chain  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from pallas_kernels.common import RowBlockSizes  # noqa: E402
from pallas_kernels.norm.head_norm_rope import (  # noqa: E402
    default_block_sizes,
    head_norm_rope,
    head_norm_rope_reference,
)

# (name, heads, head dim, rotated fraction of the pairs)
TENSORS = (("sliding q", 16, 256, 1.0), ("sliding k", 8, 256, 1.0), ("full q", 16, 512, 0.25), ("full k", 2, 512, 0.25))
TINY_TENSORS = (("q", 4, 32, 1.0), ("k", 2, 64, 0.25))


def operands(n: int, heads: int, head_dim: int, fraction: float):
    keys = jax.random.split(jax.random.key(n + heads + head_dim), 3)
    x = (3.0 * jax.random.normal(keys[0], (n, heads, head_dim))).astype(jnp.bfloat16)
    weight = (1 + 0.2 * jax.random.normal(keys[1], (head_dim,))).astype(jnp.bfloat16)
    half = head_dim // 2
    inv = 1.0 / (10000.0 ** (jnp.arange(half) * 2 / head_dim))
    inv = jnp.where(jnp.arange(half) < int(fraction * half), inv, 0.0)
    angles = jax.random.randint(keys[2], (n,), 0, 4096).astype(jnp.float32)[:, None] * inv[None, :]
    return x, weight, jnp.cos(angles), jnp.sin(angles)


def tilings(heads: int, head_dim: int) -> list[RowBlockSizes]:
    default = default_block_sizes(heads, head_dim)
    rows = default.block_rows
    return row_block_tilings(default, (rows // 2, rows, 2 * rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke: small shapes, the kernel in interpret mode")
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("head_norm_rope_out"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    interpret = args.tiny
    tensors = TINY_TENSORS if args.tiny else TENSORS
    rows_per_slot = 4 if args.tiny else 256
    inner = 2 if args.tiny else 10
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    lines = ["| slots | tensor | variant | us per call | TB/s | differ from XLA |", "|---|---|---|---|---|---|"]
    for slots in args.slots:
        n = slots * rows_per_slot
        for name, heads, head_dim, fraction in tensors:
            x, weight, cos, sin = operands(n, heads, head_dim, fraction)
            moved = 2 * x.size * x.dtype.itemsize
            xla = jax.jit(functools.partial(head_norm_rope_reference, eps=1e-6))
            want = np.asarray(xla(x, weight, cos, sin), np.float32)
            variants = [("xla", xla)] + [
                (
                    f"kernel {b.block_rows}r w{b.num_warps}",
                    functools.partial(head_norm_rope, eps=1e-6, interpret=interpret, block_sizes=b),
                )
                for b in tilings(heads, head_dim)
            ]
            for variant, fn in variants:
                got = np.asarray(fn(x, weight, cos, sin), np.float32)
                differ = float(np.mean(got != want))
                seconds = time_chain(
                    lambda i, c, consts, fn=fn: fn(c, *consts),
                    jnp.array(x, copy=True),  # time_chain donates its carry
                    (weight, cos, sin),
                    inner=inner,
                    repeats=args.repeats,
                )
                row = dict(
                    slots=slots,
                    tensor=name,
                    variant=variant,
                    us=seconds * 1e6,
                    tb_s=moved / seconds / 1e12,
                    differ=differ,
                )
                report["rows"].append(row)
                lines.append(f"| {slots} | {name} | {variant} | {row['us']:.1f} | {row['tb_s']:.2f} | {differ:.4f} |")
                print(lines[-1], flush=True)
    write_text_atomically(args.out / "head_norm_rope.json", json.dumps(report, indent=1))
    write_text_atomically(args.out / "head_norm_rope.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
