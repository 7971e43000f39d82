"""Builds a server around an engine: one session per method, the warm-up, the worker, the app."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from fastapi import FastAPI

from dllm_jax.engine.engine import Engine
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.serve.app import ServerSettings, create_app
from dllm_jax.serve.method_specs import METHOD_SPECS
from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serve.params import make_params
from dllm_jax.serve.protocol import CompletionRequest
from dllm_jax.serve.worker import EngineWorker

log = logging.getLogger("dllm_jax.serve")


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """The server's engine-level choices (see dllm-serve --help)."""

    model_name: str
    methods: tuple[str, ...] = ("flash_cache",)
    batch_size: int = 8
    gen_length: int = 64
    max_model_len: int | None = None
    threshold: float | None = None
    gamma: float | None = None
    block_length: int | None = None
    api_key: str | None = None
    max_waiting: int = 256
    request_timeout: float = 600.0
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    iterations_per_call: int = 1
    max_logprobs: int | None = 0  # alternatives recorded per token; None: no logprobs compiled
    max_prompts: int = 128
    log_interval: float = 10.0


@dataclasses.dataclass(frozen=True)
class Server:
    app: FastAPI
    worker: EngineWorker
    metrics: ServerMetrics
    settings: ServerSettings
    warmup_seconds: float


def decode_config(spec: str, options: ServeOptions) -> DecodeConfig:
    """The DecodeConfig of a --method spec (raises DecodeConfigError / ValueError)."""
    if spec not in METHOD_SPECS:
        raise ValueError(f"method {spec!r}: expected one of {METHOD_SPECS}")
    method, _, extra = spec.partition("+")
    return DecodeConfig(
        method=method,
        gen_length=options.gen_length,
        batch_size=options.batch_size,
        verify=extra == "verify",
        cfg=extra == "cfg",
        block_length=options.block_length,
        # the canvas loop records no log-probabilities (a request asking for them is refused)
        max_logprobs=None if method == "diffusion_gemma" else options.max_logprobs,
    )


def request_defaults(decode_config: DecodeConfig, options: ServeOptions) -> dict[str, Any]:
    """The server's defaults of the SamplingParams a request leaves unset, for one method:
    --threshold where it commits by threshold, --gamma where it verifies."""
    defaults = {}
    if options.threshold is not None and decode_config.schedule == "threshold":
        defaults["threshold"] = options.threshold
    if options.gamma is not None and decode_config.verify:
        defaults["gamma"] = options.gamma
    return defaults


def assemble(engine: Engine, tokenizer: Any, options: ServeOptions) -> Server:
    """Compiles and warms up every method's loop, then builds the worker and the app (not started)."""
    limit = engine.config.max_sequence_length
    max_model_len = options.max_model_len or limit
    if not 0 < max_model_len <= limit:
        raise ValueError(f"max_model_len={max_model_len}: expected 1 to the model's {limit}")
    max_prompt = max_model_len - options.gen_length
    if max_prompt < 1:
        raise ValueError(
            f"gen_length={options.gen_length} leaves no room for a prompt in max_model_len={max_model_len}"
        )
    configs = {spec: decode_config(spec, options) for spec in options.methods}
    metrics = ServerMetrics()
    sessions = {}
    start = time.perf_counter()
    for spec, decode in configs.items():
        log.info(
            "compiling %s (%d slots, gen_length %d, prompts up to %d tokens)",
            spec,
            options.batch_size,
            options.gen_length,
            max_prompt,
        )
        # Engine.compile checks the loop's memory against the device's before compiling it
        session = engine.session(decode, max_prompt_len=max_prompt, stream=True)
        memory = session.compiled.memory
        log.info("%s fits: about %.2f GiB per device (%s)", spec, memory.total / 2**30, memory.describe())
        warm_up(session, max_prompt)
        sessions[spec] = session
    warmup = time.perf_counter() - start
    metrics.warmup_seconds.set(warmup)
    metrics.watch_compilations()
    log.info("warm-up: every loop compiled and run in %.1f s", warmup)
    config = engine.config
    refused = {}
    if getattr(config, "mask_token_id", None) is not None:  # DiffusionGemma has none: it renoises with tokens
        refused[config.mask_token_id] = "the mask token"
    if config.pad_token_id is not None and config.pad_token_id not in config.eos_token_ids:
        refused[config.pad_token_id] = "the padding token"
    settings = ServerSettings(
        model_name=options.model_name,
        max_model_len=max_model_len,
        gen_length=options.gen_length,
        max_prompt_tokens=max_prompt,
        vocab_size=config.vocab_size,
        end_ids=tuple(config.eos_token_ids),
        refused_ids=refused,
        # none where no loop records them (the canvas loop records none)
        max_logprobs=options.max_logprobs if any(c.max_logprobs is not None for c in configs.values()) else None,
        max_prompts=options.max_prompts,
        request_timeout=options.request_timeout,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        body_timeout=options.body_timeout,
    )
    worker = EngineWorker(
        sessions,
        metrics,
        max_waiting=options.max_waiting,
        max_iterations=options.iterations_per_call,
        log_interval=options.log_interval,
    )
    defaults = {spec: request_defaults(config, options) for spec, config in configs.items()}
    app = create_app(
        worker,
        tokenizer,
        settings,
        metrics,
        lambda body, method, choice: make_params(body, defaults[method], choice=choice),
    )
    return Server(app, worker, metrics, settings, warmup)


def warm_up(session, max_prompt: int) -> None:
    """Runs the paths serving takes, so that they compile now: a request of the longest prompt
    to its end (its first 4 tokens: every step runs the one compiled loop, so a whole answer
    compiles nothing more and, on a CPU, took most of the start-up), and one aborted while it is
    in the device (the path a cancellation takes: its step bound set to 0 in its ring entry and
    slot). It is aborted right after the call that pushed it, since a request may finish at its
    first step (then there is nothing to abort). A last request's first call clears the read
    results' done flags (a device-side update)."""
    four_tokens = make_params(CompletionRequest(model="warm-up", prompt=[0], max_tokens=4))
    session.add("warm-up-0", [0] * max_prompt, four_tokens)
    session.add("warm-up-1", [0] * max_prompt, four_tokens)
    session.step(1)  # pushes both; their results are read at a later call
    if not session.abort("warm-up-1"):
        raise RuntimeError("the warm-up request to abort was not in the session")
    _run_to_the_end(session, "warm-up-0")
    session.add("warm-up-2", [0], make_params(CompletionRequest(model="warm-up", prompt=[0], max_tokens=1)))
    _run_to_the_end(session, "warm-up-2")


def _run_to_the_end(session, request_id: str) -> None:
    """Steps the session until request_id's result is read and nothing is left in it."""
    finished = False
    for _ in range(100_000):
        updates = session.step(1)
        finished = finished or any(u.request_id == request_id and u.result is not None for u in updates)
        if finished and not (session.num_running or session.num_waiting):
            return
    raise RuntimeError("the warm-up requests did not finish")
