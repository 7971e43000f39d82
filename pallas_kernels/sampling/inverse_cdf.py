"""The inverse-CDF draw and the entropy of softmax rows, in jnp: what DiffusionGemma's denoising
step computes from its processed logits (dllm_jax.policies.entropy_bound), shared with the
canvas sampler kernel (pallas_kernels.sampling.canvas_sampler), which supplies the block sums
of the draw itself and finishes the search with ``sample_from_blocks``.

A draw from softmax(logits [..., V]) at a uniform u in [0, 1) is the first token whose
cumulative probability exceeds u. The cumulative sum is taken in two levels: blocks of
``block_size(V)`` tokens (a power of two near sqrt(V): 512 for V = 262144), then the chosen
block's tokens, so only V / block block sums and one block per row are scanned.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def block_size(vocab_size: int) -> int:
    """The inverse-CDF search's block: the power of two nearest above sqrt(V) (512 for 262144),
    so both levels of the search scan about sqrt(V) sums."""
    return 1 << max(0, math.ceil(math.log2(vocab_size) / 2))


def first_above(cumulative: jax.Array, target: jax.Array, mass: jax.Array) -> jax.Array:
    """int32 [...]: the first index of cumulative [..., N] (non-decreasing) above target [...]
    (>= 0), at most the last index with mass [..., N] > 0 (rounding can put target past the
    total). Entries without mass are never chosen: their cumulative equals the one before."""
    n = cumulative.shape[-1]
    first = jnp.sum(cumulative <= target[..., None], axis=-1)
    last = n - 1 - jnp.argmax(jnp.flip(mass > 0, axis=-1), axis=-1)
    return jnp.minimum(first, last).astype(jnp.int32)


def sample_from_blocks(
    block_mass: jax.Array,
    uniform: jax.Array,
    block_weights: Callable[[jax.Array], jax.Array],
    *,
    recomputed: bool = False,
) -> jax.Array:
    """int32 [...]: the inverse-CDF draw from its block sums.

    Args:
      block_mass: float32 [..., NB], each block's sum of unnormalized probabilities.
      uniform: float32 [...] in [0, 1).
      block_weights: the chosen block int32 [...] -> its unnormalized probabilities float32
        [..., block] (0 past the vocabulary), on the scale of block_mass.
      recomputed: block_weights recomputes them by another exp than block_mass's (a kernel's):
        the target left within the block is scaled by the weights' sum over the block's mass,
        so that rounding cannot leave it at or past the block's end (else the draw would fall
        on the block's last token with probability, whatever its probability).
    Returns:
      int32 [...]: chosen block * block + the index within it.
    """
    block_cumulative = jnp.cumsum(block_mass, axis=-1)
    target = uniform.astype(jnp.float32) * block_cumulative[..., -1]
    chosen = first_above(block_cumulative, target, block_mass)
    before = jnp.take_along_axis(block_cumulative - block_mass, chosen[..., None], axis=-1)[..., 0]
    within = block_weights(chosen)
    cumulative = jnp.cumsum(within, axis=-1)
    remaining = jnp.maximum(target - before, 0.0)
    if recomputed:
        chosen_mass = jnp.take_along_axis(block_mass, chosen[..., None], axis=-1)[..., 0]
        remaining = remaining * jnp.where(chosen_mass > 0, cumulative[..., -1] / chosen_mass, 1.0)
    index = first_above(cumulative, remaining, within)
    return chosen * within.shape[-1] + index


def sample(logits: jax.Array, uniform: jax.Array) -> jax.Array:
    """int32 [...]: a draw from softmax(logits [..., V]) by its inverse CDF at uniform [...] in
    [0, 1): the first token whose cumulative probability exceeds the uniform (see the module doc).

    In: logits log([0.5, 0.25, 0.25]), uniform 0.6. Out: 1 (cumulative 0.5, 0.75, 1.0).
    """
    x = logits.astype(jnp.float32)
    V = x.shape[-1]
    block = block_size(V)
    pad = -V % block
    if pad:
        x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (pad,), -jnp.inf, jnp.float32)], axis=-1)
    # [..., NB, block]
    x = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    # unnormalized probabilities, the largest 1
    weight = jnp.exp(x - jnp.max(x, axis=(-2, -1), keepdims=True))
    block_mass = jnp.sum(weight, axis=-1)

    def block_weights(chosen: jax.Array) -> jax.Array:
        return jnp.take_along_axis(weight, chosen[..., None, None], axis=-2)[..., 0, :]

    return sample_from_blocks(block_mass, uniform, block_weights)


def token_entropy(logits: jax.Array) -> jax.Array:
    """float32 [...]: the entropy of softmax(logits [..., V]) (natural log)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
    """float32 [...]: cap * tanh(logits / cap) (Gemma's final-logit soft-cap).

    The division is a product with cap's float32 reciprocal: what XLA compiles ``logits / cap``
    to (its algebraic simplifier turns a division by a constant into that product, on the CPU
    and the GPU alike), written out so that a Triton kernel computes the same bits without an
    IEEE division per element.
    """
    if not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"cap={cap!r}: expected a number > 0")
    return jnp.tanh(logits.astype(jnp.float32) * jnp.float32(1.0 / cap)) * jnp.float32(cap)
