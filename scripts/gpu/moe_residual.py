"""DiffusionGemma's MoE block end on the GPU: XLA's passes against the one-pass kernel.

    PYTHONPATH=. python scripts/gpu/moe_residual.py --out OUT           # GPU: about 1 minute
    PYTHONPATH=. python scripts/gpu/moe_residual.py --tiny --out OUT    # CPU smoke (interpret mode)

For each slot count (256 canvas rows a slot; 26B-A4B: D 2816, top-8 of the down GEMM's
T * 8 expert-sorted rows, each assignment its own row as the sort leaves them; bf16), this
times (median of --repeats samples of chained calls, scripts/bench_kernels.time_chain)
pallas_kernels.norm.moe_residual's jnp reference as XLA compiles it alone, the kernel's
default tiling and a few others, and prints each one's rate in TB/s of its bytes (the k
products, the dense MLP's output and the residual read once, the result written once) and the
share of elements that differ from XLA's and from the reference run op by op (every op
rounded to bf16, as the kernel rounds; XLA compiling the reference skips some of those
roundings). In the model XLA splits the
reference into the gathered sum and a fusion of the norms, with the [T, D] sum written
between them; the step (diffusion_gemma_engine.py --kernel moe_output=true) decides.
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
from pallas_kernels.norm.moe_residual import (  # noqa: E402
    default_block_sizes,
    moe_residual,
    moe_residual_reference,
)

EPS = 1e-6


def operands(t: int, d: int, k: int):
    """Rows, dense output, products, a permutation's positions, weights, norm weights, scalars."""
    keys = jax.random.split(jax.random.key(t + d), 8)
    bf16 = jnp.bfloat16
    h = (2.0 * jax.random.normal(keys[0], (t, d))).astype(bf16)
    dense = (5.0 * jax.random.normal(keys[1], (t, d))).astype(bf16)
    products = jax.random.normal(keys[2], (t * k, d)).astype(bf16)
    position = jax.random.permutation(keys[3], t * k).astype(jnp.int32).reshape(t, k)
    weights = jax.random.dirichlet(keys[4], jnp.ones(k), (t,)).astype(jnp.float32)
    norms = [(1 + 0.2 * jax.random.normal(key, (d,))).astype(bf16) for key in jax.random.split(keys[5], 3)]
    scale = jnp.full((t,), 0.75, bf16)
    return h, dense, products, position, weights, *norms, scale


def tilings(d: int) -> list[RowBlockSizes]:
    default = default_block_sizes(d)
    rows = default.block_rows
    return row_block_tilings(default, (rows, 2 * rows, 4 * rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke: small shapes, the kernel in interpret mode")
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("moe_residual_out"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    interpret = args.tiny
    d, k = (64, 2) if args.tiny else (2816, 8)
    rows_per_slot = 4 if args.tiny else 256
    inner = 2 if args.tiny else 10
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    lines = [
        "| slots | variant | us per call | TB/s | differ from XLA | differ from op by op |",
        "|---|---|---|---|---|---|",
    ]
    for slots in args.slots:
        t = slots * rows_per_slot
        h, *consts = operands(t, d, k)
        moved = (k + 3) * t * d * h.dtype.itemsize
        xla = jax.jit(functools.partial(moe_residual_reference, eps=EPS))
        want = np.asarray(xla(h, *consts), np.float32)
        with jax.disable_jit():
            op_by_op = np.asarray(moe_residual_reference(h, *consts, eps=EPS), np.float32)
        variants = [("xla", xla)] + [
            (
                f"kernel {b.block_rows}r w{b.num_warps}",
                functools.partial(moe_residual, eps=EPS, interpret=interpret, block_sizes=b),
            )
            for b in tilings(d)
        ]
        for variant, fn in variants:
            got = np.asarray(fn(h, *consts), np.float32)
            differ, differ_ops = float(np.mean(got != want)), float(np.mean(got != op_by_op))
            seconds = time_chain(
                lambda i, c, consts, fn=fn: fn(c, *consts),
                jnp.array(h, copy=True),  # time_chain donates its carry
                tuple(consts),
                inner=inner,
                repeats=args.repeats,
            )
            row = dict(
                slots=slots,
                variant=variant,
                us=seconds * 1e6,
                tb_s=moved / seconds / 1e12,
                differ=differ,
                differ_op_by_op=differ_ops,
            )
            report["rows"].append(row)
            lines.append(
                f"| {slots} | {variant} | {row['us']:.1f} | {row['tb_s']:.2f} | {differ:.4f} | {differ_ops:.4f} |"
            )
            print(lines[-1], flush=True)
    write_text_atomically(args.out / "moe_residual.json", json.dumps(report, indent=1))
    write_text_atomically(args.out / "moe_residual.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
