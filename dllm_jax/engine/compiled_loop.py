"""CompiledLoop: one decode loop compiled for a DecodeConfig and a shape bucket."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.engine.loop_call import CallPackings
from dllm_jax.engine.request import HostRing, Request, slot_values
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.decode_loop import DecodeLoop, DecodeState
from dllm_jax.runtime.memory_estimate import MemoryEstimate
from dllm_jax.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class CompiledLoop:
    """A decode loop compiled for one config and shape bucket.

    init(prompts int32 [queue_capacity, prompt_width], lengths int32 [queue_capacity],
    sampling SlotSampling [queue_capacity], count) -> DecodeState; call(weights, state, control,
    ring_ints, ring_floats) -> (DecodeState, report): one call of the loop with the host's
    changes (state donated; dllm_jax.engine.loop_call, packed as `packings` says).
    decode_config: what it was compiled for; memory: the bytes per device it was estimated to
    need (checked before compiling; None for a loop built outside Engine.compile).
    """

    loop: DecodeLoop
    decode_config: DecodeConfig
    queue_capacity: int
    prompt_width: int
    init: Any
    call: Any
    packings: CallPackings
    compile_seconds: float
    memory: MemoryEstimate | None = None
    # the packed empty ring on the device, made at the first run() (shared by replace()d copies)
    _empty_ring: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def initial_state(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None) -> DecodeState:
        """The state with these prompts (at most queue_capacity) in the ring, each with
        `sampling` (None: the defaults); benchmarks drive `run` themselves."""
        sampling = SamplingParams() if sampling is None else sampling
        ring = HostRing(self.queue_capacity, self.prompt_width)
        limit = self.loop.model.max_sequence_length
        for g, ids in enumerate(prompts):
            values = slot_values(
                sampling,
                len(ids),
                self.decode_config,
                cfg=self.loop.cfg,
                max_sequence_length=limit,
                order=g,
                where=f"prompt {g}",
            )
            ring.put(Request(g, g, list(ids), sampling, values, ring_index=g))
        tokens, lengths, slot_sampling = ring.arrays()
        return self.init(tokens, lengths, slot_sampling, jnp.int32(len(prompts)))

    def put_control(self, control: np.ndarray) -> jax.Array:
        """A packed control on the device, laid out as `call` takes it: sent before the call,
        so that the call's dispatch transfers nothing."""
        return jax.device_put(control, self.call.input_shardings[0][2])

    def put_ring(self, ints: np.ndarray, floats: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """A packed ring on the device, laid out as `call` takes it (passed again to later calls,
        it costs no transfer)."""
        shardings = self.call.input_shardings[0]
        return jax.device_put(ints, shardings[3]), jax.device_put(floats, shardings[4])

    def run(self, weights: Any, state: DecodeState, iterations: int, host_has_more: bool = False) -> DecodeState:
        """At most `iterations` more loop iterations from `state` (donated), nothing changed by
        the host: how benchmarks and tests step the loop (a session calls `call`)."""
        if "ring" not in self._empty_ring:
            ring = self.packings.ring
            self._empty_ring["ring"] = self.put_ring(
                np.zeros((ring.num_ints,), np.int32), np.zeros((ring.num_floats,), np.float32)
            )
        control = self.put_control(self.packings.control_vector(iterations, host_has_more, count=0))
        state, _ = self.call(weights, state, control, *self._empty_ring["ring"])
        return state
