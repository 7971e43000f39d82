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
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.common.errors import GenerationError
from dllm_jax.sampling.params import SamplingParams
from dllm_jax.runtime.slots import SlotParams

if TYPE_CHECKING:
    from dllm_jax.engine.engine import CompiledLoop, Engine, GenerationResult

# The host dtype of each SlotParams field (the ring's numpy mirror); the rest are int32.
_FLOAT_PARAMS = ("temperature", "top_p", "threshold", "gamma", "cfg_scale", "alg_temp")
_PARAM_DTYPES = {
    f.name: np.bool_ if f.name == "random_remasking" else np.float32 if f.name in _FLOAT_PARAMS else np.int32
    for f in dataclasses.fields(SlotParams)
}


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


@dataclasses.dataclass
class _Request:
    request_id: Hashable
    order: int  # add order in the session (the stream of a request without a seed)
    prompt_ids: list[int]
    params: SamplingParams
    values: dict[str, Any]  # SlotParams scalars
    index: int = -1  # global ring index g, given when pushed (the device installs g in order)
    reported_step: int = -1
    aborted: bool = False


def resolve_params(
    params: SamplingParams, prompt_len: int, decode: DecodeConfig, max_sequence_length: int, cfg: bool, where: str
) -> dict[str, Any]:
    """The SlotParams scalars of one request; raises GenerationError naming `where` (e.g. "request 3")."""
    G = decode.gen_length
    room = max_sequence_length - prompt_len
    if params.max_new_tokens is None:
        max_new = min(G, room)
        if max_new <= 0:
            raise GenerationError(
                f"{where}: the prompt has {prompt_len} tokens, no room for an answer within the model's "
                f"max_sequence_length={max_sequence_length}"
            )
    else:
        max_new = params.max_new_tokens
        if max_new > G:
            raise GenerationError(
                f"{where}: max_new_tokens={max_new} is more than this engine's generation bucket gen_length={G}"
            )
        if max_new > room:
            raise GenerationError(
                f"{where}: {prompt_len} prompt tokens + max_new_tokens={max_new} = {prompt_len + max_new} positions, "
                f"more than the model's max_sequence_length={max_sequence_length}"
            )
    if params.threshold is not None and decode.uses_schedule:
        raise GenerationError(
            f"{where}: threshold={params.threshold} does not apply to method={decode.method!r} with a fixed "
            "schedule (steps); set DecodeConfig.threshold for threshold commits"
        )
    if params.gamma is not None and not decode.verify:
        raise GenerationError(f"{where}: gamma={params.gamma} applies only with DecodeConfig(verify=True)")
    if params.cfg_scale > 0 and not cfg:
        if decode.method != "llada":
            raise GenerationError(
                f"{where}: cfg_scale={params.cfg_scale} is available with method='llada' (a second, "
                f"unconditional full pass per step), not {decode.method!r}"
            )
        raise GenerationError(f"{where}: cfg_scale={params.cfg_scale} needs a loop compiled with DecodeConfig(cfg=True)")
    if params.alg_temp > 0 and decode.method != "dream":
        raise GenerationError(f"{where}: alg_temp={params.alg_temp} applies only to method='dream', not {decode.method!r}")
    threshold = params.threshold if params.threshold is not None else decode.threshold
    gamma = params.gamma if params.gamma is not None else decode.gamma
    return dict(
        max_new_tokens=max_new,
        # every step commits at least one position: twice the most steps it can need
        step_limit=2 * max_new + 2,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=decode.seed if params.seed is None else params.seed,
        stream=-1,  # filled with the request's index when the seed is the config's
        threshold=2.0 if threshold is None else threshold,
        gamma=1.0 if gamma is None else gamma,
        cfg_scale=params.cfg_scale,
        random_remasking=params.remasking == "random",
        alg_temp=params.alg_temp,
    )


