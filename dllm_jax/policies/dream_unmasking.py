"""Dream's sampler (its ``diffusion_generate``): token choice, confidence and the timestep schedule.

Per step i of ``steps`` (t = timesteps[i], s = timesteps[i + 1], timesteps = linspace(1, eps,
steps + 1)), over every [MASK] position of the generation:

  tokens    logits / temperature (temperature > 0), then top-p and top-k filtering (the
            decode loop's, dllm_jax.sampling.samplers.filter_top_p_top_k, with the request's values);
            the token is sampled from the filtered softmax (temperature > 0) or is its argmax.
  origin    every masked position is unmasked independently with probability 1 - s / t
            (1 at the last step).
  others    confidence = the chosen token's filtered probability (maskgit_plus), top-1 minus
            top-2 probability (topk_margin) or the negative entropy (entropy);
            n = int(masked * (1 - s / t)) (all at the last step) positions are unmasked: the
            n most confident (alg_temp 0) or n drawn without replacement from
            softmax(confidence / alg_temp).

Functions act on one slot (no batch axis). Random choices use JAX's generator: a decode is
reproducible from its seed, not bit-identical to PyTorch's. One deviation: a position whose
unmasked token is the [MASK] id itself stays committed (Dream's loop, which finds masks by
value, would predict it again).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_and_confidence(
    logits: jax.Array, alg: str, temperature: jax.Array, rng: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Tokens int32 [C] and their confidence float32 [C] (Dream's ``sample_tokens``).

    logits: [C, V], already top-p / top-k filtered (the decode loop applies the slot's
    filters, dllm_jax.sampling.samplers.filter_top_p_top_k); temperature: float32 scalar (0 = argmax).
    Probabilities are softmax(logits / temperature), as Dream computes them.
    """
    logits = logits.astype(jnp.float32)
    scaled = jnp.where(temperature > 0, logits / jnp.where(temperature > 0, temperature, 1.0), logits)
    probs = jax.nn.softmax(scaled, axis=-1)
    sampled = jax.random.categorical(rng, scaled, axis=-1)
    tokens = jnp.where(temperature > 0, sampled, jnp.argmax(probs, axis=-1)).astype(jnp.int32)
    if alg == "topk_margin":
        top2 = jax.lax.top_k(probs, 2)[0]
        return tokens, top2[:, 0] - top2[:, 1]
    if alg == "entropy":
        return tokens, jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
    return tokens, jnp.take_along_axis(probs, tokens[:, None], axis=-1)[:, 0]


def timestep_ratio(step: jax.Array, steps: int, eps: float) -> jax.Array:
    """1 - s / t of step `step` (float32; 1 at the last step): the share of masks unmasked."""
    timesteps = jnp.linspace(1.0, eps, steps + 1, dtype=jnp.float32)
    i = jnp.clip(step, 0, steps - 1)
    return jnp.where(step >= steps - 1, 1.0, 1.0 - timesteps[i + 1] / timesteps[i])


def transfer_mask(
    alg: str,
    confidence: jax.Array,
    masked: jax.Array,
    step: jax.Array,
    steps: int,
    eps: float,
    alg_temp: jax.Array,
    rng: jax.Array,
) -> jax.Array:
    """Which candidates [C] are unmasked this step (bool [C]); masked: the [MASK] candidates."""
    ratio = timestep_ratio(step, steps, eps)
    if alg == "origin":
        return masked & (jax.random.uniform(rng, masked.shape) < ratio)
    num_masked = jnp.sum(masked)
    count = jnp.where(
        step >= steps - 1, num_masked, jnp.floor(num_masked.astype(jnp.float32) * ratio).astype(jnp.int32)
    )
    gumbel = jax.random.gumbel(rng, confidence.shape)
    # alg_temp > 0: Gumbel-top-k = `count` draws without replacement from softmax(confidence / alg_temp)
    key = jnp.where(alg_temp > 0, confidence / jnp.where(alg_temp > 0, alg_temp, 1.0) + gumbel, confidence)
    key = jnp.where(masked, key, -jnp.inf)
    order = jnp.argsort(-key, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return masked & (rank < count)
