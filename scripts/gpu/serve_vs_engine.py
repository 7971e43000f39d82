"""The server under saturating load against Engine.generate on the same requests.

    PYTHONPATH=. python scripts/gpu/serve_vs_engine.py                  # GPU: LLaDA-8B shape, random bf16 weights
    PYTHONPATH=. python scripts/gpu/serve_vs_engine.py --smoke          # CPU: a tiny random model, a few requests

Random weights make confidences meaningless, so every request runs the equal-work schedule
of bench.py ("one": threshold 2, one token per step, flash_cache). The server runs in this
process (uvicorn on 127.0.0.1, its engine thread owning the device); the load comes from
scripts/load_test.py in a subprocess (its own interpreter: the client does not compete for
this one's GIL), all requests at once, streaming with usage. Then Engine.generate decodes
the same token-id prompts with the same DecodeConfig (its compiled loop is the server's).
Reported: completion tokens/s of both and their ratio (the issue's target: the server within
10%), the server's step time, and the time from the loop call that returned a commit to the
chunk carrying it (the server's dllm_commit_to_chunk_seconds histogram). Writes
serve_bench.json and serve_bench.md to --out (default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402
import jax  # noqa: E402

from dllm_jax.common.atomic_write import write_text_atomically  # noqa: E402
from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.models.config import ModelConfig, llada_8b_config  # noqa: E402
from dllm_jax.models.transformer import init_params, init_params_per_layer  # noqa: E402
from dllm_jax.sampling.params import SamplingParams  # noqa: E402
from dllm_jax.serve.assemble import ServeOptions, assemble, decode_config, request_defaults  # noqa: E402


class IdTokenizer:
    """Renders token ids as text ("<id>") for a model without a tokenizer (random weights)."""

    has_chat_template = False

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            if int(i) == self.eos_id:
                break
            out.append(f"<{int(i)}>")
        return "".join(out)


def tiny_config() -> ModelConfig:
    return ModelConfig(
        d_model=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        mlp_hidden_size=256,
        vocab_size=256,
        mask_token_id=255,
        eos_token_id=254,
        pad_token_id=254,
        max_sequence_length=1024,
        dtype="float32",
    )


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny random model, few requests")
    p.add_argument("--slots", type=int, help="decode slots (default 32; smoke 4)")
    p.add_argument("--requests", type=int, help="requests (default 64; smoke 8)")
    p.add_argument("--gen-length", type=int, help="answer positions (default 128; smoke 16)")
    p.add_argument("--prompt-length", type=int, help="prompt tokens (default 256; smoke 16)")
    p.add_argument("--iterations-per-call", type=int, default=1, help="server loop iterations per device call")
    p.add_argument(
        "--canvas", action="store_true", help='requests ask for the canvas stream ("dllm": {"canvas": true})'
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    defaults = (
        dict(slots=4, requests=8, gen_length=16, prompt_length=16)
        if opts.smoke
        else dict(slots=32, requests=64, gen_length=128, prompt_length=256)
    )
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    return opts


def histogram(samples: dict[str, float], name: str) -> dict:
    """Mean and bucket quantiles (upper bounds) of a Prometheus histogram from /metrics samples."""
    count = samples.get(f"{name}_count", 0.0)
    if not count:
        return {"count": 0}
    buckets = sorted(
        (float(k.split('le="')[1].rstrip('"}')), v) for k, v in samples.items() if k.startswith(f"{name}_bucket")
    )

    def quantile(q):
        return next((le for le, c in buckets if c >= q * count), None)

    return {
        "count": count,
        "mean_s": samples[f"{name}_sum"] / count,
        "p50_le_s": quantile(0.5),
        "p99_le_s": quantile(0.99),
    }


def read_metrics(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def main(argv=None) -> int:
    import uvicorn

    opts = parse_args(argv)
    config = tiny_config() if opts.smoke else llada_8b_config()
    t = time.perf_counter()
    if opts.smoke:
        params = init_params(config, jax.random.key(0))
    else:
        params = jax.block_until_ready(init_params_per_layer(config, jax.random.key(0)))
    print(f"random weights on {jax.devices()[0]} in {time.perf_counter() - t:.1f} s", flush=True)
    engine = Engine(config, params, backend="auto")
    options = ServeOptions(
        model_name="random",
        batch_size=opts.slots,
        gen_length=opts.gen_length,
        max_model_len=opts.prompt_length + opts.gen_length,
        threshold=2.0,
        max_waiting=opts.requests,
        iterations_per_call=opts.iterations_per_call,
    )
    server = assemble(engine, IdTokenizer(config.eos_token_id), options)
    print(f"server warm-up {server.warmup_seconds:.1f} s", flush=True)

    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"

    opts.out.mkdir(parents=True, exist_ok=True)
    load_report = opts.out / "serve_bench_load.json"
    load_cmd = [
        sys.executable,
        str(Path(__file__).resolve().parents[1] / "load_test.py"),
        "--url",
        url,
        "--rate",
        "inf",
        "--requests",
        str(opts.requests),
        "--prompt-ids",
        str(opts.prompt_length),
        "--vocab",
        str(config.vocab_size - 2),
        "--max-tokens",
        str(opts.gen_length),
        "--seed",
        "7",
        "--output",
        str(load_report),
    ] + (["--dllm", '{"canvas": true}'] if opts.canvas else [])
    t = time.perf_counter()
    subprocess.run(load_cmd, check=True, timeout=1200, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    print(f"load test {time.perf_counter() - t:.1f} s", flush=True)
    load = json.loads(load_report.read_text())["runs"][0]
    samples = read_metrics(url)
    uv.should_exit = True
    thread.join(60)

    # the same prompts (load_test's --prompt-ids draw), decoded by Engine.generate
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(config.vocab_size - 2) for _ in range(opts.prompt_length)] for _ in range(opts.requests)]
    decode = decode_config("flash_cache", options)
    out = engine.generate(prompts, SamplingParams(**request_defaults(decode, options)), decode_config=decode)
    engine_tokens = out.stats.completion_tokens
    engine_rate = engine_tokens / out.stats.wall_seconds
    report = {
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "model": "tiny" if opts.smoke else "LLaDA-8B",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "slots": opts.slots,
        "requests": opts.requests,
        "gen_length": opts.gen_length,
        "prompt_length": opts.prompt_length,
        "iterations_per_call": opts.iterations_per_call,
        "canvas": opts.canvas,
        "warmup_s": server.warmup_seconds,
        "server": {
            **load,
            "compilations_after_warmup": samples.get("dllm_compilations_after_warmup"),
            "step": histogram(samples, "dllm_step_seconds"),
            "commit_to_chunk": histogram(samples, "dllm_commit_to_chunk_seconds"),
        },
        "engine": {
            "tokens": engine_tokens,
            "wall_s": out.stats.wall_seconds,
            "tokens_per_s": engine_rate,
            "iterations": out.stats.iterations,
            "ms_per_iteration": 1e3 * out.stats.wall_seconds / max(out.stats.iterations, 1),
        },
    }
    report["server_over_engine"] = load["tokens_per_s"] / engine_rate if engine_rate else None
    report["same_tokens"] = load["tokens"] == engine_tokens
    s, e = report["server"], report["engine"]
    md = "\n".join(
        [
            f"# serve bench: {report['model']} on {report['device']}, {report['date']}",
            "",
            f"{opts.requests} requests at once, {opts.slots} slots, prompts of {opts.prompt_length} tokens, "
            f"{opts.gen_length} generated, one token per step, {opts.iterations_per_call} iteration(s) per call, canvas stream {'on' if opts.canvas else 'off'}.",
            "",
            "| | tokens | wall s | tokens/s |",
            "|---|---|---|---|",
            f"| server (HTTP, streaming) | {s['tokens']} | {s['wall_s']:.2f} | {s['tokens_per_s']:.1f} |",
            f"| Engine.generate | {e['tokens']} | {e['wall_s']:.2f} | {e['tokens_per_s']:.1f} |",
            "",
            f"server / engine: {report['server_over_engine']:.3f}; same completion tokens: {report['same_tokens']}; "
            f"errors: {s['errors'] or 'none'}; compilations after warm-up: {s['compilations_after_warmup']}",
            f"server step: mean {1e3 * s['step'].get('mean_s', float('nan')):.2f} ms; engine "
            f"{e['ms_per_iteration']:.2f} ms/iteration",
            f"commit to chunk: mean {1e3 * s['commit_to_chunk'].get('mean_s', float('nan')):.2f} ms, p50 <= "
            f"{s['commit_to_chunk'].get('p50_le_s')} s, p99 <= {s['commit_to_chunk'].get('p99_le_s')} s "
            f"({int(s['commit_to_chunk'].get('count', 0))} chunks)",
            f"first stable text p50 {s['first_text_p50_s']:.3f} s, latency p50 {s['latency_p50_s']:.3f} s "
            f"p99 {s['latency_p99_s']:.3f} s",
        ]
    )
    write_text_atomically(opts.out / "serve_bench.json", json.dumps(report, indent=1))
    write_text_atomically(opts.out / "serve_bench.md", md + "\n")
    print(md)
    ok = not s["errors"] and report["same_tokens"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
