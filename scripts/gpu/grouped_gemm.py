"""The routed experts' grouped GEMM on the GPU: how XLA lowers jax.lax.ragged_dot and how fast it runs.

    python scripts/gpu/grouped_gemm.py --out OUT            # runs itself once per XLA flag set
    python scripts/gpu/grouped_gemm.py --tiny --out OUT     # CPU smoke

DiffusionGemma's experts run as two ragged dots over the rows sorted by expert
(dllm_jax.models.experts). At the 26B-A4B shape (128 experts of 2816 -> 2 x 704 -> 2816, top 8)
a decoder step of S slots has S x 256 x 8 assignment rows. For each row count and each layout
of the weights (ours: [E, out, in], contracting their last axis; jax.lax.ragged_dot's: [E, in,
out]) this times the gate/up and the down product (median of --repeats calls, random rows, a
random routing) and reads the optimized program: ragged dots left, cuDNN custom calls, and the
largest temporary (a dense rewrite computes every row against every expert: E times the bytes).
Each XLA flag set of --flag-sets runs in a child process (XLA reads XLA_FLAGS once), one JSON
line each; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FLAG_SETS = {
    "default": "",
    "cudnn_ragged_dot": "--xla_gpu_experimental_use_ragged_dot_fusion=true",
}


def child(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    E, K = (8, 2) if args.tiny else (128, 8)
    D, F = (32, 16) if args.tiny else (2816, 704)
    ours = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    rng = np.random.default_rng(0)
    out = {"flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0].device_kind), "rows": []}
    try:
        from jax._src.lib import cuda_versions

        out["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as e:  # noqa: BLE001 (only a report)
        out["cudnn"] = f"unknown ({type(e).__name__})"
    dtype = jnp.bfloat16 if jax.devices()[0].platform == "gpu" else jnp.float32
    for slots in args.slots:
        M = slots * (8 if args.tiny else 256) * K
        groups = np.bincount(rng.integers(0, E, M), minlength=E).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((M, D)), dtype)
        h = jnp.asarray(rng.standard_normal((M, F)), dtype)
        sizes = jnp.asarray(groups)
        for layout in ("ours", "ragged_dot"):
            for name, rows, shape_out_in in (("gate_up", x, (2 * F, D)), ("down", h, (D, F))):
                n_out, n_in = shape_out_in
                if layout == "ours":
                    w = jnp.asarray(rng.standard_normal((E, n_out, n_in)) / np.sqrt(n_in), dtype)
                    fn = jax.jit(
                        lambda r, w, s: jax.lax.ragged_dot_general(r, w, s, ours, preferred_element_type=jnp.float32)
                    )
                else:
                    w = jnp.asarray(rng.standard_normal((E, n_in, n_out)) / np.sqrt(n_in), dtype)
                    fn = jax.jit(lambda r, w, s: jax.lax.ragged_dot(r, w, s, preferred_element_type=jnp.float32))
                row = {"slots": slots, "rows": M, "layout": layout, "product": name}
                try:
                    compiled = fn.lower(rows, w, sizes).compile()
                    text = compiled.as_text()
                    row["ragged_dots"] = text.count("ragged-dot(")
                    row["cudnn_calls"] = text.count("__cudnn")
                    row["temp_gib"] = compiled.memory_analysis().temp_size_in_bytes / 2**30
                    compiled(rows, w, sizes).block_until_ready()
                    times = []
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        compiled(rows, w, sizes).block_until_ready()
                        times.append(time.perf_counter() - start)
                    row["ms"] = 1e3 * float(np.median(times))
                    # every expert's weights read once, the rows read and the products written once
                    moved = w.size * w.dtype.itemsize + rows.size * rows.dtype.itemsize + M * n_out * 4
                    row["tb_per_s"] = moved / (row["ms"] * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001 (a failed variant is reported)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
    (args.out / f"grouped_gemm_{args.flag_set}.json").write_text(json.dumps(out, indent=2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--flag-sets", nargs="+", default=list(FLAG_SETS), choices=list(FLAG_SETS))
    p.add_argument("--flag-set", help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=150.0, help="per flag set")
    p.add_argument("--out", type=Path, default=Path("grouped_gemm_out"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.flag_set:
        child(args)
        return 0
    lines = [
        "| flags | slots | rows | layout | product | ms | TB/s | ragged dots | cuDNN calls | temp GiB |",
        "|" + "---|" * 10,
    ]
    for flag_set in args.flag_sets:
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAG_SETS[flag_set]}".strip()}
        command = [
            sys.executable,
            __file__,
            "--flag-set",
            flag_set,
            "--out",
            str(args.out),
            "--repeats",
            str(args.repeats),
        ]
        command += ["--slots", *map(str, args.slots)] + (["--tiny"] if args.tiny else [])
        try:
            subprocess.run(command, env=env, timeout=args.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            print(f"{flag_set}: stopped after {args.timeout_s} s", flush=True)
        path = args.out / f"grouped_gemm_{flag_set}.json"
        report = json.loads(path.read_text()) if path.exists() else {"rows": []}
        print(f"{flag_set}: cudnn {report.get('cudnn')}", flush=True)
        for r in report["rows"]:
            if "error" in r:
                lines.append(
                    f"| {flag_set} | {r['slots']} | {r['rows']} | {r['layout']} | {r['product']} | {r['error'][:80]} |"
                )
                continue
            lines.append(
                f"| {flag_set} | {r['slots']} | {r['rows']} | {r['layout']} | {r['product']} | {r['ms']:.3f} | "
                f"{r['tb_per_s']:.2f} | {r['ragged_dots']} | {r['cudnn_calls']} | {r['temp_gib']:.2f} |"
            )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
