"""The server under saturating load against Engine.generate on the same requests, and its
latency-throughput curve.

    PYTHONPATH=. python scripts/gpu/serve_vs_engine.py --configs 1 8 8:canvas 32 --curve-rates 2 8 32 inf
    PYTHONPATH=. python scripts/gpu/serve_vs_engine.py --smoke          # CPU: a tiny random model, a few requests

Each configuration is SLOTS or SLOTS:canvas (the requests ask for the canvas stream); the
weights are made once, each configuration gets its own server (its loops compiled and warmed
up) and 4 x SLOTS requests (--requests overrides). After the last configuration, --curve-rates
runs open-loop Poisson arrivals at each offered rate on its server and draws latency against
throughput (serve_curve.png).

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
import importlib.util
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
    p.add_argument("--configs", nargs="+", help="SLOTS or SLOTS:canvas, one server each (default 32; smoke 4 4:canvas)")
    p.add_argument("--requests", type=int, help="requests per configuration (default 4 x slots)")
    p.add_argument("--gen-length", type=int, help="answer positions (default 128; smoke 16)")
    p.add_argument("--prompt-length", type=int, help="prompt tokens (default 256; smoke 16)")
    p.add_argument("--iterations-per-call", type=int, default=1, help="server loop iterations per device call")
    p.add_argument(
        "--curve-rates", nargs="*", default=[], help="offered requests/s for the last server's curve (inf: all at once)"
    )
    p.add_argument("--curve-requests", type=int, help="requests per rate of the curve (default 2 x slots)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    opts = p.parse_args(argv)
    defaults = (
        dict(configs=["4", "4:canvas"], gen_length=16, prompt_length=16)
        if opts.smoke
        else dict(configs=["32"], gen_length=128, prompt_length=256)
    )
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    try:
        opts.configs = [(int(c.split(":")[0]), c.endswith(":canvas")) for c in opts.configs]
        opts.curve_rates = [float(r) for r in opts.curve_rates]
    except ValueError:
        p.error(f"--configs {opts.configs} / --curve-rates {opts.curve_rates}: expected SLOTS[:canvas] and numbers")
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


def start_server(server):
    import uvicorn

    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    return uv, thread, f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"


def load(url: str, opts, config, requests: int, rates: list[str], out: Path, canvas: bool, plot: Path | None = None):
    """scripts/load_test.py in its own interpreter (never this one's): its report's runs."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parents[1] / "load_test.py"),
        "--url",
        url,
        "--rate",
        *rates,
        "--requests",
        str(requests),
        "--prompt-ids",
        str(opts.prompt_length),
        "--vocab",
        str(config.vocab_size - 2),
        "--max-tokens",
        str(opts.gen_length),
        "--seed",
        "7",
        "--output",
        str(out),
    ]
    cmd += ["--dllm", '{"canvas": true}'] if canvas else []
    cmd += ["--plot", str(plot)] if plot is not None else []
    subprocess.run(cmd, check=True, timeout=1200, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(out.read_text())["runs"]


def run_config(engine, config, opts, slots: int, canvas: bool, curve: bool) -> dict:
    options = ServeOptions(
        model_name="random",
        batch_size=slots,
        gen_length=opts.gen_length,
        max_model_len=opts.prompt_length + opts.gen_length,
        threshold=2.0,
        max_waiting=4096,
        iterations_per_call=opts.iterations_per_call,
    )
    server = assemble(engine, IdTokenizer(config.eos_token_id), options)
    requests = opts.requests or 4 * slots
    name = f"{slots}{'-canvas' if canvas else ''}"
    print(f"[{name}] server warm-up {server.warmup_seconds:.1f} s", flush=True)
    uv, thread, url = start_server(server)
    t = time.perf_counter()
    run = load(url, opts, config, requests, ["inf"], opts.out / f"load_{name}.json", canvas)[0]
    print(f"[{name}] load test {time.perf_counter() - t:.1f} s", flush=True)
    samples = read_metrics(url)
    curve_runs = []
    if curve and opts.curve_rates:
        curve_runs = load(
            url,
            opts,
            config,
            opts.curve_requests or 2 * slots,
            [str(r) for r in opts.curve_rates],
            opts.out / "serve_curve.json",
            canvas,
            # the GPU machine's image has no matplotlib: draw it later with load_test.py --replot
            plot=opts.out / "serve_curve.png" if importlib.util.find_spec("matplotlib") else None,
        )
    uv.should_exit = True
    thread.join(60)
    import random

    rng = random.Random(7)  # the same prompts (load_test's --prompt-ids draw), decoded by Engine.generate
    prompts = [[rng.randrange(config.vocab_size - 2) for _ in range(opts.prompt_length)] for _ in range(requests)]
    decode = decode_config("flash_cache", options)
    out = engine.generate(prompts, SamplingParams(**request_defaults(decode, options)), decode_config=decode)
    engine_rate = out.stats.completion_tokens / out.stats.wall_seconds
    return {
        "slots": slots,
        "canvas": canvas,
        "requests": requests,
        "warmup_s": server.warmup_seconds,
        "server": {
            **run,
            "compilations_after_warmup": samples.get("dllm_compilations_after_warmup"),
            "step": histogram(samples, "dllm_step_seconds"),
            "commit_to_chunk": histogram(samples, "dllm_commit_to_chunk_seconds"),
        },
        "engine": {
            "tokens": out.stats.completion_tokens,
            "wall_s": out.stats.wall_seconds,
            "tokens_per_s": engine_rate,
            "iterations": out.stats.iterations,
            "ms_per_iteration": 1e3 * out.stats.wall_seconds / max(out.stats.iterations, 1),
        },
        "server_over_engine": run["tokens_per_s"] / engine_rate if engine_rate else None,
        "same_tokens": run["tokens"] == out.stats.completion_tokens,
        "curve": curve_runs,
    }


def write_report(opts, rows: list[dict]) -> None:
    """serve_bench.json and serve_bench.md of the configurations measured so far (and printed)."""
    report = {
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "model": "tiny" if opts.smoke else "LLaDA-8B",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "gen_length": opts.gen_length,
        "prompt_length": opts.prompt_length,
        "iterations_per_call": opts.iterations_per_call,
        "configs": rows,
    }
    lines = [
        f"# serve bench: {report['model']} on {report['device']}, {report['date']}",
        "",
        f"Prompts of {opts.prompt_length} tokens, {opts.gen_length} generated, one token per step, "
        f"{opts.iterations_per_call} iteration(s) per call, all requests at once.",
        "",
        "| slots | requests | canvas | server tokens/s | engine tokens/s | server / engine | server step ms | engine ms/iteration | commit-to-chunk mean / p99 ms | same tokens | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, e, c = r["server"], r["engine"], r["server"]["commit_to_chunk"]
        p99 = c.get("p99_le_s")
        lines.append(
            f"| {r['slots']} | {r['requests']} | {'on' if r['canvas'] else 'off'} | {s['tokens_per_s']:.1f} | "
            f"{e['tokens_per_s']:.1f} | {r['server_over_engine']:.3f} | {ms(s['step'].get('mean_s'))} | "
            f"{e['ms_per_iteration']:.2f} | {ms(c.get('mean_s'))} / <= {ms(p99)} | {r['same_tokens']} | "
            f"{s['errors'] or 'none'} |"
        )
    curve = rows[-1]["curve"]
    if curve:
        lines += [
            "",
            f"Latency-throughput curve, {rows[-1]['slots']} slots (serve_curve.png):",
            "",
            "| offered req/s | ok | req/s | tokens/s | first text p50 / p99 s | latency p50 / p90 / p99 s |",
            "|---|---|---|---|---|---|",
        ]
        for c in curve:
            lines.append(
                f"| {c['rate']:g} | {c['ok']}/{c['requests']} | {c['requests_per_s']:.2f} | {c['tokens_per_s']:.1f} | "
                f"{c['first_text_p50_s']:.3f} / {c['first_text_p99_s']:.3f} | {c['latency_p50_s']:.3f} / "
                f"{c['latency_p90_s']:.3f} / {c['latency_p99_s']:.3f} |"
            )
    md = "\n".join(lines)
    write_text_atomically(opts.out / "serve_bench.json", json.dumps(report, indent=1))
    write_text_atomically(opts.out / "serve_bench.md", md + "\n")
    print(md)


def ms(value) -> str:
    return "-" if value is None else f"{1e3 * value:.2f}"


def main(argv=None) -> int:
    opts = parse_args(argv)
    config = tiny_config() if opts.smoke else llada_8b_config()
    t = time.perf_counter()
    if opts.smoke:
        weights = init_params(config, jax.random.key(0))
    else:
        weights = jax.block_until_ready(init_params_per_layer(config, jax.random.key(0)))
    print(f"random weights on {jax.devices()[0]} in {time.perf_counter() - t:.1f} s", flush=True)
    engine = Engine(config, weights, backend="auto")
    opts.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (slots, canvas) in enumerate(opts.configs):
        rows.append(run_config(engine, config, opts, slots, canvas, curve=i == len(opts.configs) - 1))
        write_report(opts, rows)  # after each configuration: a run cut short keeps what it measured
    ok = all(not r["server"]["errors"] and r["same_tokens"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
