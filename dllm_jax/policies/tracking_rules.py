"""Which decoded rows a Flash-Cache step refreshes: one ranking key per tracking rule.

The tracked rows of a step are the `count` decoded positions of highest key (lax.top_k: ties
go to the lower position). Every rule but "none" ranks this step's fresh commits (the pinned
positions, whose cached rows still hold the K/V they had as [MASK]) first, and differs in how
it ranks the rest:
  attention  the tracking score of the last pass (the published rule),
  recent     the step at which the position was committed (the prompt: -1, below all),
  random     a uniform number drawn from the request's stream for this step,
  drift      the change of the row's K/V at its last refresh (dllm_jax.runtime.row_drift;
             rows not refreshed since the first pass: 0),
  none       nothing is ranked: no decoded row is refreshed (budget 0).
The rule is a per-slot value (SamplingParams.track_rule, stored as its index in TRACK_RULES),
so every rule's key is computed in the compiled step and the slot's is selected (lax.select_n):
one compiled loop serves every mix of rules, at the cost of four [L] keys and L random draws
per slot and step beside the one top_k they share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.runtime.slots import Slots, step_rng
from dllm_jax.sampling.params import TRACK_RULES

PINNED_KEY = 3.0e38  # ranks fresh commits above any other key
# the random rule's stream within the request's step key (the commit draws use the key itself and fold 1)
RANDOM_RULE_STREAM = 2


def rule_index(name: str) -> int:
    """A rule's per-slot value (SlotSampling.track_rule)."""
    return TRACK_RULES.index(name)


def rank_key(slot: Slots) -> jax.Array:
    """float32 [L]: the slot's ranking key under its rule; -inf where a position is never tracked
    (not decoded, or the rule is "none")."""
    L = slot.tokens.shape[0]
    rng = jax.random.fold_in(step_rng(slot.sampling, slot.steps), RANDOM_RULE_STREAM)
    by_rule = {
        "attention": slot.scores,
        "recent": slot.commit_step.astype(jnp.float32),
        "random": jax.random.uniform(rng, (L,), jnp.float32),
        "drift": slot.drift,
    }
    never = jnp.full((L,), -jnp.inf, jnp.float32)
    keys = [jnp.where(slot.pinned, PINNED_KEY, by_rule[name]) if name in by_rule else never for name in TRACK_RULES]
    key = jax.lax.select_n(slot.sampling.track_rule, *keys)
    return jnp.where(slot.decoded, key, -jnp.inf)
