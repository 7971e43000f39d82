"""Per-slot state of block diffusion (DiffusionGemma): a request's phase and its canvas.

A slot's sequence is ``tokens[:max_len]``: the prompt at [0, P), then its canvases of L
tokens, canvas c at [P + c L, P + (c + 1) L). Each loop iteration gives an active slot one
pass of L rows, by its phase:
  PREFILL  rows [start, start + L) of the prompt, encoded into the cache (start = 0, L, ...);
  DENOISE  the current canvas at [start, start + L): a decoder pass over ``noisy`` and one
           denoising step (``tokens`` there hold its latest argmax);
  COMMIT   the finished canvas (its argmax) encoded into the cache, before the next canvas;
  DONE     the request is complete (its answer is in ``tokens``).
Functions here act on ONE slot (no batch axis); the loop vmaps them over the slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax.runtime.slots import SlotSampling, zero_sampling

PREFILL, DENOISE, COMMIT, DONE = 0, 1, 2, 3


@struct.dataclass
class CanvasSlots:
    """Decode state of the slots; every leaf has a leading [B] axis (none inside policies).

    tokens: int32 [B, max_len] the sequence (see the module doc; EOS padding after the answer);
      commit_step: int32 [B, max_len] the slot's pass at which each canvas position was
      finished (-1: not yet, the prompt included); verified: bool [B, max_len], always False
      (no Flash-Verify here; the session reads it).
    prompt_len, gen_end (the end of the request's last canvas: P + ceil(max_new_tokens / L) L),
      phase, start (the first position of the slot's next rows), canvas_index, denoise_step
      (steps of the current canvas so far): int32 [B]; eos_found: bool [B].
    noisy: int32 [B, L] the decoder's next input; history: int32 [B, S_max, L] the previous
      steps' argmax canvases, newest last (-1: none yet); soft: [B, L, D] model dtype, the
      self-conditioning soft embeddings of the last step (zeros before the first).
    Flash-Cache on the canvas (a loop with cached canvas rows): hidden: [B, L, D] model dtype,
      each canvas row's last-layer output at its last recomputation; scores: float32 [B, L]
      the canvas rows' tracking scores of the last pass; changed, sampled: bool [B, L], the
      last step gave the row a new token, accepted the row's sample (else renoised it).
    active, request, start_iter, sampling, error: as dllm_jax.runtime.slots.Slots; steps:
      denoising steps (decoder passes), passes: every pass (encoder ones too), verify_passes
      and accepted: 0 (the results ring's fields).
    """

    tokens: jax.Array
    commit_step: jax.Array
    verified: jax.Array
    prompt_len: jax.Array
    gen_end: jax.Array
    phase: jax.Array
    start: jax.Array
    canvas_index: jax.Array
    denoise_step: jax.Array
    eos_found: jax.Array
    noisy: jax.Array
    history: jax.Array
    soft: jax.Array
    hidden: jax.Array
    scores: jax.Array
    changed: jax.Array
    sampled: jax.Array
    active: jax.Array
    request: jax.Array
    steps: jax.Array
    passes: jax.Array
    verify_passes: jax.Array
    accepted: jax.Array
    start_iter: jax.Array
    sampling: SlotSampling
    error: jax.Array


def empty_canvas_slots(
    num_slots: int, max_len: int, canvas_length: int, max_stability: int, d_model: int, dtype: jnp.dtype
) -> CanvasSlots:
    """Slots holding nothing (all inactive)."""
    B, L = num_slots, canvas_length
    i32 = lambda: jnp.zeros((B,), jnp.int32)  # noqa: E731
    return CanvasSlots(
        tokens=jnp.zeros((B, max_len), jnp.int32),
        commit_step=jnp.full((B, max_len), -1, jnp.int32),
        verified=jnp.zeros((B, max_len), bool),
        prompt_len=i32(),
        gen_end=i32(),
        phase=jnp.full((B,), DONE, jnp.int32),
        start=i32(),
        canvas_index=i32(),
        denoise_step=i32(),
        eos_found=jnp.zeros((B,), bool),
        noisy=jnp.zeros((B, L), jnp.int32),
        history=jnp.full((B, max_stability, L), -1, jnp.int32),
        soft=jnp.zeros((B, L, d_model), dtype),
        hidden=jnp.zeros((B, L, d_model), dtype),
        scores=jnp.zeros((B, L), jnp.float32),
        changed=jnp.zeros((B, L), bool),
        sampled=jnp.zeros((B, L), bool),
        active=jnp.zeros((B,), bool),
        request=i32(),
        steps=i32(),
        passes=i32(),
        verify_passes=i32(),
        accepted=i32(),
        start_iter=i32(),
        sampling=zero_sampling((B,)),
        error=i32(),
    )


def install_canvas_request(
    slot: CanvasSlots,
    prompt: jax.Array,
    prompt_len: jax.Array,
    request: jax.Array,
    sampling: SlotSampling,
    iteration: jax.Array,
) -> CanvasSlots:
    """Puts a request into a slot: its prompt (padded int32 [P_max], true length prompt_len),
    phase PREFILL from position 0. The canvas state is set when its first canvas starts."""
    max_len, L = slot.tokens.shape[0], slot.noisy.shape[0]
    pos = jnp.arange(max_len, dtype=jnp.int32)
    padded = jnp.zeros((max_len,), jnp.int32).at[: prompt.shape[0]].set(prompt[:max_len])
    canvases = (sampling.max_new_tokens + L - 1) // L
    zero = jnp.zeros((), jnp.int32)
    return slot.replace(
        tokens=jnp.where(pos < prompt_len, padded, 0),
        commit_step=jnp.full((max_len,), -1, jnp.int32),
        verified=jnp.zeros((max_len,), bool),
        prompt_len=prompt_len,
        gen_end=prompt_len + canvases * L,
        phase=jnp.int32(PREFILL),
        start=zero,
        canvas_index=zero,
        denoise_step=zero,
        eos_found=jnp.zeros((), bool),
        active=jnp.ones((), bool),
        request=request,
        steps=zero,
        passes=zero,
        verify_passes=zero,
        accepted=zero,
        start_iter=iteration,
        sampling=sampling,
        error=zero,
    )
