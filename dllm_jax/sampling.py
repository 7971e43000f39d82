"""Token choice and commit rules shared by the decode policies (per slot, unbatched).

Confidence is the float32 softmax probability of the chosen token (the published code uses
float64 on the host; float32 changes only decisions whose probability lies within float32
rounding of the threshold).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(logits: jax.Array, temperature: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy (temperature 0) or Gumbel-max (temperature T) choice per row.

    Args:
      logits: [C, V] candidate rows.
      temperature: float32 scalar; 0 means argmax.
      rng: a PRNG key, used only when temperature > 0.
    Returns:
      tokens int32 [C], confidence float32 [C] = softmax(logits)[token] (noise-free).
    """
    logits = logits.astype(jnp.float32)
    gumbel = -jnp.log(-jnp.log(jax.random.uniform(rng, logits.shape, minval=1e-20, maxval=1.0)))
    noisy = logits + jnp.where(temperature > 0, temperature, 0.0) * gumbel
    tokens = jnp.argmax(noisy, axis=-1).astype(jnp.int32)
    probs = jax.nn.softmax(logits, axis=-1)
    confidence = jnp.take_along_axis(probs, tokens[:, None], axis=-1)[:, 0]
    return tokens, confidence


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
