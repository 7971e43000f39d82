"""The ASGI app: OpenAI's chat and text completion endpoints over the engine worker.

  POST /v1/chat/completions   messages -> chat template -> n answers (stream or not)
  POST /v1/completions        a prompt, a list of prompts, token ids -> n choices each
  GET  /v1/models             the served model
  GET  /health                200 while the engine runs (no API key needed)
  GET  /metrics               Prometheus text
  GET  /                      the playground page (dllm_jax/serve/playground.py)

Streams are Server-Sent Events of OpenAI chunks whose text is the answer's stable prefix;
with ``"dllm": {"canvas": true}`` each chunk also carries the step's commits. Each choice is
a request of its own in the engine (n > 1: independent samples, seeds derived per choice).
Prompts are tokenized off the event loop; a client that disconnects, streaming or not,
has its requests aborted at the engine's next call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dllm_jax.engine.results import TokenLogprob
from dllm_jax.serve.errors import APIError, install_error_handlers
from dllm_jax.serve.heap import frozen_startup_heap
from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serve.middleware import GuardMiddleware
from dllm_jax.serve.playground import add_playground
from dllm_jax.serve.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from dllm_jax.serve.responses import ChoiceRun, Piece, diffusion_stats, usage
from dllm_jax.serve.stable_text import StableText
from dllm_jax.serve.worker import EngineWorker, Work

log = logging.getLogger("dllm_jax.serve")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What the app needs to know about the engine and its limits.

    model_name: the name clients send as "model"; max_model_len: the model's positions;
    gen_length: answer positions of the compiled loop (the canvas, and max_tokens at most this);
    max_prompt_tokens: the longest prompt accepted; vocab_size, end_ids (EOS, ...);
    refused_ids: token ids a token-id prompt may not hold (the mask and padding ids);
    max_logprobs: the most alternatives per token a request may ask (the loops record them;
    None: no logprobs);
    max_prompts: prompts x n (choices) of one request at most;
    request_timeout: seconds a request may take (dllm.timeout may ask for less);
    api_key: Bearer token required on every endpoint but /health (None: open);
    max_body_bytes: request body limit; body_timeout: seconds to receive a request's body.
    """

    model_name: str
    max_model_len: int
    gen_length: int
    max_prompt_tokens: int
    vocab_size: int
    end_ids: tuple[int, ...]
    refused_ids: dict[int, str] = dataclasses.field(default_factory=dict)
    max_logprobs: int | None = None
    max_prompts: int = 128
    request_timeout: float = 600.0
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: empty (None serves without a key)")


# builds the session's per-request parameters from a request body, its method and its choice index
ParamsBuilder = Callable[[_Sampling, str, int], Any]


