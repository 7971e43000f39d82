"""The ASGI app: OpenAI's chat and text completion endpoints over the engine worker.

  POST /v1/chat/completions   messages -> chat template -> one answer (stream or not)
  POST /v1/completions        a prompt, a list of prompts, token ids -> one choice each
  GET  /v1/models             the served model
  GET  /health                200 while the engine runs (no API key needed)
  GET  /metrics               Prometheus text
  GET  /                      the playground page (dllm_jax/serve/playground.py)

Streams are Server-Sent Events of OpenAI chunks whose text is the answer's stable prefix;
with ``"dllm": {"canvas": true}`` each chunk also carries the step's commits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dllm_jax.serve.errors import APIError, install_error_handlers
from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serve.middleware import GuardMiddleware
from dllm_jax.serve.playground import add_playground
from dllm_jax.serve.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from dllm_jax.serve.responses import ChoiceRun, Piece, diffusion_stats, usage
from dllm_jax.serve.stable_text import StableText
from dllm_jax.serve.worker import EngineWorker, Work


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What the app needs to know about the engine and its limits.

    model_name: the name clients send as "model"; max_model_len: the model's positions;
    gen_length: answer positions of the compiled loop (max_tokens at most this);
    max_prompt_tokens: the longest prompt accepted; vocab_size, end_ids (EOS, ...);
    request_timeout: seconds a request may take (dllm.timeout may ask for less);
    api_key: Bearer token required on every endpoint but /health (None: open);
    max_body_bytes: request body limit.
    """

    model_name: str
    max_model_len: int
    gen_length: int
    max_prompt_tokens: int
    vocab_size: int
    end_ids: tuple[int, ...]
    request_timeout: float = 600.0
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


# builds the session's per-request parameters from a request body, its answer length and its method
ParamsBuilder = Callable[[_Sampling, int, str], Any]


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
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="dllm-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, max_body_bytes=settings.max_body_bytes, api_key=settings.api_key)
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
        serving.check_model(body.model)
        prompt = serving.encode_chat(body)
        return await serving.respond(request, body, [prompt], chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        serving.check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt", code="invalid_value") from None
        return await serving.respond(
            request, body, [serving.encode_text(p, i) for i, p in enumerate(prompts)], chat=False
        )

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

    # ----- prompts -------------------------------------------------------------------------

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
        return self._checked(self.tokenizer.apply_chat_template(body.conversation()), "messages")

    def encode_text(self, prompt: str | list[int], index: int) -> list[int]:
        param = "prompt"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param=param)
            if not prompt.strip():
                raise APIError(400, f"prompt[{index}] is empty", param=param, code="invalid_value")
            return self._checked(self.tokenizer.encode(prompt), param)
        bad = [t for t in prompt if not 0 <= t < self.settings.vocab_size]
        if bad:
            raise APIError(
                400,
                f"prompt[{index}] has token ids outside [0, {self.settings.vocab_size}): {bad[:5]}",
                param=param,
                code="invalid_value",
            )
        return self._checked(list(prompt), param)

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

    def _answer_length(self, body: _Sampling) -> int:
        asked = body.requested_max_tokens()
        G = self.settings.gen_length
        if asked is not None and asked > G:
            raise APIError(
                400,
                f"max_tokens={asked} is more than this server generates per answer ({G})",
                param="max_tokens",
                code="invalid_value",
            )
        return G if asked is None else asked

    def _method(self, body: _Sampling) -> str:
        method = body.dllm.method or self.worker.default_method
        if method not in self.worker.sessions:
            raise APIError(
                400,
                f"dllm.method={method!r}: this server runs {list(self.worker.sessions)}",
                param="dllm.method",
                code="invalid_value",
            )
        return method

    async def respond(self, request: Request, body: _Sampling, prompts: list[list[int]], *, chat: bool):
        method = self._method(body)
        length = self._answer_length(body)
        try:
            sampling = self.make_params(body, length, method)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        timeout = min(body.dllm.timeout or self.settings.request_timeout, self.settings.request_timeout)
        deadline = time.monotonic() + timeout
        prefix = "chatcmpl" if chat else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        runs: list[ChoiceRun] = []
        try:
            for i, ids in enumerate(prompts):
                handle = self.worker.submit(Work(f"{response_id}-{i}", method, ids, sampling, deadline))
                text = StableText(
                    self.tokenizer.decode,
                    length,
                    end_ids=self.settings.end_ids,
                    stops=body.stop_list,
                    max_tokens=length,
                )
                runs.append(
                    ChoiceRun(
                        handle,
                        text,
                        i,
                        token_text=self._token_text,
                        canvas=body.dllm.canvas,
                        deadline=deadline,
                        metrics=self.metrics,
                    )
                )
        except APIError:
            for run in runs:
                run.handle.close()
            raise
        head = {"id": response_id, "created": int(time.time()), "model": self.settings.model_name}
        if body.stream:
            chunks = self._stream(runs, head, chat=chat, include_usage=body.include_usage)
            return StreamingResponse(
                chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        return await self._complete(request, runs, head, chat=chat)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    async def _complete(self, request: Request, runs: list[ChoiceRun], head: dict, *, chat: bool) -> dict:
        texts = ["" for _ in runs]
        for run in runs:
            async for piece, _ in run.pieces(poll=request.is_disconnected):
                texts[piece.index] += piece.text
            if run.finish_reason is None:  # the client went away
                for other in runs:
                    other.handle.close()
                self.metrics.errors.labels("disconnected").inc()
                return {}
        if chat:
            choices = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": texts[0]},
                    "finish_reason": runs[0].finish_reason,
                    "logprobs": None,
                }
            ]
        else:
            choices = [
                {"index": r.index, "text": texts[r.index], "finish_reason": r.finish_reason, "logprobs": None}
                for r in runs
            ]
        stats = [r.stats for r in runs]
        kind = "chat.completion" if chat else "text_completion"
        return {**head, "object": kind, "choices": choices, "usage": usage(stats), "dllm": diffusion_stats(stats)}

    async def _stream(
        self, runs: list[ChoiceRun], head: dict, *, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                yield _sse(
                    {
                        **head,
                        "object": kind,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                                "logprobs": None,
                            }
                        ],
                    }
                )
            async for piece, received in _merged(runs):
                chunk = {**head, "object": kind, "choices": [self._choice(piece, chat)]}
                if piece.canvas is not None:
                    chunk["dllm"] = piece.canvas
                self.metrics.commit_to_chunk_seconds.observe(time.perf_counter() - received)
                yield _sse(chunk)
            if include_usage:
                stats = [r.stats for r in runs]
                yield _sse(
                    {**head, "object": kind, "choices": [], "usage": usage(stats), "dllm": diffusion_stats(stats)}
                )
        except APIError as e:
            self.metrics.errors.labels(e.code or "error").inc()
            yield _sse(e.body())
        finally:
            for run in runs:
                run.handle.close()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _choice(piece: Piece, chat: bool) -> dict:
        if chat:
            return {
                "index": piece.index,
                "delta": {"content": piece.text},
                "finish_reason": piece.finish_reason,
                "logprobs": None,
            }
        return {"index": piece.index, "text": piece.text, "finish_reason": piece.finish_reason, "logprobs": None}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


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