class _HostRing:
    """The host side of the request ring: request g goes to entry g % capacity once request
    g - capacity has been collected (its result entry is free)."""

    def __init__(self, capacity: int, width: int):
        self.tokens = np.zeros((capacity, width), np.int32)
        self.lengths = np.zeros((capacity,), np.int32)
        self.params = {name: np.zeros((capacity,), dtype) for name, dtype in _PARAM_DTYPES.items()}
        self.free = np.ones((capacity,), bool)

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    def put(self, request: _Request) -> None:
        entry = request.index % self.capacity
        self.tokens[entry] = 0
        self.tokens[entry, : len(request.prompt_ids)] = request.prompt_ids
        self.lengths[entry] = len(request.prompt_ids)
        for name, value in request.values.items():
            self.params[name][entry] = value
        self.free[entry] = False

    def arrays(self) -> tuple[jax.Array, jax.Array, SlotParams]:
        params = SlotParams(**{name: jnp.asarray(a) for name, a in self.params.items()})
        return jnp.asarray(self.tokens), jnp.asarray(self.lengths), params


class GenerationSession:
    """Requests in, per-step commits and results out, over one compiled decode loop.

    Args:
      engine: the Engine (model, params, tokenizer, compiled-loop cache).
      decode: the compile-time configuration (see DecodeConfig).
      max_prompt_len: the longest prompt this session accepts (its prompt-length bucket).
      num_slots: slots of the loop (None: decode.batch_size).
      stream: report each step's commits of running requests (reads the slots' canvases after
        every call); without it, commits are reported once, with the result.
    """

    def __init__(
        self, engine: Engine, decode: DecodeConfig, *, max_prompt_len: int, num_slots: int | None = None,
        stream: bool = False,
    ):
        self.engine = engine
        self.decode = decode
        self.stream = stream
        self.compiled: CompiledLoop = engine.compile(decode, max_prompt_len, num_slots=num_slots)
        self.max_prompt_len = max_prompt_len
        self._ring = _HostRing(self.compiled.queue_capacity, self.compiled.prompt_width)
        self._waiting: list[_Request] = []  # added, not yet in the ring
        self._pushed: dict[int, _Request] = {}  # in the ring or a slot, result not collected
        self._ids: dict[Hashable, _Request] = {}
        self._next_order = 0
        self._state = None
        self._count = 0  # requests pushed into the ring
        self._iteration = 0
        self.timeline: list[tuple[int, float]] = [(0, time.perf_counter())]

    # ----- requests ----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests added but not yet installed in the device ring."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests in the device ring or in a slot whose result is not collected yet."""
        return sum(not r.aborted for r in self._pushed.values())

    def add(self, request_id: Hashable, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queues a request (validated prompt ids); it enters the device at the next `step`."""
        if request_id in self._ids:
            raise GenerationError(f"request {request_id!r} is already in this session")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise GenerationError(f"request {request_id!r}: params={params!r}: expected a SamplingParams")
        where = f"request {request_id!r}"
        if len(prompt_ids) > self.max_prompt_len:
            raise GenerationError(
                f"{where}: the prompt has {len(prompt_ids)} tokens, more than this session's max_prompt_len={self.max_prompt_len}"
            )
        vocab = self.engine.config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise GenerationError(f"{where}: stop_token_ids {bad[:5]} are outside [0, {vocab})")
        if params.stop and self.engine.tokenizer is None:
            raise GenerationError(f"{where}: stop strings need a tokenizer (the engine has none); use stop_token_ids")
        values = resolve_params(
            params, len(prompt_ids), self.decode, self.engine.config.max_sequence_length, self.compiled.loop.cfg, where
        )
        values["stream"] = self._next_order if params.seed is None else 0
        request = _Request(request_id, self._next_order, list(prompt_ids), params, values)
        self._next_order += 1
        self._ids[request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: Hashable) -> bool:
        """Stops a request: it leaves the queue, or its slot is freed at the next `step`.
        Returns False when the session does not hold it (unknown or already finished)."""
        request = self._ids.pop(request_id, None)
        if request is None:
            return False
        request.aborted = True
        if request in self._waiting:
            self._waiting.remove(request)
        return True

    # ----- the device ----------------------------------------------------------------------------

    def _push(self) -> bool:
        """Moves waiting requests into free ring entries, in order; True if any moved."""
        moved = False
        while self._waiting and self._ring.free[self._count % self._ring.capacity]:
            request = self._waiting.pop(0)
            request.index = self._count
            self._count += 1
            self._ring.put(request)
            self._pushed[request.index] = request
            moved = True
        return moved

    def _apply_aborts(self, state):
        """Frees the slots of aborted requests and ends aborted ones still in the ring."""
        aborted = [g for g, r in self._pushed.items() if r.aborted]
        if not aborted:
            return state
        slots_request, slots_active = jax.device_get((state.slots.request, state.slots.active))
        free = np.array([bool(a) and int(r) in aborted for r, a in zip(slots_request, slots_active)])
        if free.any():
            state = state.replace(slots=state.slots.replace(active=state.slots.active & ~jnp.asarray(free)))
        installed = {int(r) for r, f in zip(slots_request, free) if f}
        queued = [g for g in aborted if g not in installed]
        limit = np.array(jax.device_get(state.queue.params.step_limit))
        for g in queued:  # not installed yet (or finished this call): it ends after one step
            limit[g % self._ring.capacity] = 0
            self._ring.params["step_limit"][g % self._ring.capacity] = 0
        if queued:
            state = state.replace(queue=state.queue.replace(params=state.queue.params.replace(step_limit=jnp.asarray(limit))))
        for g in installed:
            del self._pushed[g]
            self._ring.free[g % self._ring.capacity] = True
        return state

    def step(self, max_iterations: int | None = None) -> list[RequestUpdate]:
        """Runs the loop for up to `max_iterations` iterations (None: the engine's
        chunk_iterations) and returns what changed, one update per request with news."""
        if max_iterations is None:
            max_iterations = self.engine.chunk_iterations
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise GenerationError(f"max_iterations={max_iterations!r}: expected an int >= 1")
        compiled = self.compiled
        pushed = self._push()
        if self._state is None:
            if not self._pushed:
                return []
            tokens, lengths, params = self._ring.arrays()
            self._state = compiled.init(tokens, lengths, params, jnp.int32(self._count))
            self.timeline = [(0, time.perf_counter())]
        elif pushed:
            tokens, lengths, params = self._ring.arrays()
            self._state = self._state.replace(
                queue=self._state.queue.replace(tokens=tokens, lengths=lengths, params=params, count=jnp.int32(self._count))
            )
        if not self._pushed:
            return []
        state = self._apply_aborts(self._state)
        stop = self._iteration + max_iterations
        state = compiled.run(self.engine.params, state, jnp.int32(stop), jnp.bool_(bool(self._waiting)))
        results, iteration = jax.device_get((state.results, state.iteration))
        stepped = int(iteration) > self._iteration
        self._iteration = int(iteration)
        self.timeline.append((self._iteration, time.perf_counter()))
        updates = []
        finished = np.nonzero(results.done)[0]
        for entry in finished:
            g = int(results.request[entry])
            request = self._pushed.pop(g, None)
            self._ring.free[entry] = True
            if request is None or request.aborted:
                continue
            self._ids.pop(request.request_id, None)
            row = {f.name: getattr(results, f.name)[entry] for f in dataclasses.fields(results)}
            commits = self._new_commits(request, row["tokens"], row["commit_step"], row["verified"])
            updates.append(RequestUpdate(request.request_id, commits, self.engine._result(request, row, self.timeline)))
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

    def _new_commits(self, request: _Request, tokens, commit_step, verified) -> tuple[StepCommits, ...]:
        """Commits of steps after the last reported one, over the request's answer positions."""
        n = request.values["max_new_tokens"]
        steps = np.asarray(commit_step[:n])
        out = []
        for s in np.unique(steps[steps > request.reported_step]):
            where = np.nonzero(steps == s)[0]
            out.append(StepCommits(
                step=int(s), positions=tuple(int(p) for p in where), tokens=tuple(int(tokens[p]) for p in where),
                verified=tuple(bool(verified[p]) for p in where),
            ))
        if out:
            request.reported_step = out[-1].step
        return tuple(out)

    def _running_updates(self, state) -> list[RequestUpdate]:
        slots = jax.device_get(
            (state.slots.active, state.slots.request, state.slots.prompt_len, state.slots.tokens,
             state.slots.commit_step, state.slots.verified)
        )
        updates = []
        for active, g, p, tokens, steps, verified in zip(*slots):
            request = self._pushed.get(int(g))
            if not active or request is None or request.aborted:
                continue
            commits = self._new_commits(request, tokens[p:], steps[p:], verified[p:])
            if commits:
                updates.append(RequestUpdate(request.request_id, commits))
        return updates
