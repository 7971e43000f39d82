"""Token choice: greedy/Gumbel sampling, top-p/top-k filtering, guidance (per slot, unbatched).

Confidence is the float32 softmax probability of the chosen token (the published code uses
float64 on the host; float32 changes only decisions whose probability lies within float32
rounding of the threshold).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sampling.top_p_top_k import REMOVED, apply_cutoff, top_p_top_k_cutoff_reference


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


# ----- the reference samplers' options (per slot values; shapes in each docstring) -------------


def filter_top_p_top_k(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Dream's top_p_logits then top_k_logits, on the logits a sampler at `temperature` sees.

    logits: [C, V]; temperature, top_p (1 = off) float32 scalars; top_k int32 scalar (0 = off).
    The nucleus is taken over softmax(logits / temperature) (over softmax(logits) when
    temperature is 0, where it changes only the confidence, never the argmax): the smallest
    prefix of the descending order whose probability reaches top_p, plus nothing else; top_k
    keeps every entry >= the k-th largest (ties kept). Returns float32 [C, V]: the logits with
    removed entries set to float32's lowest value (pallas_kernels.sampling.top_p_top_k.REMOVED).
    """
    rows = lambda x: jnp.broadcast_to(x, logits.shape[:1])  # noqa: E731
    cutoff = top_p_top_k_cutoff_reference(
        logits, rows(temperature), rows(top_p), rows(top_k), jnp.ones(logits.shape[:1], bool)
    )
    return apply_cutoff(logits, cutoff)


def filter_min_p(logits: jax.Array, temperature: jax.Array, min_p: jax.Array) -> jax.Array:
    """min_p filtering (transformers' MinPLogitsWarper after its temperature warper): keep the
    entries whose probability under softmax(logits / temperature) is at least min_p times the
    largest (softmax(logits) when temperature is 0, where it changes only the confidence).

    logits: [C, V]; temperature, min_p: float32 scalars (min_p 0 keeps every entry, exactly).
    Returns logits.dtype [C, V]: the logits with removed entries at float32's lowest value
    (pallas_kernels.sampling.top_p_top_k.REMOVED) cast to logits.dtype.
    """
    x = logits.astype(jnp.float32)
    scale = jnp.where(temperature > 0, temperature, 1.0)
    # p_i >= min_p * p_max  <=>  x_i >= x_max + scale * log(min_p)
    cutoff = jnp.max(x, axis=-1, keepdims=True) + scale * jnp.log(min_p)
    keep = (min_p <= 0) | (x >= cutoff)
    return jnp.where(keep, x, REMOVED).astype(logits.dtype)


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
