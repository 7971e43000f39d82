"""GenerationSession: the host side of one compiled decode loop, fed online.

The session owns the host's copy of the request ring and drives the loop's calls. Each
``step`` queues the next call with the host's changes (the requests added and aborted since,
the results read), then reads the previous call's report (finished requests and, with
``stream=True``, the running slots' canvases) while the next call runs, so the host's work
overlaps the device's. The calls run in order on a thread that keeps the device state between
them (dllm_jax.engine.device_calls): it starts a call the moment the one before returns, which
matters on XLA:GPU, where a call's dispatch returns only when the device is done. One call is
one dispatch with its report in a few packed buffers (dllm_jax.engine.loop_call): the device
does nothing else between calls. Results therefore arrive one call after the call that
produced them; admissions and aborts take effect at the next call boundary, and an aborted
request's slot is free within two calls. ``Engine.generate`` is a loop over one session; a
server keeps one session alive and calls ``step`` from its engine thread.

    session = engine.session(DecodeConfig(...), max_prompt_len=64)
    session.add("a", ids, SamplingParams(max_new_tokens=32))
    while session.num_running or session.num_waiting:
        for update in session.step():
            ...  # update.commits (grouped by step), update.result when finished
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.common.errors import GenerationError
from dllm_jax.engine.compiled_loop import CompiledLoop
from dllm_jax.engine.device_calls import DeviceCalls, Submitted
from dllm_jax.engine.loop_call import host_ring
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

# Timeline entries past which a read trims the ones no running request needs.
_TIMELINE_TRIM = 1024


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
        self._calls = DeviceCalls(compiled.call)
        self.reset()

    def reset(self) -> None:
        """Drops every request and the device state: the session is as new (a server's way
        out of a failed call; the compiled loop is kept). A call in flight is waited for."""
        self._calls.drop_state()
        compiled = self.compiled
        Q = compiled.queue_capacity
        self._ring = HostRing(Q, compiled.prompt_width)
        self._ring_on_device = None  # the packed ring the device last received
        self._ring_changed = False  # pushed or aborted since the last upload
        self._waiting: list[Request] = []  # WAITING, in add order
        self._pushed: dict[int, Request] = {}  # ring index -> RUNNING or ABORTED request whose entry is not free yet
        self._ids: dict[Hashable, Request] = {}  # WAITING or RUNNING
        self._next_order = 0
        self._started = False  # a call was submitted since the last reset (the device holds a state)
        self._in_flight = None  # (the last call submitted, whether it pushed or aborted), not read yet
        self._end = np.zeros((Q,), bool)  # ring entries of RUNNING requests aborted since the last call
        self._release = np.zeros((Q,), bool)  # results entries read since the last call (done flags to clear)
        self._idle_reads = 0  # consecutive reads that showed no progress
        self._count = 0  # requests pushed into the ring
        self._iteration = 0
        # (loop iteration, time) at each read since the oldest running request entered the ring:
        # its results' seconds are interpolated there (a server's session would otherwise keep
        # every call it ever made, and interpolate over them all at every result)
        self.timeline: list[tuple[int, float]] = [(0, time.perf_counter())]
        self.started_at = self.timeline[0][1]  # the time of the first call since the reset

    @property
    def decode_config(self) -> DecodeConfig:
        return self.compiled.decode_config

    @property
    def model(self) -> ModelConfig:
        return self.compiled.loop.model

    # ----- requests ----------------------------------------------------------------------------

    @property
    def call_seconds(self) -> float:
        """Seconds the loop's calls took so far, from dispatch to return (on XLA:GPU, where a
        call returns when the device is done, the device's busy time; over a wall time, how
        busy the host kept the device)."""
        return self._calls.seconds

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
        else:  # its ring entry and its slot end it (the entry stays taken until its result is read)
            entry = request.ring_index % self._ring.capacity
            self._end[entry] = True
            self._ring.sampling["step_limit"][entry] = 0
            self._ring_changed = True
        request.status = RequestStatus.ABORTED
        return True

    # ----- the device ----------------------------------------------------------------------------

    def _push(self) -> bool:
        """Moves waiting requests into free ring entries, in order; True if any moved."""
        moved = False
        while self._waiting and self._ring.free[self._count % self._ring.capacity]:
            request = self._waiting.pop(0)
            request.ring_index = self._count
            request.pushed_iteration = self._iteration
            request.status = RequestStatus.RUNNING
            self._count += 1
            self._ring.put(request)
            self._pushed[request.ring_index] = request
            moved = True
        self._ring_changed |= moved
        return moved

    def step(self, max_iterations: int | None = None) -> list[RequestUpdate]:
        """Queues the loop's next call, for up to `max_iterations` iterations (None:
        chunk_iterations), then returns what the previous call changed, one update per request
        with news (read while the next call runs)."""
        if max_iterations is None:
            max_iterations = self.chunk_iterations
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise GenerationError(f"max_iterations={max_iterations!r}: expected an int >= 1")
        previous, self._in_flight = self._in_flight, None
        pushed = self._push()
        if self._pushed:
            self._in_flight = (self._submit(max_iterations), pushed or bool(self._end.any()))
        if previous is None:
            return []
        if self._in_flight is not None:
            # the next call starts when the previous returns; its dispatch holds the interpreter
            # lock until it waits for the device, and reading now would keep the lock from it for
            # up to sys.getswitchinterval() (5 ms) while the device idles
            self._in_flight[0].started.wait()
        report = previous[0].result()  # raises what the call raised
        for part in self._wanted(report):
            part.copy_to_host_async()
        return self._read(report, previous[1])

    def _submit(self, max_iterations: int) -> Submitted:
        """Queues the next call with the host's changes (from a new state if there is none)."""
        compiled, packings = self.compiled, self.compiled.packings
        state = None
        if not self._started:
            tokens, lengths, sampling = self._ring.arrays()
            state = compiled.init(tokens, lengths, sampling, jnp.int32(self._count))
            self._started = True
            self.timeline = [(0, time.perf_counter())]
            self.started_at = self.timeline[0][1]
        if self._ring_changed or self._ring_on_device is None:
            self._ring_on_device = compiled.put_ring(*packings.ring.pack(host_ring(self._ring), np))
        control = packings.control_vector(
            max_iterations,
            bool(self._waiting),
            count=self._count,
            new_ring=self._ring_changed,
            release=self._release,
            end=self._end,
        )
        self._ring_changed = False
        self._release = np.zeros_like(self._release)
        self._end = np.zeros_like(self._end)
        return self._calls.submit(self.weights, compiled.put_control(control), *self._ring_on_device, state=state)

    def _wanted(self, report: Sequence[jax.Array]) -> list[jax.Array]:
        """The report's parts the host reads: the results always, the canvas when streaming,
        the log-probability records while a request in the ring asked for them."""
        asking = any(r.sampling.logprobs is not None for r in self._pushed.values())
        wanted = (True, asking, self.stream, self.stream and asking)
        return [part for part, want in zip(report, wanted, strict=True) if want]

    def _read(self, report: Sequence[jax.Array], had_news: bool) -> list[RequestUpdate]:
        """The updates of one call from its report (waits for its copies to reach the host)."""
        packings = self.compiled.packings
        ints = np.asarray(report[0])
        head = packings.results.unpack(ints, None)
        iteration, results = int(head.iteration), head.results
        done = np.nonzero(results.done)[0]
        if any(self._asks(int(results.request[entry])) for entry in done):
            results = packings.results.unpack(ints, np.asarray(report[1])).results
        stepped = iteration > self._iteration
        self._iteration = iteration
        self.timeline.append((iteration, time.perf_counter()))
        updates = []
        decode = None if self.tokenizer is None else self.tokenizer.decode
        fields = [f.name for f in dataclasses.fields(results)]
        for entry in done:
            request = self._pushed.pop(int(results.request[entry]), None)
            if request is None:  # read from an earlier call's report already
                continue
            self._ring.free[entry] = True
            self._release[entry] = True
            if request.status is RequestStatus.ABORTED:
                continue
            request.status = RequestStatus.FINISHED
            self._ids.pop(request.request_id, None)
            row = {name: getattr(results, name)[entry] for name in fields if getattr(results, name) is not None}
            commits = self._new_commits(request, row["tokens"], row["commit_step"], row["verified"], row)
            result = finished_result(request, row, self.timeline, eos_ids=self.model.eos_token_ids, decode=decode)
            updates.append(RequestUpdate(request.request_id, commits, result))
        if self.stream:
            updates += self._running_updates(report)
        if len(self.timeline) > _TIMELINE_TRIM:
            self._trim_timeline()
        progress = stepped or done.size or had_news
        self._idle_reads = 0 if progress or not self._pushed else self._idle_reads + 1
        if self._idle_reads > _MAX_IDLE_READS:
            raise RuntimeError(
                f"decode loop stalled with {len(self._pushed)} requests unfinished "
                f"(no step, no result, nothing new pushed in {self._idle_reads} calls, at iteration {iteration})"
            )
        return updates

    def _trim_timeline(self) -> None:
        """Drops the timeline's entries before the last one at or before the iteration at which
        the oldest request in the ring entered it (its interpolation needs none before)."""
        oldest = min((r.pushed_iteration for r in self._pushed.values()), default=self._iteration)
        keep = max(i for i, (iteration, _) in enumerate(self.timeline) if iteration <= oldest)
        self.timeline = self.timeline[keep:]

    def _asks(self, ring_index: int) -> bool:
        """The request at this ring index asked for log-probabilities."""
        request = self._pushed.get(ring_index)
        return request is not None and request.sampling.logprobs is not None

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

    def _running_updates(self, report: Sequence[jax.Array]) -> list[RequestUpdate]:
        """The running slots' new commits from a report's canvas part."""
        asking = any(self._asks(g) for g in self._pushed)
        canvas = self.compiled.packings.canvas.unpack(np.asarray(report[2]), np.asarray(report[3]) if asking else None)
        updates = []
        for b, g in enumerate(canvas.request):
            request = self._pushed.get(int(g))
            if not canvas.active[b] or request is None or request.status is not RequestStatus.RUNNING:
                continue
            p = canvas.prompt_len[b]
            records = {name: r[b][p:] for name, r in canvas.records.items()} if asking and canvas.records else None
            commits = self._new_commits(
                request, canvas.tokens[b][p:], canvas.commit_step[b][p:], canvas.verified[b][p:], records
            )
            if commits:
                updates.append(RequestUpdate(request.request_id, commits))
        return updates
