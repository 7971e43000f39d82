"""The decode-policy protocol: what a method decides; the decode loop does the rest.

A policy is a frozen dataclass (hashable, so it is static to jit). Its per-slot methods get
ONE slot (no batch axis) and are vmapped by the loop. Each step the loop runs, for every
active slot, either a full pass (every position < key_len is a query row) or a sparse pass
(the policy's `sparse_rows`); both return the logits of the policy's candidate positions.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from dllm_jax.runtime.slots import Slots


class DecodePolicy(Protocol):
    num_candidates: int
    """C: candidate positions per step (the rows whose logits are computed)."""

    @property
    def num_sparse_rows(self) -> int:
        """R: query rows of a sparse step (0: every step is a full pass)."""

    @property
    def score_scale(self) -> float | None:
        """Scale of the tracking scores (None: no scores)."""

    def key_length(self, prompt_len: jax.Array, gen_end: jax.Array) -> jax.Array:
        """Key positions [0, key_len) a slot attends to, from its prompt length and generation end."""

    def candidates(self, slot: Slots) -> tuple[jax.Array, jax.Array]:
        """Candidate positions int32 [C] and their validity bool [C]."""

    def sparse_rows(self, slot: Slots) -> tuple[jax.Array, jax.Array]:
        """Query positions int32 [R] (the C candidates first, in `candidates` order) and validity."""

    tracks_drift: bool
    """The sparse pass records each refreshed row's K/V change in Slots.drift (dllm_jax.runtime.row_drift)."""

    verify: bool
    """Runs Flash-Verify after each commit (then also: verify_rows, plan_verify, verify_commit)."""

    def commit(self, slot: Slots, logits: jax.Array, scores: jax.Array, rng: jax.Array) -> tuple[Slots, Any]:
        """Applies one step's candidate logits [C, V] (and tracking scores [L]) to the slot,
        with the slot's own sampling values (slot.sampling).

        Returns the slot and what the policy's verify stage needs (None without verify).
        """

    def finished(self, slot: Slots) -> jax.Array:
        """bool: the request in this slot is complete."""

    def num_tokens(self, slot: Slots) -> jax.Array:
        """Generated tokens credited to the finished request (the throughput numerator)."""
