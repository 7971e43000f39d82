"""Dream's own sampler as a policy: the whole generation is one block, every step a full pass.

Each step unmasks positions of the generation by Dream's rule (dllm_jax.policies.dream_unmasking: alg
and the timestep schedule with eps from the DecodeConfig; the request's temperature and
alg_temp from slot.sampling, its top-p / top-k already applied by the loop), so a request takes
exactly `steps` steps. Candidates are all G generated positions; the decode loop reads their
predictions from the rows Dream's logit shift names.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.policies.block import BlockPolicy
from dllm_jax.policies.dream_unmasking import sample_and_confidence, transfer_mask
from dllm_jax.runtime.slots import Slots, commit_tokens


@dataclasses.dataclass(frozen=True)
class DreamSamplerPolicy(BlockPolicy):
    alg: str = "entropy"
    eps: float = 1e-3
    steps: int = 256

    def commit(self, slot: Slots, logits: jax.Array, scores: jax.Array, rng: jax.Array) -> tuple[Slots, None]:
        positions, valid = self.candidates(slot)
        safe = jnp.minimum(positions, slot.tokens.shape[0] - 1)
        token_rng, transfer_rng = jax.random.split(rng)
        tokens, confidence = sample_and_confidence(logits, self.alg, slot.sampling.temperature, token_rng)
        masked = valid & ~slot.decoded[safe]
        commit = transfer_mask(
            self.alg, confidence, masked, slot.block_step, self.steps, self.eps, slot.sampling.alg_temp, transfer_rng
        )
        slot = commit_tokens(slot, safe, tokens, commit, self.eos_id, stop_at_eos=False)
        done = ~jnp.any(valid & ~slot.decoded[safe])
        slot = slot.replace(
            block_start=jnp.where(done, slot.block_start + self.block, slot.block_start),
            block_step=slot.block_step + 1,
            needs_full=jnp.ones((), bool),
        )
        return slot, None
