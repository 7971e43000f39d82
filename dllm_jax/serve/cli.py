"""dllm-serve: the OpenAI-compatible server (also `python -m dllm_jax.serve`).

  dllm-serve                                   # the embedded tiny model on 127.0.0.1:8000
  DLLM_API_KEY=KEY dllm-serve --model PATH --method flash_cache+verify --batch-size 32

The port is bound first (a busy one fails at once), then every loop the server needs is
compiled before it listens (the warm-up, timed in the log and in /metrics); nothing compiles
while serving. SIGTERM (or Ctrl-C) stops accepting, lets running requests finish for
--shutdown-grace seconds, fails the rest with a clear error, and exits; Ctrl-C during the
start-up exits at once with status 130. Bad options: one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from dllm_jax.common.errors import SamplingParamsError
from dllm_jax.models.checkpoint.dtypes import QUANTIZATIONS
from dllm_jax.models.model_source import MODEL_HELP, resolve_model_path
from dllm_jax.runtime import compile_cache
from dllm_jax.sampling.generation_defaults import GENERATION_CONFIG_HELP, GENERATION_CONFIG_MODES
from dllm_jax.sampling.params import SamplingParams
from dllm_jax.serve.method_specs import METHOD_SPECS

log = logging.getLogger("dllm_jax.serve")

# third-party loggers kept at WARNING whatever --log-level says (jax's "Unable to initialize
# backend 'tpu'" is an INFO record on every machine without a TPU)
QUIET_LOGGERS = ("jax", "absl", "transformers", "httpx", "urllib3")


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
        "the first is the default; llada+cfg: LLaDA's loop with classifier-free guidance, for dllm.cfg_scale). "
        "Default: diffusion_gemma for a DiffusionGemma model, else flash_cache",
    )
    p.add_argument("--batch-size", type=int, default=8, help="decode slots per method (default 8)")
    p.add_argument(
        "--gen-length",
        type=int,
        help="answer positions: the canvas every answer decodes, cut at max_tokens (default: 64 for a model of "
        "at most 512 positions, else 256; diffusion_gemma: the canvases that hold the model's generation_config.json "
        "max_new_tokens, one without it)",
    )
    p.add_argument("--max-model-len", type=int, help="prompt + answer positions (default: the model's)")
    p.add_argument("--threshold", type=float, help="default confidence threshold (default: the method's)")
    p.add_argument(
        "--gamma", type=float, help="default Flash-Verify threshold of +verify methods (default: the engine's)"
    )
    p.add_argument("--block-length", type=int, help="block / window length (default: the method's)")
    p.add_argument("--generation-config", choices=GENERATION_CONFIG_MODES, default="auto", help=GENERATION_CONFIG_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health; a key on the command line is "
        "visible to every user of the machine (ps): prefer $DLLM_API_KEY or --api-key-file",
    )
    p.add_argument("--api-key-file", type=Path, help="read the API key from this file (its first line)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests waiting for a slot before 429 (default 256)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (default 1 MiB)")
    p.add_argument(
        "--max-prompts",
        type=int,
        default=128,
        help="answers per request at most: prompts x n (default 128)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=0,
        help="alternatives per token a request may ask (top_logprobs), compiled into every loop: 0 (default): "
        "the tokens' own log-probabilities only (a gather per step); K > 0: also the K most likely tokens (a "
        "top-K over the vocabulary per step); -1: no logprobs, nothing compiled for them",
    )
    p.add_argument(
        "--max-connections", type=int, default=512, help="open connections at most; more get 503 (default 512)"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send its request headers (default 10)",
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds a client has to send its request body (default 30)"
    )
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
        help="8-bit block projections (and DiffusionGemma's experts) and an int8 untied embedding (fp8: W8A8, "
        "int8-weights: weight-only); default: as the checkpoint stores them",
    )
    p.add_argument("--backend", choices=("auto", "xla", "pallas"), default="auto", help="kernels (default auto)")
    p.add_argument(
        "--mesh",
        help='decode over several devices, e.g. "data=2,tensor=2": slots split over data, heads and MLP over '
        "tensor, a DiffusionGemma model's experts over expert and tensor; the sizes multiply to the number of "
        "devices (each method's --batch-size a multiple of data)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="answers independent of the load (and, with XLA's deterministic ops, of the run); slower",
    )
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving (for scripts and tests)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="default info")
    p.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        help="seconds between throughput lines in the log (0: none; default 10)",
    )
    return p.parse_args(argv)


def configure_logging(level: str) -> None:
    """Our records at `level`, third-party libraries' at WARNING and up (no backend probing noise)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    # transformers sets its own level when first imported, from this variable
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file or $DLLM_API_KEY (in that order); an empty one is
    a usage error, not an open server."""
    given = [name for name in ("api_key", "api_key_file") if getattr(args, name) is not None]
    if len(given) > 1:
        raise UsageError("--api-key and --api-key-file: give one of them")
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
        key, where = (lines[0].strip() if lines else ""), f"--api-key-file {args.api_key_file}"
    elif args.api_key is not None:
        key, where = args.api_key, "--api-key"
    elif "DLLM_API_KEY" in os.environ:
        key, where = os.environ["DLLM_API_KEY"], "$DLLM_API_KEY"
    else:
        return None
    if not key.strip():
        raise UsageError(f"{where}: the API key is empty (leave it unset to serve without a key)")
    if key != key.strip() or any(not c.isprintable() for c in key):
        raise UsageError(f"{where}: the API key has white space or unprintable characters")
    return key


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a busy port fails in a second."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.listen(2048)
    return sock


def _check(args: argparse.Namespace) -> None:
    for name in ("batch_size", "max_waiting", "max_body_bytes", "iterations_per_call", "max_prompts"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    for name in ("request_timeout", "shutdown_grace", "header_timeout", "body_timeout"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected > 0")
    if not -1 <= args.max_logprobs <= 64:
        raise UsageError(f"--max-logprobs={args.max_logprobs}: expected -1 (none) to 64")
    if args.max_connections < 2:
        raise UsageError(f"--max-connections={args.max_connections}: expected >= 2")
    if not args.log_interval >= 0:
        raise UsageError(f"--log-interval={args.log_interval}: expected >= 0")
    args.api_key = api_key(args)
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

    from dllm_jax.common.errors import GenerationError
    from dllm_jax.common.platform import start_backend
    from dllm_jax.engine.engine import Engine
    from dllm_jax.runtime.decode_config import DecodeConfigError
    from dllm_jax.runtime.sharding import MeshError, parse_mesh
    from dllm_jax.serve.assemble import ServeOptions, assemble

    start_backend()  # an impossible JAX_PLATFORMS is one line
    # the warm-up's loops read back by the next start ($DLLM_JAX_COMPILE_CACHE: a folder, or off)
    compile_cache.enable_compile_cache(compile_cache.cache_dir_setting(None, False))
    try:
        mesh = parse_mesh(args.mesh) if args.mesh else None
    except MeshError as e:
        raise UsageError(f"--mesh: {e}") from None
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    engine = Engine.from_pretrained(
        str(path),
        dtype=dtype,
        quantization=args.quantization,
        backend=args.backend,
        batch_invariant=args.batch_invariant,
        mesh=mesh,
        generation_config=args.generation_config,
    )
    log.info("defaults of the values a request leaves unset: %s", engine.generation_defaults.describe())
    if engine.tokenizer is None:
        raise UsageError(f"--model {path}: the folder has no tokenizer files; the server needs them")
    limit = engine.config.max_sequence_length
    block_diffusion = engine.config.family == "diffusion_gemma"
    default_length = (
        engine.generation_defaults.canvas_bucket(engine.config.canvas_length, limit // 2)
        if block_diffusion
        else (64 if limit <= 512 else 256)
    )
    options = ServeOptions(
        model_name=args.served_model_name or served_name(args.model, path),
        methods=tuple(dict.fromkeys(args.method or ["diffusion_gemma" if block_diffusion else "flash_cache"])),
        batch_size=args.batch_size,
        gen_length=args.gen_length or default_length,
        max_model_len=args.max_model_len,
        threshold=args.threshold,
        gamma=args.gamma,
        block_length=args.block_length,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        iterations_per_call=args.iterations_per_call,
        max_logprobs=None if args.max_logprobs < 0 else args.max_logprobs,
        max_prompts=args.max_prompts,
        log_interval=args.log_interval,
    )
    try:
        return assemble(engine, engine.tokenizer, options)
    except (DecodeConfigError, GenerationError) as e:
        raise UsageError(f"--method: {e}") from None


def served_name(model: str | None, path: Path) -> str:
    """The name clients send as "model" by default: a Hub id or embedded name as given, a
    folder's own name (never a snapshot's commit hash)."""
    return model if model and not Path(model).exists() else path.name


def serve(server, args: argparse.Namespace, sock: socket.socket) -> None:
    import uvicorn

    from dllm_jax.serve.connections import guarded_protocol

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
        http=guarded_protocol(max_connections=args.max_connections, header_timeout=args.header_timeout),
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
    uv.run(sockets=[sock])


INTERRUPTED_DURING_START_UP = "dllm-serve: interrupted during start-up"


def _exit_interrupted(signum: int, frame) -> None:
    print(INTERRUPTED_DURING_START_UP, file=sys.stderr, flush=True)
    logging.shutdown()  # flushes the log's handlers
    os._exit(130)


@contextlib.contextmanager
def interrupt_exits_at_once():
    """Within: SIGINT prints one line and ends the process with status 130 from its handler.

    Not as a KeyboardInterrupt, which Python raises at whatever bytecode the main thread runs
    next. Raised inside one of jax's garbage-collection callbacks, it is swallowed ("Exception
    ignored in _xla_gc_callback") and the server starts anyway. Unwinding a half-built engine
    has also crashed the process (SIGSEGV, as the interrupted compile's objects were freed).
    Nothing of the server is written before it listens, so exiting at once loses nothing.
    Only in the main thread, and only where SIGINT raises KeyboardInterrupt (a process started
    with SIGINT ignored keeps ignoring it)."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if in_main else None
    if previous is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        if previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    sock = None
    try:
        with interrupt_exits_at_once():
            _check(args)
            sock = bind(args.host, args.port)
            server = build(args)
    except (KeyboardInterrupt, ValueError, OSError) as e:  # UsageError, ConversionError, TokenizerError, ...
        if sock is not None:
            sock.close()
        if isinstance(e, KeyboardInterrupt):  # where interrupt_exits_at_once installs no handler
            print(INTERRUPTED_DURING_START_UP, file=sys.stderr)
            return 130
        print(f"dllm-serve: {e}", file=sys.stderr)
        return 2
    serve(server, args, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
