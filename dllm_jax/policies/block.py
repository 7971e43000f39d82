"""Semi-autoregressive block decoding: LLaDA's sampler and Fast-dLLM's block caches.

The canvas [P, P + G) is cut into aligned blocks of W positions, decoded left to right. A
block starts with a full pass; then, with cache "none" (LLaDA) every step is a full pass,
"prefix" recomputes the block and everything after it over the cached prefix, and "dual"
recomputes only the block over the cached prefix and suffix (Fast-dLLM). Commits go to the
masked positions of the current block: a fixed count per step (LLaDA's schedule:
steps_per_block steps, W // steps_per_block tokens each, the remainder spread over the
first steps) or by confidence threshold (Fast-dLLM: the most confident one always).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.policies.commit_rules import count_commit, threshold_commit
from dllm_jax.runtime.slots import Slots, answer_length, commit_tokens
from dllm_jax.sampling.samplers import random_confidence, sample_tokens


@dataclasses.dataclass(frozen=True)
class BlockPolicy:
    block: int
    gen_length: int
    cache: str  # "none" | "prefix" | "dual"
    steps_per_block: int | None  # None: threshold commits
    eos_id: int

    @property
    def num_candidates(self) -> int:
        return self.block

    @property
    def num_sparse_rows(self) -> int:
        return {"none": 0, "dual": self.block, "prefix": self.gen_length}[self.cache]

    @property
    def score_scale(self) -> None:
        return None

    def key_length(self, prompt_len: jax.Array, gen_end: jax.Array) -> jax.Array:
        # exactly the canvas: a request shorter than the bucket decodes as if G were its length
        return gen_end

    def candidates(self, slot: Slots) -> tuple[jax.Array, jax.Array]:
        positions = slot.block_start + jnp.arange(self.block, dtype=jnp.int32)
        return positions, positions < slot.gen_end

    def sparse_rows(self, slot: Slots) -> tuple[jax.Array, jax.Array]:
        # prefix: the block and everything after it; dual: the block alone
        positions = slot.block_start + jnp.arange(self.num_sparse_rows, dtype=jnp.int32)
        valid = positions < slot.key_len
        return jnp.minimum(positions, slot.tokens.shape[0] - 1), valid

    verify = False
    tracks_drift = False

    def commit(self, slot: Slots, logits: jax.Array, scores: jax.Array, rng: jax.Array) -> tuple[Slots, None]:
        positions, valid = self.candidates(slot)
        safe = jnp.minimum(positions, slot.tokens.shape[0] - 1)
        tokens, confidence = sample_tokens(logits, slot.sampling.temperature, rng)
        confidence = jnp.where(
            slot.sampling.random_remasking, random_confidence(jax.random.fold_in(rng, 1), self.block), confidence
        )
        eligible = valid & ~slot.decoded[safe]
        if self.steps_per_block is None:
            commit = threshold_commit(confidence, eligible, slot.sampling.threshold)
        else:
            base, extra = divmod(self.block, self.steps_per_block)
            count = base + (slot.block_step < extra).astype(jnp.int32)
            commit = count_commit(confidence, eligible, count)
        slot = commit_tokens(slot, safe, tokens, commit, self.eos_id, stop_at_eos=False)
        block_done = ~jnp.any(valid & ~slot.decoded[safe])
        slot = slot.replace(
            block_start=jnp.where(block_done, slot.block_start + self.block, slot.block_start),
            block_step=jnp.where(block_done, 0, slot.block_step + 1),
            needs_full=block_done | (self.cache == "none"),
        )
        return slot, None

    def finished(self, slot: Slots) -> jax.Array:
        return slot.block_start >= slot.gen_end

    def num_tokens(self, slot: Slots) -> jax.Array:
        return answer_length(slot, self.eos_id)
