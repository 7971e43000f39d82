"""Open-loop load on a running dllm-serve: requests arrive at a given rate whatever the answers.

    python scripts/load_test.py --url http://127.0.0.1:8000 --rate 4 --requests 64
    python scripts/load_test.py --rate 1 2 4 8 --requests 32 --output load.json
    python scripts/load_test.py --rate inf --requests 64 --prompt-ids 256   # saturating, token-id prompts
    python scripts/load_test.py --rate 1 4 16 64 --prompt-ids 64 256 --max-tokens 32 128 \
        --methods flash_cache flash_cache+verify --plot curve.png        # a mix, and its curve

Arrivals are a Poisson process at --rate requests/s (inf: all at once). Every request
streams (/v1/completions, or /v1/chat/completions with --chat) with usage included; the
report gives requests/s, completion tokens/s, time to the first stable text, end-to-end
latency (p50/p90/p99) and errors by status. Prompts: the embedded model's held-out problems
(default), a JSONL file of {"prompt": ...} lines, or --prompt-ids N random token ids (several
lengths: each request draws one). Several --max-tokens or --methods: each request draws one
(the same draws at every rate). --plot draws latency and time to first text against the
throughput achieved at each rate (matplotlib). This script is the client only: it never shares
the server's interpreter. Bounded: --requests in total, --timeout per request. Bad options: a
message, exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server address (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", help="Bearer token, if the server wants one")
    p.add_argument("--model", help="model name (default: the server's first, from /v1/models)")
    p.add_argument("--rate", type=float, nargs="+", default=[4.0], help="requests per second; several: one run each")
    p.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    p.add_argument(
        "--max-tokens", type=int, nargs="+", help="max_tokens of each request, drawn from these (default: the server's)"
    )
    p.add_argument(
        "--methods", nargs="+", help="dllm.method of each request, drawn from these (default: the server's first)"
    )
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default /v1/completions)")
    p.add_argument("--prompts-file", type=Path, help='JSONL with a "prompt" string per line')
    p.add_argument("--prompt-ids", type=int, nargs="+", help="random token-id prompts of these lengths instead of text")
    p.add_argument("--vocab", type=int, default=100, help="token ids are drawn from [0, vocab) (default 100)")
    p.add_argument("--dllm", type=json.loads, default=None, help='the "dllm" extension object, as JSON')
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--seed", type=int, default=0, help="arrivals and prompts (default 0)")
    p.add_argument("--output", type=Path, help="write the report as JSON here")
    p.add_argument("--plot", type=Path, help="draw latency against throughput into this PNG (needs matplotlib)")
    p.add_argument(
        "--replot", type=Path, metavar="JSON", help="only draw --plot from an earlier --output report (no requests)"
    )
    opts = p.parse_args(argv)
    if opts.replot is not None and opts.plot is None:
        p.error("--replot needs --plot PNG")
    if opts.requests < 1:
        p.error("--requests: expected >= 1")
    if any(r <= 0 for r in opts.rate):
        p.error("--rate: expected > 0 (inf: all at once)")
    if opts.prompt_ids is not None and opts.chat:
        p.error("--prompt-ids needs /v1/completions (drop --chat)")
    for name in ("prompt_ids", "max_tokens"):
        if any(n < 1 for n in getattr(opts, name) or ()):
            p.error(f"--{name.replace('_', '-')}: expected positive integers")
    if opts.plot is not None and opts.plot.suffix.lower() != ".png":
        p.error(f"--plot {opts.plot}: expected a .png path")
    return opts


def load_prompts(opts) -> list:
    rng = random.Random(opts.seed)
    if opts.prompt_ids is not None:
        lengths = [rng.choice(opts.prompt_ids) for _ in range(opts.requests)]
        return [[rng.randrange(opts.vocab) for _ in range(n)] for n in lengths]
    if opts.prompts_file is not None:
        if not opts.prompts_file.is_file():
            raise ValueError(f"{opts.prompts_file}: prompts file not found")
        lines = [line for line in opts.prompts_file.read_text().splitlines() if line.strip()]
        prompts = [json.loads(line)["prompt"] for line in lines]
    else:
        from dllm_jax.evaluation.tiny_tasks import held_out_problems

        prompts = [p.prompt for p in held_out_problems(opts.requests, seed=opts.seed)]
    if not prompts:
        raise ValueError("no prompts")
    return [prompts[i % len(prompts)] for i in range(opts.requests)]


def request_mix(opts) -> list[dict]:
    """Each request's own fields (max_tokens, dllm.method), drawn once so every rate sends the same."""
    rng = random.Random(opts.seed + 1)
    mix = []
    for _ in range(opts.requests):
        fields: dict = {}
        if opts.max_tokens:
            fields["max_tokens"] = rng.choice(opts.max_tokens)
        dllm = dict(opts.dllm or {})
        if opts.methods:
            dllm["method"] = rng.choice(opts.methods)
        if dllm:
            fields["dllm"] = dllm
        mix.append(fields)
    return mix


