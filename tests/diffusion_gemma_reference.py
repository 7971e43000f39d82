"""DiffusionGemma's generation as transformers' ``DiffusionGemmaForBlockDiffusion.generate`` does
it, with a host loop over jitted steps: the reference the engine's policy is checked against.

For each canvas (block of L tokens) up to ceil(max_new_tokens / L):
1. encode what the cache lacks (the prompt, then the previous canvas) causally into the cache;
2. start from L uniform random tokens and denoise (dllm_jax.policies.entropy_bound) for at most
   max_denoising_steps steps, each one decoder pass over the canvas with the previous step's
   processed logits as self-conditioning, until every row stopped (stable and confident);
3. append each row's argmax canvas; a row with an EOS in it is finished: its tokens after the
   first EOS, and all tokens of its later canvases, become pad (when pad_token_id is set);
4. stop when every row is finished.

Positions continue across canvases, so the output is prompt + whole canvases (not cut at
max_new_tokens). Each row's decoder passes are counted as transformers counts them (a pass
counts for the rows neither done denoising nor finished).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.diffusion_gemma_config import DiffusionGemmaConfig
from dllm_jax.policies.entropy_bound import (
    CanvasState,
    DenoiseSettings,
    canvas_key,
    denoise_update,
    initial_canvas,
    initial_state,
    step_noise,
)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """sequences: int [B, P + C * L], the prompt then C canvases (pad after a row's EOS).
    decoder_passes: int [B], the denoising passes credited to each row."""

    sequences: np.ndarray
    decoder_passes: np.ndarray


def generate(
    config: DiffusionGemmaConfig,
    params: dg.Weights,
    prompt: np.ndarray,
    rng: jax.Array,
    *,
    max_new_tokens: int = 256,
    settings: DenoiseSettings | None = None,
    eos_token_ids: tuple[int, ...] | None = None,
    pad_token_id: int | None = None,
    prompt_valid: np.ndarray | None = None,
) -> GenerationResult:
    """Generates canvases after each prompt row.

    Args:
      prompt: int [B, P] token ids (left-padded when prompt_valid marks padding).
      rng: the key of every random draw (canvas c uses canvas_key(rng, c)).
      settings: the denoising settings (None: DenoiseSettings()).
      max_new_tokens: ceil(max_new_tokens / L) canvases at most.
      eos_token_ids: the ids that finish a row; default config.eos_token_ids.
      pad_token_id: what replaces tokens after a row's EOS; None leaves them.
      prompt_valid: bool [B, P]; False marks padding tokens (never attended).
    Raises:
      ValueError: an image placeholder token or an out-of-vocabulary id in the prompt,
        max_new_tokens < 1, or a sequence longer than the model's maximum.
    """
    settings = DenoiseSettings() if settings is None else settings
    prompt = np.asarray(prompt)
    _check_prompt(config, prompt)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected at least 1")
    B, P = prompt.shape
    L, V = config.canvas_length, config.vocab_size
    n_canvases = math.ceil(max_new_tokens / L)
    if P + n_canvases * L > config.max_sequence_length:
        raise ValueError(
            f"prompt {P} + {n_canvases} canvases of {L} exceeds the model's {config.max_sequence_length} positions"
        )
    eos = np.asarray(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    valid = np.ones((B, P), bool) if prompt_valid is None else np.asarray(prompt_valid, bool)
    # The model's passes read no EOS id (only the host loop below does): their jitted steps take
    # the config with the EOS ids fixed, so configs differing only there share compiled steps.
    config = dataclasses.replace(config, eos_token_ids=(0,))

    cache = dg.init_cache(config, B, P + (n_canvases - 1) * L)
    cache, _ = _encode(config, params, jnp.asarray(prompt), cache, jnp.asarray(valid))
    sequences = prompt
    finished = np.zeros(B, bool)
    passes = np.zeros(B, np.int64)
    for c in range(n_canvases):
        if c:
            cache, _ = _encode(config, params, jnp.asarray(sequences[:, -L:]), cache, jnp.ones((B, L), bool))
        key = canvas_key(rng, c)
        state = initial_state(initial_canvas(key, B, L, V), V, settings, config.jnp_dtype)
        for step in range(settings.max_denoising_steps):
            passes += ~(np.asarray(state.done) | finished)
            state = _denoise_step(config, settings, params, state, cache, key, jnp.int32(step))
            if np.all(np.asarray(state.done)):
                break
        sequences, finished = _finish_canvas(
            np.concatenate([sequences, np.asarray(state.argmax)], axis=1), finished, L, eos, pad_token_id
        )
        if finished.all():
            break
    return GenerationResult(sequences=sequences, decoder_passes=passes)


def _check_prompt(config: DiffusionGemmaConfig, prompt: np.ndarray) -> None:
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt: expected int token ids [B, P] with P >= 1, got shape {prompt.shape}")
    if config.image_token_id is not None and (prompt == config.image_token_id).any():
        row, col = np.argwhere(prompt == config.image_token_id)[0]
        raise ValueError(
            f"prompt[{row}, {col}] is the image token {config.image_token_id}: image inputs are not "
            "supported (only the text model is loaded)"
        )
    if ((prompt < 0) | (prompt >= config.vocab_size)).any():
        raise ValueError(f"prompt: token ids must be in [0, {config.vocab_size})")


def _finish_canvas(
    sequences: np.ndarray, finished: np.ndarray, length: int, eos: np.ndarray, pad: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Marks rows whose new canvas holds an EOS finished, and pads what follows an EOS.

    In (L 4, EOS 9, pad 0): canvas [5, 9, 7, 9] of a running row. Out: [5, 9, 0, 0], finished.
    A row finished before this canvas gets all L tokens padded.
    """
    canvas = sequences[:, -length:]
    is_eos = np.isin(canvas, eos)
    now = finished | is_eos.any(axis=-1)
    if pad is not None:
        sequences = sequences.copy()
        after_first = np.cumsum(is_eos, axis=-1) - is_eos > 0
        canvas = np.where(finished[:, None] | after_first, pad, canvas)
        sequences[:, -length:] = canvas
    return sequences, now


@functools.partial(jax.jit, static_argnums=0)
def _encode(config, params, tokens, cache, valid):
    return dg.encode(config, params, tokens, cache, valid)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _denoise_step(
    config: DiffusionGemmaConfig,
    settings: DenoiseSettings,
    params,
    state: CanvasState,
    cache: dg.EncoderCache,
    key: jax.Array,
    step: jax.Array,
) -> CanvasState:
    """One decoder pass over the canvas and the denoising rule on its logits."""
    B, L = state.canvas.shape
    logits = dg.decode(config, params, state.canvas, cache, state.logits, state.has_logits)
    uniform, noise_tokens = step_noise(key, step, B, L, config.vocab_size)
    return denoise_update(settings, state, logits, step, uniform, noise_tokens)
