"""GenerationSession: the host side of one compiled decode loop, fed online.

The session owns a DecodeState and the host's copy of the request ring. Between device calls
it pushes requests added since the last call into the ring, frees the slots of aborted ones,
collects finished results and (with ``stream=True``) reads the running slots' canvases to
report what each step committed. ``Engine.generate`` is a loop over one session; a server keeps
one session alive and calls ``step`` from its engine thread.

    session = engine.session(DecodeConfig(...), max_prompt_len=64)
    session.add("a", ids, SamplingParams(max_new_tokens=32))
    while session.num_running or session.num_waiting:
        for update in session.step():
            ...  # update.commits (grouped by step), update.result when finished
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.common.errors import GenerationError
from dllm_jax.engine.compiled_loop import CompiledLoop
from dllm_jax.engine.request import HostRing, Request, RequestStatus, slot_values
from dllm_jax.engine.results import GenerationResult, finished_result
from dllm_jax.models.config import ModelConfig
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class StepCommits:
    """What one step of a request committed: answer offsets (0 = first generated position),
    their tokens, and whether Flash-Verify's accepted drafts committed them."""

    step: int
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    verified: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class RequestUpdate:
    """News of one request from a `step` call: its new commits (steps in order, each reported
    once) and, when it finished, its result."""

    request_id: Hashable
    commits: tuple[StepCommits, ...]
    result: GenerationResult | None = None