async def one_request(http: httpx.AsyncClient, opts, model: str, prompt, fields: dict, sent: float) -> dict:
    if opts.chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(model=model, stream=True, stream_options={"include_usage": True}, **fields)
    record = {"status": None, "first_text_s": None, "latency_s": None, "completion_tokens": 0, "error": None}
    try:
        async with http.stream("POST", path, json=body, timeout=opts.timeout) as r:
            record["status"] = r.status_code
            if r.status_code != 200:
                record["error"] = (await r.aread()).decode(errors="replace")[:300]
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record["error"] = chunk["error"]["message"]
                    break
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text and record["first_text_s"] is None:
                        record["first_text_s"] = time.perf_counter() - sent
                if chunk.get("usage"):
                    record["completion_tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        record["error"] = f"{type(e).__name__}: {e}"
    record["latency_s"] = time.perf_counter() - sent
    return record


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


async def run_at_rate(opts, model: str, prompts: list, mix: list[dict], rate: float) -> dict:
    rng = random.Random(opts.seed)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=opts.url, headers=headers, limits=limits) as http:
        start = time.perf_counter()
        tasks, due = [], start
        for prompt, fields in zip(prompts, mix):
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(http, opts, model, prompt, fields, time.perf_counter())))
            if math.isfinite(rate):
                due += rng.expovariate(rate)
        records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ok = [r for r in records if r["status"] == 200 and r["error"] is None]
    errors: dict[str, int] = {}
    for r in records:
        if r not in ok:
            key = str(r["status"]) if r["status"] not in (None, 200) else (r["error"] or "error")[:80]
            errors[key] = errors.get(key, 0) + 1
    tokens = sum(r["completion_tokens"] for r in ok)
    first = [r["first_text_s"] for r in ok if r["first_text_s"] is not None]
    latency = [r["latency_s"] for r in ok]
    return {
        "rate": rate,
        "requests": len(records),
        "ok": len(ok),
        "errors": errors,
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "first_text_p50_s": percentile(first, 0.5),
        "first_text_p99_s": percentile(first, 0.99),
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p90_s": percentile(latency, 0.9),
        "latency_p99_s": percentile(latency, 0.99),
        "latency_mean_s": statistics.fmean(latency) if latency else None,
    }


def server_model(opts) -> str:
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    r = httpx.get(f"{opts.url}/v1/models", headers=headers, timeout=30)
    if r.status_code != 200:
        raise ValueError(f"{opts.url}/v1/models answered {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


def plot_curve(runs: list[dict], path: Path, title: str) -> None:
    """Latency (p50, p99) and time to first text (p50) against the completion tokens/s achieved,
    one point per offered rate, written atomically to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dllm_jax.common.atomic_write import write_bytes_atomically

    runs = sorted((r for r in runs if r["ok"]), key=lambda r: r["tokens_per_s"])
    x = [r["tokens_per_s"] for r in runs]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for key, label, style in (
        ("latency_p50_s", "latency p50", "o-"),
        ("latency_p99_s", "latency p99", "s--"),
        ("first_text_p50_s", "first text p50", "^:"),
    ):
        ax.plot(x, [r[key] for r in runs], style, label=label)
    for r in runs:
        ax.annotate(
            f"{r['rate']:g}/s",
            (r["tokens_per_s"], r["latency_p99_s"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=7,
        )
    ax.set_xlabel("completion tokens/s (achieved)")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    write_bytes_atomically(path, buffer.getvalue())


def fmt(value, unit="") -> str:
    return "-" if value is None else f"{value:.3f}{unit}"


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.replot is not None:
        try:
            report = json.loads(opts.replot.read_text())
            runs = report["runs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"load_test: --replot {opts.replot}: {e}", file=sys.stderr)
            return 2
        where = f" at {report['url']}" if report.get("url") else ""
        plot_curve(runs, opts.plot, f"{report.get('model')}{where}, {runs[0].get('requests')} requests per rate")
        return 0
    try:
        prompts = load_prompts(opts)
        model = opts.model or server_model(opts)
    except (ValueError, KeyError, httpx.HTTPError) as e:
        print(f"load_test: {e}", file=sys.stderr)
        return 2
    mix = request_mix(opts)
    runs = []
    for rate in opts.rate:
        run = asyncio.run(run_at_rate(opts, model, prompts, mix, rate))
        runs.append(run)
        print(
            f"rate {rate:g}/s: {run['ok']}/{run['requests']} ok, {run['requests_per_s']:.2f} req/s, "
            f"{run['tokens_per_s']:.1f} tokens/s, first text p50 {fmt(run['first_text_p50_s'], ' s')} "
            f"p99 {fmt(run['first_text_p99_s'], ' s')}, latency p50 {fmt(run['latency_p50_s'], ' s')} "
            f"p99 {fmt(run['latency_p99_s'], ' s')}, errors {run['errors'] or 'none'}",
            flush=True,
        )
    report = {
        "url": opts.url,
        "model": model,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "runs": runs,
    }
    if opts.output is not None:
        from dllm_jax.common.atomic_write import write_text_atomically

        write_text_atomically(opts.output, json.dumps(report, indent=1))
    if opts.plot is not None:
        plot_curve(runs, opts.plot, f"{model} at {opts.url}, {opts.requests} requests per rate")
    return 0 if all(not r["errors"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
