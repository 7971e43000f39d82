"""One call of a compiled decode loop, as a session drives it: the host's changes in, a report out.

The host changes the loop's state only at call boundaries and only through the call's
arguments: a Control (how many iterations, whether it holds more requests, which results
entries it has read, which requests end) and, when it pushed or aborted requests, its copy of
the request ring. The call returns the new state (donated to the next call) and a report: what
the host reads of that state, in buffers of their own, packed (dllm_jax.engine.packing) into
four vectors. So one call is one dispatch and one small upload, and reading it is two downloads
(four with the canvas and log-probabilities), whatever the slots or fields: no other device work
runs between calls, which matters where a call's dispatch blocks until the device is done
(XLA:GPU reads every while-loop condition back to the host) and the gap between calls is the
device's idle time.

    packings = CallPackings.of(loop, queue_capacity, prompt_width)
    call = jax.jit(partial(loop_call, loop, packings), donate_argnums=1)
    state, report = call(weights, state, control_ints, ring_ints, ring_floats)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dllm_jax.engine.packing import Packing
from dllm_jax.engine.request import HostRing
from dllm_jax.runtime.decode_loop import DecodeState, Results
from dllm_jax.runtime.slots import SlotSampling, zero_sampling

_INT32_MAX = np.iinfo(np.int32).max


@struct.dataclass
class Control:
    """The host's changes at a call boundary (Q: the ring's capacity).

    iterations int32 []: the most loop iterations of this call; host_has_more bool []: the host
    holds requests it could not push (DecodeLoop.run); new_ring bool []: the ring argument
    replaces the device's (requests were pushed or aborted); count int32 []: requests pushed so
    far; release bool [Q]: results entries the host has read (their done flags clear, so the
    entry can take request g + Q); end bool [Q]: ring entries whose requests end at their next
    step (aborted; installed or not), their results then dropped by the host.
    """

    iterations: jax.Array
    host_has_more: jax.Array
    new_ring: jax.Array
    count: jax.Array
    release: jax.Array
    end: jax.Array


@struct.dataclass
class Ring:
    """The host's copy of the request ring: tokens int32 [Q, P], lengths int32 [Q], sampling
    SlotSampling [Q] (dllm_jax.engine.request.HostRing)."""

    tokens: Any
    lengths: Any
    sampling: Any


@struct.dataclass
class ResultsReport:
    """The loop's iteration count int32 [] and its results ring after a call."""

    iteration: jax.Array
    results: Results


@struct.dataclass
class CanvasReport:
    """The slots after a call, what a stream reads of them: active bool [B], request int32 [B]
    (the global index of the slot's request), prompt_len int32 [B], tokens int32 [B, L],
    commit_step int32 [B, L], verified bool [B, L]; records: the slots' logprob float32 [B, L],
    top_ids int32 [B, L, K] and top_logprobs float32 [B, L, K] (empty for a loop that records
    none)."""

    active: jax.Array
    request: jax.Array
    prompt_len: jax.Array
    tokens: jax.Array
    commit_step: jax.Array
    verified: jax.Array
    records: dict[str, jax.Array]


_LOGPROB_RECORDS = ("logprob", "top_ids", "top_logprobs")


def host_ring(ring: HostRing) -> Ring:
    """The host's ring (numpy arrays) as the call takes it, to pack."""
    return Ring(tokens=ring.tokens, lengths=ring.lengths, sampling=SlotSampling(**ring.sampling))


def results_report(state: DecodeState) -> ResultsReport:
    return ResultsReport(iteration=state.iteration, results=state.results)


def canvas_report(state: DecodeState) -> CanvasReport:
    slots = state.slots
    records = {name: getattr(slots, name) for name in _LOGPROB_RECORDS if hasattr(slots, name)}
    return CanvasReport(
        active=slots.active,
        request=slots.request,
        prompt_len=slots.prompt_len,
        tokens=slots.tokens,
        commit_step=slots.commit_step,
        verified=slots.verified,
        records=records,
    )


