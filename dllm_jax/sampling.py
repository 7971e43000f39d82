"""Token choice and commit rules shared by the decode policies (per slot, unbatched).

Confidence is the float32 softmax probability of the chosen token (the published code uses
float64 on the host; float32 changes only decisions whose probability lies within float32
rounding of the threshold).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.top_p_top_k import apply_cutoff, top_p_top_k_cutoff_reference


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


# ----- the reference samplers' options (per slot values; shapes in each docstring) -------------

def filter_top_p_top_k(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Dream's top_p_logits then top_k_logits, on the logits a sampler at `temperature` sees.

    logits: [C, V]; temperature, top_p (1 = off) float32 scalars; top_k int32 scalar (0 = off).
    The nucleus is taken over softmax(logits / temperature) (over softmax(logits) when
    temperature is 0, where it changes only the confidence, never the argmax): the smallest
    prefix of the descending order whose probability reaches top_p, plus nothing else; top_k
    keeps every entry >= the k-th largest (ties kept). Returns float32 [C, V]: the logits with
    removed entries set to float32's lowest value (pallas_kernels.top_p_top_k.REMOVED).
    """
    rows = lambda x: jnp.broadcast_to(x, logits.shape[:1])  # noqa: E731
    cutoff = top_p_top_k_cutoff_reference(
        logits, rows(temperature), rows(top_p), rows(top_k), jnp.ones(logits.shape[:1], bool)
    )
    return apply_cutoff(logits, cutoff)


def random_confidence(rng: jax.Array, count: int) -> jax.Array:
    """LLaDA's remasking="random": the confidence of each of `count` candidates is U[0, 1)."""
    return jax.random.uniform(rng, (count,), jnp.float32)


def guided_logits(conditional: jax.Array, unconditional: jax.Array, cfg_scale: jax.Array) -> jax.Array:
    """LLaDA's classifier-free guidance: un + (cfg_scale + 1) * (cond - un); cond itself at 0.

    conditional, unconditional: [C, V] logits with the prompt, and with the prompt masked.
    """
    conditional = conditional.astype(jnp.float32)
    unconditional = unconditional.astype(jnp.float32)
    guided = unconditional + (cfg_scale + 1.0) * (conditional - unconditional)
    return jnp.where(cfg_scale > 0, guided, conditional)


def all_finite(logits: jax.Array, valid: jax.Array) -> jax.Array:
    """bool: every valid row of logits [C, V] (valid bool [C]) is finite (no NaN, no +-inf)."""
    return jnp.all(jnp.all(jnp.isfinite(logits), axis=-1) | ~valid)
