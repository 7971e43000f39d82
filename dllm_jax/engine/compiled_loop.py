"""CompiledLoop: one decode loop compiled for a DecodeConfig and a shape bucket."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from dllm_jax.engine.request import HostRing, Request, slot_values
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.decode_loop import DecodeLoop, DecodeState
from dllm_jax.runtime.memory_estimate import MemoryEstimate
from dllm_jax.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class CompiledLoop:
    """A decode loop compiled for one config and shape bucket.

    init(prompts int32 [queue_capacity, prompt_width], lengths int32 [queue_capacity],
    sampling SlotSampling [queue_capacity], count) -> DecodeState; run(weights, state,
    stop_iteration, host_has_more) -> DecodeState (state donated). See DecodeLoop.
    decode_config: what it was compiled for; memory: the bytes per device it was estimated to
    need (checked before compiling; None for a loop built outside Engine.compile).
    """

    loop: DecodeLoop
    decode_config: DecodeConfig
    queue_capacity: int
    prompt_width: int
    init: Any
    run: Any
    compile_seconds: float
    memory: MemoryEstimate | None = None

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