def create_app(
    worker: EngineWorker,
    tokenizer: Any,
    settings: ServerSettings,
    metrics: ServerMetrics,
    make_params: ParamsBuilder,
) -> FastAPI:
    """The app over a worker that it starts and stops with its lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        with frozen_startup_heap(metrics.gc_pause_seconds):
            worker.start()
            try:
                yield
            finally:
                worker.stop()

    app = FastAPI(title="dllm-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(
        GuardMiddleware,
        max_body_bytes=settings.max_body_bytes,
        api_key=settings.api_key,
        body_timeout=settings.body_timeout,
    )
    serving = _Serving(worker, tokenizer, settings, metrics, make_params)

    add_playground(app)

    @app.get("/health")
    async def health():
        if worker.failure is not None:
            return JSONResponse({"status": "failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [serving.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        serving.check_model(name, param=None)
        return serving.model_card()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        serving.check_request(body, prompts=1)
        prompt = await asyncio.to_thread(serving.encode_chat, body)
        return await serving.respond(request, body, [prompt], chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt", code="invalid_value") from None
        serving.check_request(body, prompts=len(prompts))
        encoded = await asyncio.to_thread(lambda: [serving.encode_text(p, i) for i, p in enumerate(prompts)])
        echoes = [serving.prompt_text(p) for p in prompts] if body.echo else None
        return await serving.respond(request, body, encoded, chat=False, echoes=echoes)

    return app


class _Serving:
    """The request handling behind the routes."""

    def __init__(
        self,
        worker: EngineWorker,
        tokenizer,
        settings: ServerSettings,
        metrics: ServerMetrics,
        make_params: ParamsBuilder,
    ):
        self.worker = worker
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics
        self.make_params = make_params

    def model_card(self) -> dict:
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.settings.created,
            "owned_by": "dllm-jax",
            "max_model_len": self.settings.max_model_len,
            "methods": list(self.worker.sessions),
        }

    def check_model(self, name: str, param: str | None = "model") -> None:
        if name != self.settings.model_name:
            self.metrics.errors.labels("unknown_model").inc()
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.settings.model_name}'",
                param=param,
                code="model_not_found",
            )

    def check_request(self, body: _Sampling, *, prompts: int) -> None:
        """What can be refused before tokenizing: the model, fields at values this server does
        not support, the request's size."""
        self.check_model(body.model)
        refused = body.unsupported()
        if refused is not None:
            param, why = refused
            raise APIError(400, why, param=param, code="unsupported_parameter")
        limit = self.settings.max_prompts
        if prompts * body.n > limit:
            param = "prompt" if isinstance(body, CompletionRequest) else "n"
            raise APIError(
                400,
                f"{prompts} prompt(s) x n={body.n} = {prompts * body.n} answers; this server answers at most {limit} "
                "per request",
                param=param,
                code="too_many_prompts",
            )
        wanted, recorded = body.top_logprobs_wanted, self.settings.max_logprobs
        if wanted is not None and (recorded is None or wanted > recorded):
            param = "top_logprobs" if isinstance(body, ChatCompletionRequest) and recorded is not None else "logprobs"
            how = "records no log-probabilities" if recorded is None else f"records at most {recorded} alternatives"
            raise APIError(
                400,
                f"{param}={wanted}: this server {how} per token (dllm-serve --max-logprobs)",
                param=param,
                code="invalid_value",
            )

    # ----- prompts (run off the event loop) ----------------------------------------------------

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
        try:
            ids = self.tokenizer.apply_chat_template(body.conversation())
        except ValueError as e:  # TokenizerError: the template refused these messages
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from None
        return self._checked(ids, "messages")

    def encode_text(self, prompt: str | list[int], index: int) -> list[int]:
        param = "prompt"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param=param)
            if not prompt.strip():
                raise APIError(400, f"prompt[{index}] is empty", param=param, code="invalid_value")
            # text is text: special tokens come from token-id prompts only
            return self._checked(self.tokenizer.encode(prompt, special_tokens=False), param)
        bad = [t for t in prompt if not 0 <= t < self.settings.vocab_size]
        if bad:
            raise APIError(
                400,
                f"prompt[{index}] has token ids outside [0, {self.settings.vocab_size}): {bad[:5]}",
                param=param,
                code="invalid_value",
            )
        for position, t in enumerate(prompt):
            if t in self.settings.refused_ids:
                raise APIError(
                    400,
                    f"prompt[{index}] holds token id {t} ({self.settings.refused_ids[t]}) at position {position}: "
                    "it cannot be part of a prompt",
                    param=param,
                    code="invalid_value",
                )
        return self._checked(list(prompt), param)

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as echo returns it."""
        if isinstance(prompt, str) or self.tokenizer is None:
            return prompt if isinstance(prompt, str) else ""
        return self.tokenizer.decode(prompt)

    def _checked(self, ids: list[int], param: str) -> list[int]:
        limit = self.settings.max_prompt_tokens
        if len(ids) > limit:
            self.metrics.errors.labels("prompt_too_long").inc()
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; this server accepts at most {limit} prompt tokens "
                f"(max_model_len {self.settings.max_model_len} minus gen_length {self.settings.gen_length})",
                param=param,
                code="context_length_exceeded",
            )
        if not ids:
            raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
        return ids

    # ----- one request -----------------------------------------------------------------------

    def _lengths(self, body: _Sampling) -> tuple[int, int]:
        """The answer's canvas (dllm.gen_length, else the server's) and its cut (max_tokens,
        else the canvas)."""
        G = self.settings.gen_length
        canvas = body.dllm.gen_length
        if canvas is not None and canvas > G:
            raise APIError(
                400,
                f"dllm.gen_length={canvas} is more than this server's generation length ({G})",
                param="dllm.gen_length",
                code="invalid_value",
            )
        canvas = G if canvas is None else canvas
        asked = body.requested_max_tokens()
        if asked is not None and asked > canvas:
            where = "the request's dllm.gen_length" if body.dllm.gen_length is not None else "this server generates"
            raise APIError(
                400,
                f"max_tokens={asked} is more than {where} per answer ({canvas})",
                param="max_tokens",
                code="invalid_value",
            )
        return canvas, canvas if asked is None else asked

    def _method(self, body: _Sampling) -> str:
        method = body.dllm.method or self.worker.default_method
        if method not in self.worker.sessions:
            raise APIError(
                400,
                f"dllm.method={method!r}: this server runs {list(self.worker.sessions)}",
                param="dllm.method",
                code="invalid_value",
            )
        if body.dllm.cfg_scale and not self.worker.sessions[method].compiled.loop.cfg:
            guided = [m for m, s in self.worker.sessions.items() if s.compiled.loop.cfg]
            how = (
                f"send dllm.method={guided[0]!r}"
                if guided
                else "start the server with --method llada+cfg (its loop runs a second, unconditional pass per step)"
            )
            raise APIError(
                400,
                f"dllm.cfg_scale={body.dllm.cfg_scale} needs the classifier-free-guidance loop, which method "
                f"{method!r} does not run: {how}",
                param="dllm.cfg_scale",
                code="invalid_value",
            )
        return method

    async def respond(
        self,
        request: Request,
        body: _Sampling,
        prompts: list[list[int]],
        *,
        chat: bool,
        echoes: list[str] | None = None,
    ):
        started = time.monotonic()
        method = self._method(body)
        canvas, max_tokens = self._lengths(body)
        try:
            sampling = [self.make_params(body, method, j) for j in range(body.n)]
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        timeout = min(body.dllm.timeout or self.settings.request_timeout, self.settings.request_timeout)
        deadline = time.monotonic() + timeout
        prefix = "chatcmpl" if chat else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        runs: list[ChoiceRun] = []
        try:
            for i, ids in enumerate(prompts):
                for j, params in enumerate(sampling):
                    index = i * body.n + j
                    handle = self.worker.submit(Work(f"{response_id}-{index}", method, ids, params, deadline))
                    text = StableText(
                        self.tokenizer.decode,
                        canvas,
                        end_ids=self.settings.end_ids,
                        stops=body.stop_list,
                        max_tokens=max_tokens,
                    )
                    runs.append(
                        ChoiceRun(
                            handle,
                            text,
                            index,
                            token_text=self._token_text,
                            canvas=body.dllm.canvas,
                            deadline=deadline,
                            metrics=self.metrics,
                            logprobs=body.top_logprobs_wanted is not None,
                        )
                    )
        except APIError:
            for run in runs:
                run.handle.close()
            raise
        head = {"id": response_id, "created": int(time.time()), "model": self.settings.model_name}
        shape = _Shape(chat, self._token_text, echoes, body.n)

        def finished(status: int) -> None:
            _log_request(response_id, method, runs, status, started)

        if body.stream:
            chunks = self._stream(runs, head, shape, include_usage=body.include_usage, finished=finished)
            return StreamingResponse(
                chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        return await self._complete(request, runs, head, shape, finished)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    async def _complete(self, request: Request, runs: list[ChoiceRun], head: dict, shape: _Shape, finished) -> Any:
        """The whole answer; a client that disconnects first has its requests aborted at once."""
        texts = {r.index: shape.echo(r.index) for r in runs}
        logprobs: dict[int, list[TokenLogprob]] = {r.index: [] for r in runs}

        async def collect() -> None:
            for run in runs:
                async for piece, _ in run.pieces():
                    texts[piece.index] += piece.text
                    logprobs[piece.index] += piece.logprobs

        collecting = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():  # the client went away
                collecting.cancel()
                self.metrics.errors.labels("disconnected").inc()
                finished(499)
                return Response(status_code=499)
            collecting.result()  # raises the APIError of a failed choice
        except APIError as e:
            finished(e.status)
            raise
        finally:
            gone.cancel()
            for run in runs:
                run.handle.close()
        choices = [shape.choice(r, texts[r.index], logprobs[r.index]) for r in sorted(runs, key=lambda r: r.index)]
        stats = [r.stats for r in runs]
        kind = "chat.completion" if shape.chat else "text_completion"
        finished(200)
        return {**head, "object": kind, "choices": choices, "usage": usage(stats), "dllm": diffusion_stats(stats)}

    async def _stream(
        self, runs: list[ChoiceRun], head: dict, shape: _Shape, *, include_usage: bool, finished
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if shape.chat else "text_completion"
        status = 499  # until the stream ends normally: the client left
        try:
            if shape.chat:
                for run in runs:
                    delta = {"index": run.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield _sse({**head, "object": kind, "choices": [{**delta, "logprobs": None}]})
            elif shape.echoes is not None:
                for run in runs:
                    piece = Piece(run.index, shape.echo(run.index), None, None)
                    yield _sse({**head, "object": kind, "choices": [shape.chunk_choice(piece, 0)]})
            offsets = {r.index: len(shape.echo(r.index)) for r in runs}
            prefix = _chunk_prefix(head, kind)
            async for piece, received in _merged(runs):
                event = _piece_sse(prefix, shape.chunk_choice(piece, offsets[piece.index]), piece.canvas)
                offsets[piece.index] += len(piece.text)
                self.metrics.commit_to_chunk_seconds.observe(time.perf_counter() - received)
                yield event
            # a step's events wake every stream at once: the other streams' chunks of the step go
            # before this one's end (its usage, [DONE], log line and the HTTP response's close)
            await asyncio.sleep(0)
            if include_usage:
                stats = [r.stats for r in runs]
                yield _sse(
                    {**head, "object": kind, "choices": [], "usage": usage(stats), "dllm": diffusion_stats(stats)}
                )
            status = 200
        except APIError as e:
            status = e.status
            self.metrics.errors.labels(e.code or "error").inc()
            yield _sse(e.body())
        finally:
            for run in runs:
                run.handle.close()
            finished(status)
        yield "data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True)
class _Shape:
    """How one response's choices are written: chat or text completion, echoed prompts (per
    prompt, each choice of prompt i = index // n), log-probabilities in OpenAI's two formats."""

    chat: bool
    token_text: Callable[[int], str]
    echoes: list[str] | None
    n: int

    def echo(self, index: int) -> str:
        return "" if self.echoes is None else self.echoes[index // self.n]

    def choice(self, run: ChoiceRun, text: str, logprobs: list[TokenLogprob]) -> dict:
        records = self.logprobs(logprobs, len(self.echo(run.index))) if run.logprobs else None
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": run.index, "message": message, "finish_reason": run.finish_reason, "logprobs": records}
        return {"index": run.index, "text": text, "finish_reason": run.finish_reason, "logprobs": records}

    def chunk_choice(self, piece: Piece, offset: int) -> dict:
        records = self.logprobs(piece.logprobs, offset) if piece.logprobs else None
        if self.chat:
            delta = {"content": piece.text}
            return {"index": piece.index, "delta": delta, "finish_reason": piece.finish_reason, "logprobs": records}
        return {"index": piece.index, "text": piece.text, "finish_reason": piece.finish_reason, "logprobs": records}

    def logprobs(self, records: list[TokenLogprob] | tuple[TokenLogprob, ...], offset: int) -> dict:
        """OpenAI's logprobs object: chat's {"content": [...]}, completions' parallel lists
        (text_offset: each token's offset in the choice's text, from `offset`)."""
        if self.chat:

            def entry(token_id: int, logprob: float) -> dict:
                text = self.token_text(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            content = [
                {**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in records
            ]
            return {"content": content, "refusal": None}
        tokens = [self.token_text(r.token_id) for r in records]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{self.token_text(t): lp for t, lp in r.top} for r in records],
            "text_offset": offsets,
        }


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the request's body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _log_request(response_id: str, method: str, runs: list[ChoiceRun], status: int, started: float) -> None:
    stats = [r.stats for r in runs]
    reasons = sorted({r.finish_reason for r in runs if r.finish_reason is not None})
    log.info(
        "%s %s: %d, %d choice(s), %d prompt + %d completion tokens, %d steps, finish %s, %.2f s",
        response_id,
        method,
        status,
        len(runs),
        sum(s.prompt_tokens for s in stats),
        sum(s.completion_tokens for s in stats),
        sum(s.steps for s in stats),
        "/".join(reasons) or "-",
        time.monotonic() - started,
    )


# one encoder for every chunk (json.dumps builds a new one per call when given separators)
_JSON = json.JSONEncoder(separators=(",", ":"))


def _sse(payload: dict) -> str:
    return f"data: {_JSON.encode(payload)}\n\n"


def _chunk_prefix(head: dict, kind: str) -> str:
    """The start of every piece's event of one response, encoded once: `data: {"id":...,"object":
    kind,"choices":`."""
    return f'data: {_JSON.encode({**head, "object": kind})[:-1]},"choices":'


def _piece_sse(prefix: str, choice: dict, canvas: dict | None) -> str:
    """One piece's event, the bytes of _sse({**head, "object": kind, "choices": [choice]}), with
    "dllm": canvas last when the canvas is streamed."""
    dllm = "" if canvas is None else f',"dllm":{_JSON.encode(canvas)}'
    return f"{prefix}{_JSON.encode([choice])}{dllm}}}\n\n"


async def _merged(runs: list[ChoiceRun]) -> AsyncIterator[tuple[Piece, float]]:
    """The pieces of several choices as they come (one choice: its own order)."""
    if len(runs) == 1:
        async for item in runs[0].pieces():
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run: ChoiceRun):
        try:
            async for item in run.pieces():
                await queue.put(item)
        except APIError as e:
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
