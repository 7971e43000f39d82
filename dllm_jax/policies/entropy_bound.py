"""DiffusionGemma's denoising rule for one canvas (transformers' EntropyBoundSampler, its linear
temperature schedule and StableAndConfidentStoppingCriteria), as pure jnp over a batch of rows.

One denoising step, on the decoder's logits of the current canvas:
1. temperature: the step with r steps remaining (r = N .. 1 over N = max_denoising_steps steps)
   divides the logits by t_min + (t_max - t_min) * r / N (t_max first, falling towards t_min);
   these processed logits are also the next step's self-conditioning input.
2. a sample of every position from softmax(processed), and the argmax (the "draft" that is
   committed when the canvas ends).
3. accept: sort the positions by the entropy of their processed distribution, ascending; accept
   the longest prefix whose sum of entropies minus its largest stays <= entropy_bound (so the
   lowest-entropy position is always accepted). Accepted positions take the sample, the others
   are renoised with uniformly random tokens.
4. stop: a row is done when its argmax equals that of each of the previous
   ``stability_threshold`` steps and the mean entropy is below ``confidence_threshold``; a done
   row keeps its canvas, argmax and self-conditioning logits from then on.

Randomness comes in explicitly (``step_noise``): one uniform per position for the sample (an
inverse-CDF draw, ``sample``, shared with the canvas sampler kernel from
pallas_kernels.sampling.inverse_cdf) and the renoising tokens. transformers draws with
``torch.multinomial``; a Gumbel-max draw would need one random number per position and
vocabulary entry (256 x 262144 per canvas at the 26B-A4B shape, the sampler's costliest kernel
on the GPU), the inverse CDF needs one per position and a pass the softmax makes anyway.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.sampling.inverse_cdf import sample, token_entropy

__all__ = [
    "CanvasState",
    "DenoiseSettings",
    "annealed_temperature",
    "canvas_key",
    "denoise_update",
    "entropy_bound_accept",
    "initial_canvas",
    "initial_state",
    "sample",
    "step_noise",
    "step_temperature",
    "token_entropy",
]


@dataclasses.dataclass(frozen=True)
class DenoiseSettings:
    """transformers' DiffusionGemmaGenerationConfig defaults (and google/diffusiongemma-26B-A4B-it's
    generation_config.json values)."""

    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    def __post_init__(self):
        if not isinstance(self.max_denoising_steps, int) or self.max_denoising_steps <= 0:
            raise ValueError(f"max_denoising_steps={self.max_denoising_steps!r}: expected a positive integer")
        if not 0 <= self.t_min < self.t_max:
            raise ValueError(f"t_min={self.t_min!r}, t_max={self.t_max!r}: expected 0 <= t_min < t_max")
        if not self.entropy_bound > 0:
            raise ValueError(f"entropy_bound={self.entropy_bound!r}: expected > 0")
        if not isinstance(self.stability_threshold, int) or self.stability_threshold < 0:
            raise ValueError(f"stability_threshold={self.stability_threshold!r}: expected an integer >= 0")
        if not self.confidence_threshold > 0:
            raise ValueError(f"confidence_threshold={self.confidence_threshold!r}: expected > 0")


@struct.dataclass
class CanvasState:
    """One canvas being denoised, per row.

    canvas: int32 [B, L], the decoder's next input (accepted samples and noise).
    argmax: int32 [B, L], the latest argmax of the processed logits (what is committed).
    logits: [B, L, V] in the model dtype, the latest processed logits (self-conditioning input).
    has_logits: bool [B]; False before the first step (self-conditioning off).
    history: int32 [B, stability_threshold, L], the previous steps' argmax, oldest first (-1:
      no step yet).
    done: bool [B], the row has stopped denoising.
    """

    canvas: jax.Array
    argmax: jax.Array
    logits: jax.Array
    has_logits: jax.Array
    history: jax.Array
    done: jax.Array


def initial_state(canvas: jax.Array, vocab_size: int, settings: DenoiseSettings, dtype: jnp.dtype) -> CanvasState:
    """The state of a fresh canvas int [B, L] (transformers starts from uniform random tokens);
    the self-conditioning logits are kept in dtype (the model's)."""
    B, L = canvas.shape
    canvas = canvas.astype(jnp.int32)
    return CanvasState(
        canvas=canvas,
        argmax=canvas,
        logits=jnp.zeros((B, L, vocab_size), dtype),
        has_logits=jnp.zeros((B,), bool),
        history=jnp.full((B, settings.stability_threshold, L), -1, jnp.int32),
        done=jnp.zeros((B,), bool),
    )


def canvas_key(rng: jax.Array, canvas_index: int) -> jax.Array:
    """The key of one canvas's draws (its initial tokens and every step's noise)."""
    return jax.random.fold_in(rng, canvas_index)


def initial_canvas(key: jax.Array, batch: int, length: int, vocab_size: int) -> jax.Array:
    """int32 [B, L] uniform random tokens: a canvas's starting point, from its canvas_key."""
    return jax.random.randint(jax.random.fold_in(key, 0), (batch, length), 0, vocab_size, jnp.int32)


def step_noise(
    key: jax.Array, step: jax.Array | int, batch: int, length: int, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """Step ``step``'s (0-based) draws from the canvas_key: uniforms float32 [B, L] in [0, 1)
    for the sample and renoising tokens int32 [B, L]."""
    sample_key, renoise_key = jax.random.split(jax.random.fold_in(key, step + 1))
    uniform = jax.random.uniform(sample_key, (batch, length), jnp.float32)
    return uniform, jax.random.randint(renoise_key, (batch, length), 0, vocab_size, jnp.int32)


def annealed_temperature(
    t_min: float | jax.Array, t_span: float | jax.Array, max_steps: int | jax.Array, step: jax.Array | int
) -> jax.Array:
    """float32: the temperature of 0-based step ``step`` of max_steps (r = max_steps - step
    remaining), t_min + t_span * r / max_steps; t_span = t_max - t_min, subtracted before it
    is rounded to float32 (as transformers' schedule subtracts Python floats)."""
    remaining = jnp.asarray(max_steps - step, jnp.float32)
    t_min, t_span = jnp.asarray(t_min, jnp.float32), jnp.asarray(t_span, jnp.float32)
    return t_min + t_span * (remaining / jnp.asarray(max_steps, jnp.float32))


def step_temperature(settings: DenoiseSettings, step: jax.Array | int) -> jax.Array:
    """float32 []: the temperature of 0-based step ``step`` (annealed_temperature)."""
    return annealed_temperature(settings.t_min, settings.t_max - settings.t_min, settings.max_denoising_steps, step)


def entropy_bound_accept(entropy: jax.Array, bound: float | jax.Array) -> jax.Array:
    """bool [B, L]: the positions accepted under the entropy bound (step 3 of the module doc).

    In: entropy [[0.3, 0.01, 0.05, 0.2]], bound 0.1. Sorted 0.01, 0.05, 0.2, 0.3; sums minus
    the running max 0, 0.01, 0.06, 0.26. Out: [[False, True, True, True]].
    """
    order = jnp.argsort(entropy, axis=-1, stable=True)
    ascending = jnp.take_along_axis(entropy, order, axis=-1)
    # ascending order: the running max is the current value
    accepted_sorted = jnp.cumsum(ascending, axis=-1) - ascending <= bound
    return jnp.take_along_axis(accepted_sorted, jnp.argsort(order, axis=-1), axis=-1)


def denoise_update(
    settings: DenoiseSettings,
    state: CanvasState,
    logits: jax.Array,
    step: jax.Array | int,
    uniform: jax.Array,
    noise_tokens: jax.Array,
) -> CanvasState:
    """One denoising step (steps 1-4 of the module doc) from the decoder's logits float32
    [B, L, V] of state.canvas; rows already done keep their state."""
    processed = logits.astype(jnp.float32) / step_temperature(settings, step)
    drawn = sample(processed, uniform)
    argmax = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    accept = entropy_bound_accept(token_entropy(processed), settings.entropy_bound)
    canvas = jnp.where(accept, drawn, noise_tokens)
    done = state.done
    argmax = jnp.where(done[:, None], state.argmax, argmax)
    canvas = jnp.where(done[:, None], state.canvas, canvas)
    processed = jnp.where(done[:, None, None], state.logits.astype(jnp.float32), processed)
    # [B]: equal to each of the previous stability_threshold argmax canvases (vacuous for 0)
    stable = jnp.all(state.history == argmax[:, None, :], axis=(1, 2))
    confident = jnp.mean(token_entropy(processed), axis=-1) < settings.confidence_threshold
    history = state.history
    if settings.stability_threshold:
        history = jnp.concatenate([history[:, 1:], argmax[:, None, :]], axis=1)
    return CanvasState(
        canvas=canvas,
        argmax=argmax,
        logits=processed.astype(state.logits.dtype),
        has_logits=jnp.ones_like(state.has_logits),
        history=history,
        done=done | (stable & confident),
    )
