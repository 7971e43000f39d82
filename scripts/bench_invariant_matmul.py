"""The batch-invariant matmul against XLA's dot at LLaDA-8B GEMM shapes: time and row identity.

    PYTHONPATH=. python scripts/bench_invariant_matmul.py           # GPU
    PYTHONPATH=. python scripts/bench_invariant_matmul.py --smoke   # CPU (reference and XLA only)

For each projection shape of one LLaDA-8B layer (q/k/v/out: 4096 x 4096, gate/up: 4096 x
12288, down: 12288 x 4096) at M = 128 rows per slot x 1/8/32 slots, and the LM head (4096 x
126464) at 16 rows per slot, it times XLA's dot (cuBLAS or XLA's GEMM fusion), the Pallas
kernel (pallas_kernels.matmul.invariant_matmul; default and alternative tilings) and the jnp
reference (XLA's dot on 128-row tiles in sequence), and checks whether the first rows of the
M-row product are bit-identical to the product of those rows alone (1 slot's rows): the
batch leak of a GEMM. Writes invariant_matmul.json/.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.runtime.batch_invariance import REFERENCE_BLOCKS  # noqa: E402
from pallas_kernels.matmul.invariant_matmul import MatmulBlockSizes, invariant_matmul, invariant_matmul_reference  # noqa: E402

SHAPES = {
    "qkvo 4096x4096": (4096, 4096, 128),
    "gate/up 4096x12288": (4096, 12288, 128),
    "down 12288x4096": (12288, 4096, 128),
    "lm_head 4096x126464": (4096, 126464, 16),
}
# candidates for the default tiling (one for all M: a tiling chosen by M would undo the invariance)
ALTERNATIVE_TILES = (
    MatmulBlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    MatmulBlockSizes(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=3),
    MatmulBlockSizes(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4),
    MatmulBlockSizes(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
)


def seconds_per_call(f, *args, calls: int = 10, repeats: int = 3) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: small shapes, no kernel (interpret mode is too slow)")
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = p.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    shapes = {"small 256x512": (256, 512, 32)} if args.smoke else SHAPES
    impls = {
        "xla_dot": jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16)),
        "reference_tiles128": jax.jit(lambda x, w: invariant_matmul_reference(x, w, block_sizes=REFERENCE_BLOCKS)),
    }
    if on_gpu:
        impls["kernel"] = jax.jit(lambda x, w: invariant_matmul(x, w))
        for b in ALTERNATIVE_TILES:
            impls[f"kernel {b.block_m}x{b.block_n}x{b.block_k} w{b.num_warps}"] = jax.jit(
                lambda x, w, b=b: invariant_matmul(x, w, block_sizes=b)
            )
    rows = []
    for name, (k, n, per_slot) in shapes.items():
        w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        for slots in args.slots:
            m = per_slot * slots
            x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
            for impl, f in impls.items():
                try:
                    s = seconds_per_call(f, x, w)
                    full = np.asarray(f(x, w)[:per_slot].astype(jnp.float32))
                    alone = np.asarray(f(x[:per_slot], w).astype(jnp.float32))
                    same = bool(np.array_equal(full.view(np.uint32), alone.view(np.uint32)))
                    rows.append(
                        dict(
                            shape=name,
                            slots=slots,
                            m=m,
                            impl=impl,
                            us=s * 1e6,
                            tflops=2 * m * k * n / s / 1e12,
                            rows_identical_to_alone=same,
                        )
                    )
                except Exception as e:  # a tiling the compiler rejects is reported, the others still run
                    rows.append(dict(shape=name, slots=slots, m=m, impl=impl, error=f"{type(e).__name__}: {e}"[:300]))
                print(rows[-1], flush=True)
    lines = [
        f"# Batch-invariant matmul vs XLA's dot ({jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d %H:%M')})",
        "",
        "rows identical: the first slot's rows of the M-row product equal the product of those rows alone",
        "",
        "| shape | slots | M | impl | us | TFLOP/s | rows identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['slots']} | {r['m']} | {r['impl']} | error: {r['error']} | | |")
        else:
            lines.append(
                f"| {r['shape']} | {r['slots']} | {r['m']} | {r['impl']} | {r['us']:.1f} | {r['tflops']:.1f} | "
                f"{'yes' if r['rows_identical_to_alone'] else 'NO'} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.out / "invariant_matmul.json", json.dumps(rows, indent=1))
    write_text_atomically(args.out / "invariant_matmul.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
