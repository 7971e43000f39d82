"""dllm-serve: the OpenAI-compatible server (also `python -m dllm_jax.serve`).

  dllm-serve                                   # the embedded tiny model on 127.0.0.1:8000
  dllm-serve --model PATH --method flash_cache+verify --batch-size 32 --api-key KEY

Every loop the server needs is compiled before it listens (the warm-up, timed in the log
and in /metrics); nothing compiles while serving. SIGTERM (or Ctrl-C) stops accepting,
lets running requests finish for --shutdown-grace seconds, fails the rest with a clear
error, and exits. Bad options: one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from dllm_jax.common.errors import SamplingParamsError
from dllm_jax.models.checkpoint.dtypes import QUANTIZATIONS
from dllm_jax.models.model_source import MODEL_HELP, resolve_model_path
from dllm_jax.runtime import compile_cache
from dllm_jax.sampling.params import SamplingParams

log = logging.getLogger("dllm_jax.serve")

# dllm_jax.serve.assemble.METHOD_SPECS (not imported here: --help stays fast)
METHOD_SPECS = ("flash_cache", "flash_cache+verify", "fast_dllm", "llada", "dream")


class UsageError(ValueError):
    """A bad command line; the message names the option."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dllm-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--served-model-name", help="the name clients send as 'model' (default: the folder's name)")
    p.add_argument(
        "--method",
        action="append",
        choices=METHOD_SPECS,
        help="decoding method; repeat to serve several (clients pick one with dllm.method; "
        "the first is the default). Default: flash_cache",
    )
    p.add_argument("--batch-size", type=int, default=8, help="decode slots per method (default 8)")
    p.add_argument(
        "--gen-length",
        type=int,
        help="answer positions, the largest max_tokens (default: 64 for a model of at most 512 positions, else 256)",
    )
    p.add_argument("--max-model-len", type=int, help="prompt + answer positions (default: the model's)")
    p.add_argument("--threshold", type=float, help="default confidence threshold (default: the method's)")
    p.add_argument(
        "--gamma", type=float, help="default Flash-Verify threshold of +verify methods (default: the engine's)"
    )
    p.add_argument("--block-length", type=int, help="block / window length (default: the method's)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("DLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $DLLM_API_KEY)",
    )
    p.add_argument("--max-waiting", type=int, default=256, help="requests waiting for a slot before 429 (default 256)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (default 1 MiB)")
    p.add_argument(
        "--iterations-per-call",
        type=int,
        default=1,
        help="loop iterations per device call (1: every step is streamed as it happens; default 1)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds running requests may finish after SIGTERM (default 30)",
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: float32 on the CPU, else bfloat16")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="8-bit block projections and an int8 embedding (fp8: W8A8, int8-weights: weight-only); "
        "default: as the checkpoint stores them",
    )
    p.add_argument("--backend", choices=("auto", "xla", "pallas"), default="auto", help="kernels (default auto)")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="answers independent of the load (and, with XLA's deterministic ops, of the run); slower",
    )
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving (for scripts and tests)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="default info")
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> None:
    for name in ("batch_size", "max_waiting", "max_body_bytes", "iterations_per_call"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    for name in ("request_timeout", "shutdown_grace"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected > 0")
    if args.gamma is not None and not any(m.endswith("+verify") for m in args.method or []):
        raise UsageError("--gamma applies to Flash-Verify: add --method flash_cache+verify")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port={args.port}: expected 0-65535")
    for name in ("threshold", "gamma"):  # the requests' defaults: the range of the knob they default
        try:
            SamplingParams(**{name: getattr(args, name)})
        except SamplingParamsError as e:
            raise UsageError(f"--{name}: {str(e).removeprefix('SamplingParams: ')}") from None
    from dllm_jax.runtime.memory_estimate import memory_override

    memory_override()  # a bad $DLLM_MEMORY_AVAILABLE, before the model loads


def build(args: argparse.Namespace):
    """Loads the model and assembles the server (compiling and warming up its loops)."""
    if args.batch_invariant:
        from dllm_jax.runtime.batch_invariance import deterministic_xla_flags

        os.environ["XLA_FLAGS"] = deterministic_xla_flags()  # before JAX starts its backend
    path = resolve_model_path(args.model)
    import jax

    from dllm_jax.common.platform import start_backend
    from dllm_jax.engine.engine import Engine
    from dllm_jax.runtime.decode_config import DecodeConfigError
    from dllm_jax.serve.assemble import ServeOptions, assemble

    start_backend()  # an impossible JAX_PLATFORMS is one line
    # the warm-up's loops read back by the next start ($DLLM_JAX_COMPILE_CACHE: a folder, or off)
    compile_cache.enable_compile_cache(compile_cache.cache_dir_setting(None, False))
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    engine = Engine.from_pretrained(
        str(path),
        dtype=dtype,
        quantization=args.quantization,
        backend=args.backend,
        batch_invariant=args.batch_invariant,
    )
    if engine.tokenizer is None:
        raise UsageError(f"--model {path}: the folder has no tokenizer files; the server needs them")
    limit = engine.config.max_sequence_length
    options = ServeOptions(
        model_name=args.served_model_name or served_name(args.model, path),
        methods=tuple(dict.fromkeys(args.method or ["flash_cache"])),
        batch_size=args.batch_size,
        gen_length=args.gen_length or (64 if limit <= 512 else 256),
        max_model_len=args.max_model_len,
        threshold=args.threshold,
        gamma=args.gamma,
        block_length=args.block_length,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        iterations_per_call=args.iterations_per_call,
    )
    try:
        return assemble(engine, engine.tokenizer, options)
    except DecodeConfigError as e:
        raise UsageError(f"--method: {e}") from None


def served_name(model: str | None, path: Path) -> str:
    """The name clients send as "model" by default: a Hub id or embedded name as given, a
    folder's own name (never a snapshot's commit hash)."""
    return model if model and not Path(model).exists() else path.name


def serve(server, args: argparse.Namespace) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, and on SIGTERM/SIGINT: stop accepting, then fail what is left after the grace."""

        draining = False

        def handle_exit(self, sig, frame):
            if not self.draining:
                self.draining = True
                log.info("signal %s: finishing running requests (up to %.0f s), then exiting", sig, args.shutdown_grace)
                server.worker.stop_accepting()
                timer = threading.Timer(
                    args.shutdown_grace,
                    server.worker.stop,
                    kwargs={"reason": "the server shut down before this request finished"},
                )
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(args.shutdown_grace) + 5,
        lifespan="on",
    )
    uv = Server(config)
    if args.port_file is not None:

        def report_port():
            while not uv.started and not uv.should_exit:
                time.sleep(0.05)
            if uv.started:
                port = uv.servers[0].sockets[0].getsockname()[1]
                tmp = args.port_file.with_name(f".{args.port_file.name}.{uuid.uuid4().hex}")
                tmp.write_text(str(port))
                tmp.replace(args.port_file)

        threading.Thread(target=report_port, daemon=True).start()
    uv.run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _check(args)
        server = build(args)
    except UsageError as e:
        print(f"dllm-serve: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # ConversionError, TokenizerError, GenerationError are ValueErrors
        print(f"dllm-serve: {e}", file=sys.stderr)
        return 2
    serve(server, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
