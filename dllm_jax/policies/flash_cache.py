"""Flash-Cache: a sliding window of candidates, refreshed look-ahead masks and tracked tokens.

Each step after a slot's first (full) pass recomputes only its query set:
  window     the W smallest undecoded positions (the decoding candidates),
  look-ahead the next (mask_num - 1) * W undecoded positions below key_len,
  tracked    track_num * W decoded positions: this step's fresh commits first ("pinned"),
             then, by the request's tracking rule (SamplingParams.track_rule), the highest
             tracking scores of the last pass (the default, "attention"; prompt positions
             included) or the other rules' choice (dllm_jax.policies.tracking_rules).
The tracking score of a key is the sum, over layers from the third up, of the raw q.k logits
from the window rows, averaged over the W rows and H heads (reset every step). Commits: every
window candidate with confidence >= threshold, at least one per step; the first committed
EOS bounds the answer (section D of the reference spec). track_num < 0 recomputes every
position every step, which makes each step an exact forward pass.

Window order and ties: the reference keeps a permutation array and sorts with an unstable
sort; here the same sets are chosen directly (window = the W smallest undecoded positions,
which is what the reference's permutation always holds), ties broken by lower position.
Deviations: positions at or past the answer bound (P + G before any EOS) are never committed,
so an answer never grows past gen_length; and when the rounded key length reaches max_len,
the slot's last padding position is left out of the keys (it is the slot's trash row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.policies.commit_rules import threshold_commit
from dllm_jax.policies.flash_verify import VerifyPlan, WindowDraft, plan_verify, verify_commit
from dllm_jax.policies.tracking_rules import rank_key
from dllm_jax.runtime.slots import Slots, answer_remaining, commit_tokens, smallest_undecoded
from dllm_jax.sampling.samplers import random_confidence, sample_tokens

# Key lengths are rounded up to this (the published kernels' key tile): each slot attends to
# its canvas plus 1..128 EOS padding positions, as in the reference.
KEY_ROUNDING = 128


@dataclasses.dataclass(frozen=True)
class FlashCachePolicy:
    window: int
    lookahead: int
    tracked: int  # negative: refresh everything
    max_len: int
    n_heads: int
    eos_id: int
    mask_id: int
    verify: bool = False
    accept: str = "cumprod"
    pin: str = "all_commits"
    logit_shift: int = 0  # the model family's (dllm_jax.models.logit_alignment)

    @property
    def num_candidates(self) -> int:
        return self.window

    @property
    def full_refresh(self) -> bool:
        return self.tracked < 0

    @property
    def _lookahead_rows(self) -> int:
        return min(self.lookahead, self.max_len - self.window)

    @property
    def _tracked_rows(self) -> int:
        return min(self.tracked, self.max_len)

    @property
    def num_sparse_rows(self) -> int:
        if self.full_refresh:
            return self.max_len
        return self.window + self._lookahead_rows + self._tracked_rows

    @property
    def tracks_drift(self) -> bool:
        """The sparse pass records each refreshed row's K/V change (the "drift" rule's key)."""
        return self._tracked_rows > 0

    @property
    def score_scale(self) -> float:
        return 1.0 / (self.window * self.n_heads)

    def key_length(self, prompt_len: jax.Array, gen_end: jax.Array) -> jax.Array:
        rounded = (gen_end // KEY_ROUNDING + 1) * KEY_ROUNDING
        # the slot's last row is its trash row (flat_cache), never a key
        return jnp.minimum(rounded, self.max_len - 1).astype(jnp.int32)

    def candidates(self, slot: Slots) -> tuple[jax.Array, jax.Array]:
        return smallest_undecoded(slot, self.window)

    def tracked_rows(self, slot: Slots, count: int) -> tuple[jax.Array, jax.Array]:
        """`count` decoded positions: pinned (fresh commits) first, then by the slot's tracking
        rule (tracking_rules.rank_key); fewer are valid when fewer are decoded, none for "none"."""
        values, positions = jax.lax.top_k(rank_key(slot), count)
        return positions.astype(jnp.int32), values > -jnp.inf

    def sparse_rows(self, slot: Slots) -> tuple[jax.Array, jax.Array]:
        L = self.max_len
        if self.full_refresh:
            window, window_valid = self.candidates(slot)
            pos = jnp.arange(L, dtype=jnp.int32)
            slot_in_window = (
                jnp.full((L,), L, jnp.int32)
                .at[jnp.where(window_valid, window, L)]
                .set(jnp.arange(self.window, dtype=jnp.int32), mode="drop")
            )
            # window first (in window order), then every other position ascending
            order = jnp.argsort(jnp.where(slot_in_window < L, slot_in_window - L, pos), stable=True)
            return order.astype(jnp.int32), order < slot.key_len
        masked, masked_valid = smallest_undecoded(slot, self.window + self._lookahead_rows)
        if self._tracked_rows == 0:
            return masked, masked_valid
        tracked, tracked_valid = self.tracked_rows(slot, self._tracked_rows)
        return jnp.concatenate([masked, tracked]), jnp.concatenate([masked_valid, tracked_valid])

    def commit(self, slot: Slots, logits: jax.Array, scores: jax.Array, rng: jax.Array) -> tuple[Slots, WindowDraft]:
        L = self.max_len
        positions, valid = self.candidates(slot)
        tokens, confidence = sample_tokens(logits, slot.sampling.temperature, rng)
        confidence = jnp.where(
            slot.sampling.random_remasking, random_confidence(jax.random.fold_in(rng, 1), self.window), confidence
        )
        eligible = valid & (positions < slot.bound)
        commit = threshold_commit(confidence, eligible, slot.sampling.threshold)
        drafts = slot.drafts.at[jnp.where(valid, positions, L)].set(tokens, mode="drop")
        slot = commit_tokens(slot, positions, tokens, commit, self.eos_id, stop_at_eos=True)
        pinned = jnp.zeros((L,), bool).at[jnp.where(commit, positions, L)].set(True, mode="drop")
        slot = slot.replace(drafts=drafts, pinned=pinned, scores=scores, needs_full=jnp.zeros((), bool))
        return slot, WindowDraft(positions, tokens, confidence, eligible, commit)

    # ----- Flash-Verify ------------------------------------------------------------------------

    @property
    def verify_rows(self) -> int:
        """C + D + M rows (2W), plus the mask views' predictor rows (W // 2) for a shifted model."""
        return 2 * self.window + (self.window // 2 if self.logit_shift else 0)

    def plan_verify(self, old: Slots, new: Slots, draft: WindowDraft) -> VerifyPlan:
        return plan_verify(old, new, draft, self.mask_id, self.logit_shift)

    def verify_commit(self, slot: Slots, plan: VerifyPlan, logits: jax.Array, draft: WindowDraft) -> Slots:
        stage1 = (
            jnp.zeros((self.max_len,), bool)
            .at[jnp.where(draft.committed, draft.positions, self.max_len)]
            .set(True, mode="drop")
        )
        return verify_commit(slot, plan, logits, stage1, slot.sampling.gamma, self.accept, self.pin, self.eos_id)

    def finished(self, slot: Slots) -> jax.Array:
        return ~answer_remaining(slot)

    def num_tokens(self, slot: Slots) -> jax.Array:
        """Committed generated positions (the reference's nd - P): up to the EOS bound."""
        pos = jnp.arange(self.max_len)
        return jnp.sum(slot.decoded & (pos >= slot.prompt_len)).astype(jnp.int32)