@dataclasses.dataclass(frozen=True)
class CallPackings:
    """The packings of one compiled loop's call: its control, its ring and its two reports
    (queue_capacity: Q, the ring's entries)."""

    queue_capacity: int
    control: Packing
    ring: Packing
    results: Packing
    canvas: Packing

    @classmethod
    def of(cls, state: DecodeState) -> CallPackings:
        """For a loop whose state (arrays or ShapeDtypeStructs) is `state`."""
        Q, P = state.queue.tokens.shape
        control = Control(
            iterations=jax.ShapeDtypeStruct((), jnp.int32),
            host_has_more=jax.ShapeDtypeStruct((), jnp.bool_),
            new_ring=jax.ShapeDtypeStruct((), jnp.bool_),
            count=jax.ShapeDtypeStruct((), jnp.int32),
            release=jax.ShapeDtypeStruct((Q,), jnp.bool_),
            end=jax.ShapeDtypeStruct((Q,), jnp.bool_),
        )
        ring = Ring(
            tokens=jax.ShapeDtypeStruct((Q, P), jnp.int32),
            lengths=jax.ShapeDtypeStruct((Q,), jnp.int32),
            sampling=jax.eval_shape(lambda: zero_sampling((Q,))),
        )
        return cls(
            queue_capacity=Q,
            control=Packing.of(control),
            ring=Packing.of(ring),
            results=Packing.of(jax.eval_shape(results_report, state)),
            canvas=Packing.of(jax.eval_shape(canvas_report, state)),
        )

    def control_vector(
        self, iterations: int, host_has_more: bool, *, count: int, new_ring: bool = False, release=None, end=None
    ) -> np.ndarray:
        """The packed Control (int32 [n]); release and end: bool [Q] (None: none)."""
        none = np.zeros((self.queue_capacity,), bool)
        control = Control(
            iterations=np.int32(min(iterations, _INT32_MAX)),
            host_has_more=np.bool_(host_has_more),
            new_ring=np.bool_(new_ring),
            count=np.int32(count),
            release=none if release is None else release,
            end=none if end is None else end,
        )
        return self.control.pack(control, np)[0]


def loop_call(
    loop: Any,
    packings: CallPackings,
    weights: Any,
    state: DecodeState,
    control: jax.Array,
    ring_ints: jax.Array,
    ring_floats: jax.Array,
) -> tuple[DecodeState, tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
    """Applies the host's changes, runs `loop` (a DecodeLoop or CanvasLoop) for at most
    control.iterations iterations, and reports: (state, (results ints, results floats, canvas
    ints, canvas floats)). Jit it with the state donated.

    control: the packed Control (int32 [n]); ring_ints, ring_floats: the packed Ring (read only
    when control.new_ring)."""
    control = packings.control.unpack(control, None, jnp)
    ring = packings.ring.unpack(ring_ints, ring_floats, jnp)
    queue = state.queue

    def take(new, old):
        return jnp.where(control.new_ring, new, old)

    queue = queue.replace(
        tokens=take(ring.tokens, queue.tokens),
        lengths=take(ring.lengths, queue.lengths),
        sampling=jax.tree.map(take, ring.sampling, queue.sampling),
        count=take(control.count, queue.count),
    )
    # an ended request's step bound is 0 in its ring entry (the host's ring says so) and in the
    # slot that holds it (an entry stays taken until its result is read), so it ends after its
    # next step wherever it is
    slots = state.slots
    Q = queue.tokens.shape[0]
    hit = slots.active & control.end[slots.request % Q]
    step_limit = jnp.where(hit, 0, slots.sampling.step_limit)
    slots = slots.replace(sampling=slots.sampling.replace(step_limit=step_limit))
    results = state.results.replace(done=state.results.done & ~control.release)
    state = state.replace(slots=slots, queue=queue, results=results)
    stop = state.iteration + jnp.minimum(control.iterations, _INT32_MAX - state.iteration)
    state = loop.run(weights, state, stop, control.host_has_more)
    report = packings.results.pack(results_report(state), jnp) + packings.canvas.pack(canvas_report(state), jnp)
    return state, report
