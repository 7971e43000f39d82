"""GenerationSession: the host side of one compiled decode loop, fed online.

The session owns a DecodeState and the host's copy of the request ring. Each ``step`` pushes
the requests added since the last call into the ring, ends aborted ones, dispatches the next
device call, and only then reads the previous call's results (finished requests and, with
``stream=True``, the running slots' canvases), so the host's work overlaps the device's: JAX
dispatches asynchronously, and what the host reads is a copy taken right after each call.
Results therefore arrive one call after the call that produced them; admissions and aborts
take effect at the next call boundary, and an aborted request's slot is free within two calls.
``Engine.generate`` is a loop over one session; a server keeps one session alive and calls
``step`` from its engine thread.

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
from dllm_jax.engine.results import GenerationResult, TokenLogprob, finished_result, token_logprob
from dllm_jax.models.config import ModelConfig
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.generation_defaults import GenerationDefaults
from dllm_jax.sampling.params import SamplingParams

# Reads in a row that show no step, no result and follow a call that pushed and aborted nothing,
# before a session calls its loop stalled (a call dispatched before the host could push, because
# it had not read the results that free the ring, legitimately does nothing).
_MAX_IDLE_READS = 4

# The per-position log-probability records of Slots and Results (copied to the host only while
# a request in the ring asked for them).
_LOGPROB_RECORDS = ("logprob", "top_ids", "top_logprobs")


@dataclasses.dataclass(frozen=True)
class StepCommits:
    """What one step of a request committed: answer offsets (0 = first generated position),
    their tokens, whether Flash-Verify's accepted drafts committed them and, when the request
    asked (SamplingParams.logprobs), their log-probabilities at this step."""

    step: int
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    verified: tuple[bool, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


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
      defaults: the model's values of what a request leaves unset (Engine.generation_defaults;
        None: none).
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
        defaults: GenerationDefaults | None = None,
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
        self.defaults = GenerationDefaults() if defaults is None else defaults
        self.reset()

    def reset(self) -> None:
        """Drops every request and the device state: the session is as new (a server's way
        out of a failed call; the compiled loop is kept)."""
        compiled = self.compiled
        self._ring = HostRing(compiled.queue_capacity, compiled.prompt_width)
        self._waiting: list[Request] = []  # WAITING, in add order
        self._pushed: dict[int, Request] = {}  # ring index -> RUNNING or ABORTED request whose entry is not free yet
        self._ids: dict[Hashable, Request] = {}  # WAITING or RUNNING
        self._next_order = 0
        self._state = None  # the state the next call starts from (the last call's output, in flight)
        self._in_flight = None  # the last call's report (host copies under way), not read yet
        self._aborting: list[int] = []  # ring indices of RUNNING requests aborted since the last call
        self._collected: list[int] = []  # results entries read since the last call (their done flags to clear)
        self._idle_reads = 0  # consecutive reads that showed no progress
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
            defaults=self.defaults,
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
        """Stops a request: it leaves the queue, or it ends at the first step of the next call
        (its slot is then free for the next request). Returns False when the session does not
        hold it (unknown or already finished)."""
        request = self._ids.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        else:
            self._aborting.append(request.ring_index)
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

    def _end_aborted(self, state):
        """Ends the requests aborted since the last call: a step bound of 0 in their ring entry
        and in any slot holding one, so each ends after its next step (with a result the host
        drops) wherever it is. Device-side: nothing is read back."""
        Q = self._ring.capacity
        entries = np.zeros((Q,), bool)  # fixed shapes: these ops compile once, in the warm-up
        for g in self._aborting:
            entries[g % Q] = True
            self._ring.sampling["step_limit"][g % Q] = 0
        self._aborting = []
        # a slot holds the request of its ring entry: the entry stays taken until its result is read
        slots = state.slots
        hit = slots.active & jnp.asarray(entries)[slots.request % Q]
        limit = jnp.where(hit, 0, slots.sampling.step_limit)
        return state.replace(slots=slots.replace(sampling=slots.sampling.replace(step_limit=limit)))

    def _report(self, state):
        """Copies of what the host reads of a call's output (it is donated to the next call),
        on their way to the host; the logprob records only while a request in the ring asked
        for them (a result this report holds is of a request pushed before the call)."""
        slots = state.slots
        asking = any(r.sampling.logprobs is not None for r in self._pushed.values())
        results = state.results if asking else state.results.replace(**dict.fromkeys(_LOGPROB_RECORDS, ()))
        view = (results, state.iteration)
        if self.stream:
            canvas = (slots.active, slots.request, slots.prompt_len, slots.tokens, slots.commit_step, slots.verified)
            records = tuple(getattr(slots, name) for name in _LOGPROB_RECORDS) if asking else None
            view += ((canvas, records),)
        report = jax.device_put(view, may_alias=False)
        for leaf in jax.tree.leaves(report):
            leaf.copy_to_host_async()
        return report

    def step(self, max_iterations: int | None = None) -> list[RequestUpdate]:
        """Dispatches the loop for up to `max_iterations` iterations (None: chunk_iterations),
        then returns what the previous call changed, one update per request with news."""
        if max_iterations is None:
            max_iterations = self.chunk_iterations
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise GenerationError(f"max_iterations={max_iterations!r}: expected an int >= 1")
        compiled = self.compiled
        pushed = self._push()
        aborting = bool(self._aborting)
        previous, self._in_flight = self._in_flight, None
        if self._pushed:
            if self._state is None:
                tokens, lengths, sampling = self._ring.arrays()
                self._state = compiled.init(tokens, lengths, sampling, jnp.int32(self._count))
                self.timeline = [(0, time.perf_counter())]
            elif pushed or aborting:
                tokens, lengths, sampling = self._ring.arrays()
                queue = self._state.queue.replace(
                    tokens=tokens, lengths=lengths, sampling=sampling, count=jnp.int32(self._count)
                )
                self._state = self._state.replace(queue=queue)
            state = self._end_aborted(self._state) if aborting else self._state
            if self._collected:
                keep = np.ones((self._ring.capacity,), bool)
                keep[self._collected] = False
                state = state.replace(results=state.results.replace(done=state.results.done & jnp.asarray(keep)))
                self._collected = []
            stop = state.iteration + jnp.int32(max_iterations)
            self._state = compiled.run(self.weights, state, stop, jnp.bool_(bool(self._waiting)))
            self._in_flight = (self._report(self._state), pushed or aborting)
        return [] if previous is None else self._read(*previous)

    def _read(self, report, had_news: bool) -> list[RequestUpdate]:
        """The updates of one call from its report (waits for the call to finish)."""
        report = jax.device_get(report)
        results, iteration = report[0], int(report[1])
        stepped = iteration > self._iteration
        self._iteration = iteration
        self.timeline.append((iteration, time.perf_counter()))
        updates = []
        decode = None if self.tokenizer is None else self.tokenizer.decode
        for entry in np.nonzero(results.done)[0]:
            request = self._pushed.pop(int(results.request[entry]), None)
            if request is None:  # read from an earlier call's report already
                continue
            self._ring.free[entry] = True
            self._collected.append(int(entry))
            if request.status is RequestStatus.ABORTED:
                continue
            request.status = RequestStatus.FINISHED
            self._ids.pop(request.request_id, None)
            row = {f.name: getattr(results, f.name) for f in dataclasses.fields(results)}
            row = {name: value[entry] for name, value in row.items() if not isinstance(value, tuple)}
            commits = self._new_commits(request, row["tokens"], row["commit_step"], row["verified"], row)
            result = finished_result(request, row, self.timeline, eos_ids=self.model.eos_token_ids, decode=decode)
            updates.append(RequestUpdate(request.request_id, commits, result))
        if self.stream:
            updates += self._running_updates(report[2])
        progress = stepped or self._collected or had_news
        self._idle_reads = 0 if progress or not self._pushed else self._idle_reads + 1
        if self._idle_reads > _MAX_IDLE_READS:
            raise RuntimeError(
                f"decode loop stalled with {len(self._pushed)} requests unfinished "
                f"(no step, no result, nothing new pushed in {self._idle_reads} calls, at iteration {iteration})"
            )
        return updates

    def _new_commits(
        self, request: Request, tokens, commit_step, verified, records: dict[str, Any] | None = None
    ) -> tuple[StepCommits, ...]:
        """Commits of steps after the last reported one, over the request's canvas (the
        positions after its cut included: they show the denoising, not the answer); records:
        the request's logprob, top_ids and top_logprobs rows (over the same positions), read
        when it asked for them."""
        steps = np.asarray(commit_step[: request.gen_length])
        count = request.sampling.logprobs
        out = []
        for s in np.unique(steps[steps > request.reported_step]):
            where = np.nonzero(steps == s)[0]
            logprobs = None
            if count is not None and records is not None:
                logprobs = tuple(token_logprob(tokens[p], records, p, count) for p in where)
            out.append(
                StepCommits(
                    step=int(s),
                    positions=tuple(int(p) for p in where),
                    tokens=tuple(int(tokens[p]) for p in where),
                    verified=tuple(bool(verified[p]) for p in where),
                    logprobs=logprobs,
                )
            )
        if out:
            request.reported_step = out[-1].step
        return tuple(out)

    def _running_updates(self, view) -> list[RequestUpdate]:
        """The running slots' new commits from a report's (canvas, logprob records or None)."""
        canvas, records = view
        updates = []
        for b, (active, g, p, tokens, steps, verified) in enumerate(zip(*canvas)):
            request = self._pushed.get(int(g))
            if not active or request is None or request.status is not RequestStatus.RUNNING:
                continue
            rows = None if records is None else {name: r[b][p:] for name, r in zip(_LOGPROB_RECORDS, records)}
            commits = self._new_commits(request, tokens[p:], steps[p:], verified[p:], rows)
            if commits:
                updates.append(RequestUpdate(request.request_id, commits))
        return updates
