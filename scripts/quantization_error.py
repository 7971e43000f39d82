"""How far 8-bit weights move the model: per-layer weight error, the embedding's error, per-layer
output error and logit error against the unquantized model, for each quantization.

  python scripts/quantization_error.py                       # the embedded tiny model (CPU)
  python scripts/quantization_error.py --shape llada-8b      # random bf16 weights of LLaDA-8B's shape (GPU)

Each quantized model runs on its own residual stream (errors accumulate through the layers as
they do in use); "layer output" is the relative L2 error of that stream after the layer.
Writes $OUT/quantization_error.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()
from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.models.config import llada_8b_config  # noqa: E402
from dllm_jax.models.embedded import tiny_model_path  # noqa: E402
from dllm_jax.models.llada import LLaDABlock, LLaDAModel  # noqa: E402
from dllm_jax.models.loading import load_model  # noqa: E402
from dllm_jax.models.quantization import QUANTIZED_MODULES, dequantize_embedding, dequantize_kernel, quantize_params  # noqa: E402
from dllm_jax.models.transformer import init_params_per_layer, unstack_layers  # noqa: E402

MODES = ("fp8", "int8-weights")


def rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def layer_outputs(config, params, tokens):
    """The residual stream after each layer, and the logits: [n_layers] of [B, T, D], [B, T, V]."""
    model, block = LLaDAModel(config), LLaDABlock(config)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.ones((B, 1, T), bool)
    apply_block = jax.jit(lambda lp, h: block.apply({"params": lp}, h, positions, mask)[0])
    h = jax.jit(lambda p, t: model.apply({"params": p}, t, method=LLaDAModel.embed))(params, tokens)
    outs = []
    for lp in params["layers"]:
        h = apply_block(lp, h)
        outs.append(h)
    logits = jax.jit(lambda p, h: model.apply({"params": p}, h, method=LLaDAModel.logits))(params, h)
    return outs, logits


def measure(config, params, tokens) -> dict:
    ref_outs, ref_logits = layer_outputs(config, params, tokens)
    report = {}
    for mode in MODES:
        q_params = quantize_params(params, mode)
        weight_error = [
            {name: rel(dequantize_kernel(qlp[name]), lp[name]["kernel"]) for name in QUANTIZED_MODULES}
            for lp, qlp in zip(params["layers"], q_params["layers"])
        ]
        # per row, as the lookup reads it: the table's relative error and the worst row's (None: a
        # tied table, which stays unquantized)
        table = params["wte"]["embedding"]
        if "qembedding" in q_params["wte"]:
            back = dequantize_embedding(q_params["wte"])
            row_error = jnp.linalg.norm(back - table, axis=-1) / jnp.maximum(jnp.linalg.norm(table, axis=-1), 1e-30)
            embedding_error = {"table": rel(back, table), "max_row": float(jnp.max(row_error))}
            del back
        else:
            embedding_error = None
        outs, logits = layer_outputs(dataclasses.replace(config, quantization=mode), q_params, tokens)
        report[mode] = {
            "weight_rel_error": weight_error,
            "embedding_rel_error": embedding_error,
            "layer_output_rel_error": [rel(o, r) for o, r in zip(outs, ref_outs)],
            "logits_rel_error": rel(logits, ref_logits),
            "argmax_agreement": float(jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(ref_logits, -1))),
        }
        del q_params, outs, logits
    return report


def markdown(report: dict) -> str:
    lines = [
        "| quantization | weight error (mean / max over projections) | embedding error (table / worst row) | "
        "layer output error: first / middle / last | logits error | argmax agreement |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        r = report[mode]
        w = [v for layer in r["weight_rel_error"] for v in layer.values()]
        out = r["layer_output_rel_error"]
        e = r["embedding_rel_error"]
        embedding = "tied: not quantized" if e is None else f"{e['table']:.2e} / {e['max_row']:.2e}"
        lines.append(
            f"| {mode} | {np.mean(w):.2e} / {np.max(w):.2e} | {embedding} | "
            f"{out[0]:.2e} / {out[len(out) // 2]:.2e} / {out[-1]:.2e} | "
            f"{r['logits_rel_error']:.2e} | {r['argmax_agreement']:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded tiny model)")
    p.add_argument(
        "--shape", choices=("llada-8b",), default=None, help="random weights of this shape instead of --model"
    )
    p.add_argument("--tokens", type=int, default=512, help="tokens per row of the random input")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    if opts.shape:
        config = llada_8b_config()
        params = init_params_per_layer(config, jax.random.key(0))
        source = f"random {opts.shape} weights (bf16)"
    else:
        on_cpu = jax.devices()[0].platform == "cpu"
        loaded = load_model(opts.model or tiny_model_path(), dtype="float32" if on_cpu else "bfloat16")
        config, params, source = loaded.config, unstack_layers(loaded.weights), str(loaded.path)
    length = min(opts.tokens, config.max_sequence_length)
    tokens = jax.random.randint(jax.random.key(1), (opts.rows, length), 0, config.vocab_size)
    report = {
        "source": source,
        "device": jax.devices()[0].device_kind,
        "dtype": config.dtype,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "tokens": [opts.rows, length],
        **measure(config, params, tokens),
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(opts.out / "quantization_error.json", json.dumps(report, indent=1))
    print(f"{source}, {config.dtype}, {opts.rows} x {length} random tokens")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
