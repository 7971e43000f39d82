"""Commit rules shared by the decode policies: which candidates a step commits (per slot, unbatched)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def descending_rank(values: jax.Array, eligible: jax.Array) -> jax.Array:
    """Rank of each entry among the eligible ones by descending value (0 = largest).

    values: float [C]; eligible: bool [C]. Returns int32 [C], a permutation of 0..C-1.
    Every eligible entry ranks before every ineligible one, whatever the values (-inf and
    NaN included); NaN counts as -inf and -0.0 as 0.0; ties go to the lower index.
    In: values [.9, .5, .7], eligible [T, T, F] -> Out: [0, 1, 2].
    """
    values = values.astype(jnp.float32)
    # NaN and -0.0 are ordered (not equal) by XLA's total-order sort: map them to -inf and 0.0
    descending = jnp.where(jnp.isnan(values), jnp.inf, jnp.where(values == 0, 0.0, -values))
    index = jnp.arange(values.shape[0], dtype=jnp.int32)
    *_, order = jax.lax.sort((~eligible, descending, index), num_keys=2, is_stable=True)
    return jnp.zeros_like(index).at[order].set(index)


def threshold_commit(confidence: jax.Array, eligible: jax.Array, threshold: jax.Array) -> jax.Array:
    """Commit every eligible candidate with confidence >= threshold, and at least the most confident.

    confidence: float [C]; eligible: bool [C]; threshold: float scalar.
    Returns bool [C]: never an ineligible candidate, and at least one eligible one whenever
    any is eligible, for any confidence or threshold (NaN and inf included; a NaN never
    passes the threshold).
    """
    rank = descending_rank(confidence, eligible)
    return eligible & ((confidence >= threshold) | (rank == 0))


def count_commit(confidence: jax.Array, eligible: jax.Array, count: jax.Array) -> jax.Array:
    """Commit the `count` most confident eligible candidates (LLaDA's low-confidence remasking).

    confidence: float [C]; eligible: bool [C]; count: int scalar.
    Returns bool [C] with exactly min(max(count, 0), number eligible) True entries, all
    eligible, for any confidence values (NaN ranks as -inf).
    """
    return eligible & (descending_rank(confidence, eligible) < count)
