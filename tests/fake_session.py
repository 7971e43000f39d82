"""A model-free stand-in for the engine's GenerationSession, and the server around it in a thread.

FakeSession implements dllm_jax.serve.worker.Session: requests wait for one of its slots, then
commit their answer a few positions per step in a scrambled order (as a diffusion model fills
an answer in), each step taking `step_seconds` of wall time, and finish with the
GenerationResult the engine would return for that answer. As the engine's session does, a
step() call returns the news of the call before it (the engine reads one call while the device
runs the next): a request is running until its result has been returned, and an aborted
request's news never comes. The server's worker, HTTP layer,
streaming, queueing, cancellation and deadlines run on it unchanged, with no JAX compile.

The answer to a prompt is the prompt reversed, then EOS (see `answer_ids`); a request
with dllm.threshold above 1 commits one position per step (a slow request), as the engine does.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from types import SimpleNamespace

import uvicorn

from dllm_jax.common.errors import GenerationError
from dllm_jax.engine.results import GenerationResult, cut_at_end_ids, cut_at_stop_strings
from dllm_jax.engine.session import RequestUpdate, StepCommits
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.params import SamplingParams
from dllm_jax.serve.app import ServerSettings, create_app
from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serve.params import make_params
from dllm_jax.serve.worker import EngineWorker

EOS = 0
VOCAB = 128  # ids 1..95: the printable ASCII characters; 96..127 decode to nothing


class CharTokenizer:
    """One id per printable ASCII character (EOS and ids past them decode to nothing)."""

    has_chat_template = True

    def encode(self, text: str, *, chat: bool = False, special_tokens: bool = True) -> list[int]:
        if chat:
            return self.apply_chat_template([{"role": "user", "content": text}])
        return [ord(c) - 31 if 32 <= ord(c) < 127 else 96 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(int(t) + 31) for t in ids if 1 <= int(t) <= 95)

    def apply_chat_template(self, conversation) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in conversation) + "assistant: ")


def answer_ids(prompt_ids: list[int], length: int) -> list[int]:
    """The fake model's answer: the prompt's ids reversed, then EOS; padded with EOS to `length`
    positions."""
    answer = list(reversed(prompt_ids)) + [EOS]
    return (answer + [EOS] * length)[:length]


def commit_order(length: int) -> list[int]:
    """Positions in the order the fake commits them: pairs swapped (1, 0, 3, 2, ...), so the
    stable prefix lags behind the commits."""
    order = []
    for start in range(0, length, 2):
        order += list(reversed(range(start, min(start + 2, length))))
    return order


@dataclasses.dataclass
class _Request:
    request_id: object
    order: int
    prompt_ids: list[int]
    sampling: SamplingParams
    answer: list[int]
    pending: list[int]  # positions not yet committed, in commit order
    steps: int = 0


class FakeSession:
    """The Session protocol over no model. Args: num_slots, gen_length, max_prompt_len,
    step_seconds (wall time of one step), per_step (positions committed per step), fail_step
    (the step call, counted from 1, that raises as a failed device call would), dispatch_seconds
    (Python work at the start of every step call, holding the interpreter lock, as the engine's
    session prepares and dispatches the next call while the last one's events are sent).

    calls: ("step", the running ids) | ("abort", id) | ("reset", None), in order; fail_add:
    prompts (as tuples) whose add raises RuntimeError, as a bug in the session would."""

    def __init__(
        self,
        *,
        num_slots: int = 2,
        gen_length: int = 64,
        max_prompt_len: int = 64,
        step_seconds: float = 0.01,
        per_step: int = 2,
        tokenizer: CharTokenizer | None = None,
        fail_step: int | None = None,
        dispatch_seconds: float = 0.0,
    ):
        self.compiled = SimpleNamespace(loop=SimpleNamespace(num_slots=num_slots, cfg=False))
        self._decode_config = DecodeConfig(gen_length=gen_length, batch_size=num_slots)
        self.max_prompt_len = max_prompt_len
        self.step_seconds = step_seconds
        self.per_step = per_step
        self.tokenizer = tokenizer or CharTokenizer()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[object, _Request] = {}
        self._news: list[RequestUpdate] = []  # the last call's updates, returned by the next call
        self._next_order = 0
        self.aborted: list[object] = []
        self.calls: list[tuple[str, object]] = []
        self.fail_step = fail_step
        self.dispatch_seconds = dispatch_seconds
        self.fail_add: set[tuple[int, ...]] = set()
        self.step_calls = 0
        self.lock = threading.Lock()  # the tests read the counters from another thread

    @property
    def decode_config(self) -> DecodeConfig:
        return self._decode_config

    @property
    def num_running(self) -> int:
        return len(self._running) + sum(u.result is not None for u in self._news)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def check(self, prompt_ids: list[int], sampling: SamplingParams, where: str) -> object:
        if len(prompt_ids) > self.max_prompt_len:
            raise GenerationError(f"{where}: the prompt has {len(prompt_ids)} tokens, more than {self.max_prompt_len}")
        for name in ("max_new_tokens", "gen_length"):
            value = getattr(sampling, name)
            if value is not None and value > self.decode_config.gen_length:
                raise GenerationError(f"{where}: {name}={value} is more than the bucket")
        return {}

    def _canvas(self, sampling: SamplingParams) -> int:
        """The request's masked positions (SamplingParams.gen_length, else the bucket)."""
        return sampling.gen_length or self.decode_config.gen_length

    def add(self, request_id, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if tuple(prompt_ids) in self.fail_add:
            raise RuntimeError("a bug in the session")
        if not prompt_ids:
            raise GenerationError(f"request {request_id!r}: an empty prompt")
        self.check(prompt_ids, sampling, f"request {request_id!r}")
        length = self._canvas(sampling)
        request = _Request(request_id, self._next_order, list(prompt_ids), sampling, answer_ids(prompt_ids, length), [])
        request.pending = commit_order(length)
        self._next_order += 1
        self._waiting.append(request)

    def abort(self, request_id) -> bool:
        with self.lock:
            self.aborted.append(request_id)
            self.calls.append(("abort", request_id))
        news = [u for u in self._news if u.request_id != request_id]
        finished = len(news) < len(self._news) and any(
            u.result is not None for u in self._news if u.request_id == request_id
        )
        self._news = news
        if request_id in self._running:
            del self._running[request_id]
            return True
        if finished:  # finished in the last call, its result not returned yet
            return True
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                return True
        return False

    def reset(self) -> None:
        with self.lock:
            self.calls.append(("reset", None))
        self._waiting.clear()
        self._running.clear()
        self._news = []

    def step(self, max_iterations: int) -> list[RequestUpdate]:
        busy_until = time.perf_counter() + self.dispatch_seconds
        while time.perf_counter() < busy_until:  # pure Python: the interpreter lock stays held
            pass
        while self._waiting and len(self._running) < self.compiled.loop.num_slots:
            request = self._waiting.popleft()
            self._running[request.request_id] = request
        with self.lock:
            self.step_calls += 1
            self.calls.append(("step", sorted(self._running)))
        if self.step_calls == self.fail_step:
            raise RuntimeError("the device call failed")
        updates = []
        for _ in range(max_iterations):
            time.sleep(self.step_seconds)
            for request in list(self._running.values()):
                updates.append(self._step(request))
        news, self._news = self._news, [u for u in updates if u.commits or u.result is not None]
        return news

    def _step(self, request: _Request) -> RequestUpdate:
        per_step = 1 if (request.sampling.threshold or 0) > 1 else self.per_step
        positions = sorted(request.pending[:per_step])
        request.pending = request.pending[per_step:]
        commits = StepCommits(
            step=request.steps,
            positions=tuple(positions),
            tokens=tuple(request.answer[p] for p in positions),
            verified=(False,) * len(positions),
        )
        request.steps += 1
        result = None
        if not request.pending:
            del self._running[request.request_id]
            result = self.result(request)
        return RequestUpdate(request.request_id, (commits,), result)

    def result(self, request: _Request) -> GenerationResult:
        """What the engine returns for this answer (engine.results cuts it the same way)."""
        cut = request.sampling.max_new_tokens or len(request.answer)
        ids, stopped = cut_at_end_ids(request.answer[:cut], (EOS, *request.sampling.stop_token_ids))
        ids, text, hit = cut_at_stop_strings(ids, self.tokenizer.decode, request.sampling.stop)
        return GenerationResult(
            index=request.order,
            prompt_ids=request.prompt_ids,
            token_ids=ids,
            text=text,
            finish_reason="stop" if stopped or hit else "length",
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(ids),
            reference_num_tokens=len(ids) + stopped,
            steps=request.steps,
            forward_passes=request.steps,
            verify_passes=0,
            accepted_drafts=0,
            seconds=request.steps * self.step_seconds,
        )


class ThreadedServer:
    """The app (dllm_jax.serve.app) over an EngineWorker of `sessions`, served by uvicorn on a
    thread of this process at `url`; stop() ends it."""

    def __init__(self, sessions: dict[str, FakeSession], *, max_waiting: int, api_key: str | None, model: str):
        tokenizer = next(iter(sessions.values())).tokenizer
        first = next(iter(sessions.values()))
        self.metrics = ServerMetrics()
        self.worker = EngineWorker(sessions, self.metrics, max_waiting=max_waiting)
        settings = ServerSettings(
            model_name=model,
            max_model_len=first.max_prompt_len + first.decode_config.gen_length,
            gen_length=first.decode_config.gen_length,
            max_prompt_tokens=first.max_prompt_len,
            vocab_size=VOCAB,
            end_ids=(EOS,),
            api_key=api_key,
        )
        app = create_app(
            self.worker,
            tokenizer,
            settings,
            self.metrics,
            lambda body, method, choice: make_params(body, choice=choice),
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