class GenerationSession:
    """Requests in, per-step commits and results out, over one compiled decode loop.

    Args:
      compiled: the compiled loop (Engine.compile) and the configuration it was compiled for.
      weights: the model's weights the loop runs with (the engine's, laid out for its mesh).
      tokenizer: decodes answers to text and cuts them at stop strings (None: ids only).
      max_prompt_len: the longest prompt this session accepts (at most compiled.prompt_width).
      stream: report each step's commits of running requests (reads the slots' canvases after
        every call); without it, commits are reported once, with the result.
      chunk_iterations: loop iterations per `step` call when the call names none.
      seed: the seed of requests whose SamplingParams set none (each draws its own stream from
        it, by add order; None: the deprecated DecodeConfig.seed, else 0).
    """

    def __init__(
        self,
        compiled: CompiledLoop,
        weights: Any,
        *,
        tokenizer: Any = None,
        max_prompt_len: int,
        stream: bool = False,
        chunk_iterations: int = 64,
        seed: int | None = None,
    ):
        if max_prompt_len > compiled.prompt_width:
            raise GenerationError(
                f"max_prompt_len={max_prompt_len} is more than the loop's prompt width {compiled.prompt_width}"
            )
        self.compiled = compiled
        self.weights = weights
        self.tokenizer = tokenizer
        self.stream = stream
        self.chunk_iterations = chunk_iterations
        self.max_prompt_len = max_prompt_len
        self.seed = seed
        self._ring = HostRing(compiled.queue_capacity, compiled.prompt_width)
        self._waiting: list[Request] = []  # WAITING, in add order
        self._pushed: dict[int, Request] = {}  # ring index -> RUNNING or ABORTED request whose entry is not free yet
        self._ids: dict[Hashable, Request] = {}  # WAITING or RUNNING
        self._next_order = 0
        self._state = None
        self._count = 0  # requests pushed into the ring
        self._iteration = 0
        self.timeline: list[tuple[int, float]] = [(0, time.perf_counter())]

    @property
    def decode_config(self) -> DecodeConfig:
        return self.compiled.decode_config

    @property
    def model(self) -> ModelConfig:
        return self.compiled.loop.model

    # ----- requests ----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests added but not yet in the device ring."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests in the device ring or in a slot whose result is not collected yet."""
        return sum(r.status is RequestStatus.RUNNING for r in self._pushed.values())

    def status(self, request_id: Hashable) -> RequestStatus | None:
        """A WAITING or RUNNING request's status; None once it finished or was aborted (or for an
        unknown id)."""
        request = self._ids.get(request_id)
        return None if request is None else request.status

    def check(self, prompt_ids: list[int], sampling: SamplingParams | None, where: str) -> dict[str, Any]:
        """The per-slot values of a request this session would take; raises GenerationError
        naming `where` otherwise. Nothing is added."""
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise GenerationError(f"{where}: sampling={sampling!r}: expected a SamplingParams")
        if len(prompt_ids) > self.max_prompt_len:
            raise GenerationError(
                f"{where}: the prompt has {len(prompt_ids)} tokens, more than this session's max_prompt_len={self.max_prompt_len}"
            )
        vocab = self.model.vocab_size
        bad = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad:
            raise GenerationError(f"{where}: stop_token_ids {bad[:5]} are outside [0, {vocab})")
        if sampling.stop and self.tokenizer is None:
            raise GenerationError(f"{where}: stop strings need a tokenizer (the engine has none); use stop_token_ids")
        return slot_values(
            sampling,
            len(prompt_ids),
            self.decode_config,
            cfg=self.compiled.loop.cfg,
            max_sequence_length=self.model.max_sequence_length,
            order=self._next_order,
            where=where,
            base_seed=self.seed,
        )

    def add(self, request_id: Hashable, prompt_ids: list[int], sampling: SamplingParams | None = None) -> None:
        """Queues a request (validated prompt ids); it enters the device at the next `step`."""
        if request_id in self._ids:
            raise GenerationError(f"request {request_id!r} is already in this session")
        sampling = SamplingParams() if sampling is None else sampling
        values = self.check(prompt_ids, sampling, f"request {request_id!r}")
        request = Request(request_id, self._next_order, list(prompt_ids), sampling, values)
        self._next_order += 1
        self._ids[request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: Hashable) -> bool:
        """Stops a request: it leaves the queue, or its slot is freed at the next `step`.
        Returns False when the session does not hold it (unknown or already finished)."""
        request = self._ids.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        request.status = RequestStatus.ABORTED
        return True

    # ----- the device ----------------------------------------------------------------------------

    def _push(self) -> bool:
        """Moves waiting requests into free ring entries, in order; True if any moved."""
        moved = False
        while self._waiting and self._ring.free[self._count % self._ring.capacity]:
            request = self._waiting.pop(0)
            request.ring_index = self._count
            request.status = RequestStatus.RUNNING
            self._count += 1
            self._ring.put(request)
            self._pushed[request.ring_index] = request
            moved = True
        return moved

    def _apply_aborts(self, state):
        """Frees the slots of aborted requests and ends aborted ones still in the ring."""
        aborted = [g for g, r in self._pushed.items() if r.status is RequestStatus.ABORTED]
        if not aborted:
            return state
        slots_request, slots_active = jax.device_get((state.slots.request, state.slots.active))
        free = np.array([bool(a) and int(r) in aborted for r, a in zip(slots_request, slots_active)])
        if free.any():
            state = state.replace(slots=state.slots.replace(active=state.slots.active & ~jnp.asarray(free)))
        installed = {int(r) for r, f in zip(slots_request, free) if f}
        queued = [g for g in aborted if g not in installed]
        limit = np.array(jax.device_get(state.queue.sampling.step_limit))
        for g in queued:  # not installed yet (or finished this call): it ends after one step
            limit[g % self._ring.capacity] = 0
            self._ring.sampling["step_limit"][g % self._ring.capacity] = 0
        if queued:
            queue = state.queue
            state = state.replace(queue=queue.replace(sampling=queue.sampling.replace(step_limit=jnp.asarray(limit))))
        for g in installed:
            del self._pushed[g]
            self._ring.free[g % self._ring.capacity] = True
        return state

    def step(self, max_iterations: int | None = None) -> list[RequestUpdate]:
        """Runs the loop for up to `max_iterations` iterations (None: chunk_iterations) and
        returns what changed, one update per request with news."""
        if max_iterations is None:
            max_iterations = self.chunk_iterations
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise GenerationError(f"max_iterations={max_iterations!r}: expected an int >= 1")
        compiled = self.compiled
        pushed = self._push()
        if self._state is None:
            if not self._pushed:
                return []
            tokens, lengths, sampling = self._ring.arrays()
            self._state = compiled.init(tokens, lengths, sampling, jnp.int32(self._count))
            self.timeline = [(0, time.perf_counter())]
        elif pushed:
            tokens, lengths, sampling = self._ring.arrays()
            self._state = self._state.replace(
                queue=self._state.queue.replace(
                    tokens=tokens, lengths=lengths, sampling=sampling, count=jnp.int32(self._count)
                )
            )
        if not self._pushed:
            return []
        state = self._apply_aborts(self._state)
        stop = self._iteration + max_iterations
        state = compiled.run(self.weights, state, jnp.int32(stop), jnp.bool_(bool(self._waiting)))
        results, iteration = jax.device_get((state.results, state.iteration))
        stepped = int(iteration) > self._iteration
        self._iteration = int(iteration)
        self.timeline.append((self._iteration, time.perf_counter()))
        updates = []
        finished = np.nonzero(results.done)[0]
        decode = None if self.tokenizer is None else self.tokenizer.decode
        for entry in finished:
            g = int(results.request[entry])
            request = self._pushed.pop(g, None)
            self._ring.free[entry] = True
            if request is None or request.status is RequestStatus.ABORTED:
                continue
            request.status = RequestStatus.FINISHED
            self._ids.pop(request.request_id, None)
            row = {f.name: getattr(results, f.name)[entry] for f in dataclasses.fields(results)}
            commits = self._new_commits(request, row["tokens"], row["commit_step"], row["verified"])
            result = finished_result(request, row, self.timeline, eos_id=self.model.eos_token_id, decode=decode)
            updates.append(RequestUpdate(request.request_id, commits, result))
        if len(finished):
            state = state.replace(results=state.results.replace(done=jnp.zeros_like(state.results.done)))
        if self.stream:
            updates += self._running_updates(state)
        self._state = state
        if not stepped and not len(finished) and not pushed and self._pushed:
            raise RuntimeError(
                f"decode loop stalled with {len(self._pushed)} requests unfinished "
                f"(no step, no result, nothing to push at iteration {self._iteration})"
            )
        return updates

    def _new_commits(self, request: Request, tokens, commit_step, verified) -> tuple[StepCommits, ...]:
        """Commits of steps after the last reported one, over the request's answer positions."""
        steps = np.asarray(commit_step[: request.max_new_tokens])
        out = []
        for s in np.unique(steps[steps > request.reported_step]):
            where = np.nonzero(steps == s)[0]
            out.append(
                StepCommits(
                    step=int(s),
                    positions=tuple(int(p) for p in where),
                    tokens=tuple(int(tokens[p]) for p in where),
                    verified=tuple(bool(verified[p]) for p in where),
                )
            )
        if out:
            request.reported_step = out[-1].step
        return tuple(out)

    def _running_updates(self, state) -> list[RequestUpdate]:
        slots = jax.device_get(
            (
                state.slots.active,
                state.slots.request,
                state.slots.prompt_len,
                state.slots.tokens,
                state.slots.commit_step,
                state.slots.verified,
            )
        )
        updates = []
        for active, g, p, tokens, steps, verified in zip(*slots):
            request = self._pushed.get(int(g))
            if not active or request is None or request.status is not RequestStatus.RUNNING:
                continue
            commits = self._new_commits(request, tokens[p:], steps[p:], verified[p:])
            if commits:
                updates.append(RequestUpdate(request.request_id, commits))
        return updates
