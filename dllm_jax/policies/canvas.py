"""DiffusionGemma's canvas policy: transformers' ``generate`` as per-slot phases of the one loop.

A request goes through (dllm_jax.runtime.canvas_slots):
  PREFILL  its prompt, encoded L rows per iteration into the cache;
  DENOISE  canvas c (L tokens after everything before it): it starts from uniform random
           tokens, and each iteration is one decoder pass and one step of the entropy-bound
           rule (dllm_jax.policies.entropy_bound): step n of N at temperature
           t_min + (t_max - t_min) (N - n) / N, a sample of every position (inverse CDF), the
           lowest-entropy positions within entropy_bound accepted and the others renoised, the
           processed logits' softmax the next step's self-conditioning input. The canvas ends
           when its argmax equals that of each of the previous stability_threshold steps with a
           mean entropy below confidence_threshold, or after max_denoising_steps steps; its
           argmax is the canvas's answer, EOS-padded after its first EOS;
  COMMIT   the finished canvas encoded into the cache; then canvas c + 1 starts;
  DONE     once a canvas holds an EOS or the request has its ceil(max_new_tokens / L) canvases.
All values are the slot's own (SlotSampling): requests with different values share the loop.

Flash-Cache on the canvas (``cached_rows``): a canvas's first step recomputes all its rows;
each later step only ``cached_rows`` of them (``sparse_rows``), the others keep the keys,
values and last-layer rows of their last recomputation. Which rows, in this order: those the
last step gave a new token that it accepted (a sample), those it renoised with a new random
token, then the rest; within each, the highest tracking score first (the attention the canvas
row received in the last pass: Flash-Cache's "most attended" rows).

Randomness: the key of request (seed, stream) is fold_in(key(seed), stream); canvas c draws
from canvas_key(that, c): its initial tokens and each step's noise, at batch size 1, exactly as
tests/diffusion_gemma_reference.py's generate does for one row. So a request's answer depends
on its seed and stream only, never on the batch (transformers' batched generate couples rows
through its whole-batch early exit and its batch-shaped draws; at batch 1 they agree).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.policies.entropy_bound import (
    annealed_temperature,
    canvas_key,
    entropy_bound_accept,
    initial_canvas,
    sample,
    step_noise,
    token_entropy,
)
from dllm_jax.runtime.canvas_forward import CanvasRows
from dllm_jax.runtime.canvas_policy import StepStatistics
from dllm_jax.runtime.canvas_slots import COMMIT, DENOISE, DONE, PREFILL, CanvasSlots


@dataclasses.dataclass(frozen=True)
class CanvasPolicy:
    """canvas_length: L; vocab_size: V; max_stability: the history kept (the loop's
    DecodeConfig.max_stability_threshold); eos_ids: the ids that end a request; pad_id: what
    follows an answer's EOS."""

    canvas_length: int
    vocab_size: int
    max_stability: int
    eos_ids: tuple[int, ...]
    pad_id: int
    cached_rows: int | None = None

    def needs_full(self, slot: CanvasSlots) -> jax.Array:
        """bool: the slot's pass this iteration is a full one (an encoding, or the first step of
        a canvas); with cached rows, every other denoising step is a sparse one."""
        return (slot.phase != DENOISE) | (slot.denoise_step == 0)

    def sparse_rows(self, slot: CanvasSlots) -> tuple[CanvasRows, jax.Array]:
        """The cached_rows canvas rows a sparse step recomputes (see the module doc), and their
        canvas offsets int32 [cached_rows]."""
        L = self.canvas_length
        # ranks 0..L-1 of the scores, ascending: every key below 1 within its class
        rank = jnp.argsort(jnp.argsort(slot.scores)).astype(jnp.float32) / L
        kind = 2 * (slot.changed & slot.sampled) + (slot.changed & ~slot.sampled)
        _, offsets = jax.lax.top_k(kind.astype(jnp.float32) + rank, self.cached_rows)
        offsets = offsets.astype(jnp.int32)
        valid = jnp.broadcast_to(slot.active & (slot.phase == DENOISE), offsets.shape)
        rows = CanvasRows(
            tokens=slot.noisy[offsets],
            positions=slot.start + offsets,
            valid=valid,
            decoder=jnp.ones((), bool),
            start=slot.start,
            soft=slot.soft[offsets],
        )
        return rows, offsets

    def _request_key(self, slot: CanvasSlots) -> jax.Array:
        return jax.random.fold_in(jax.random.key(slot.sampling.seed), slot.sampling.stream)

    def rows(self, slot: CanvasSlots) -> CanvasRows:
        L = self.canvas_length
        positions = slot.start + jnp.arange(L, dtype=jnp.int32)
        decoder = slot.phase == DENOISE
        # a prompt chunk, or the finished canvas (start + L <= max_len: the slot holds its canvases)
        encoded = jax.lax.dynamic_slice(slot.tokens, (slot.start,), (L,))
        valid = jnp.where(slot.phase == PREFILL, positions < slot.prompt_len, slot.phase != DONE) & slot.active
        return CanvasRows(
            tokens=jnp.where(decoder, slot.noisy, encoded),
            positions=positions,
            valid=valid,
            decoder=decoder,
            start=slot.start,
            soft=slot.soft,
        )

    def _start_canvas(self, slot: CanvasSlots, index: jax.Array, start: jax.Array) -> CanvasSlots:
        """Canvas `index` at `start`: uniform random tokens from its key, no history, no signal."""
        L = self.canvas_length
        noisy = initial_canvas(canvas_key(self._request_key(slot), index), 1, L, self.vocab_size)[0]
        return slot.replace(
            phase=jnp.int32(DENOISE),
            start=start,
            canvas_index=index,
            denoise_step=jnp.zeros((), jnp.int32),
            noisy=noisy,
            history=jnp.full_like(slot.history, -1),
            soft=jnp.zeros_like(slot.soft),
            scores=jnp.zeros_like(slot.scores),
            changed=jnp.zeros_like(slot.changed),
            sampled=jnp.zeros_like(slot.sampled),
            tokens=jax.lax.dynamic_update_slice(slot.tokens, noisy, (start,)),
        )

    def after_encoding(self, slot: CanvasSlots) -> CanvasSlots:
        """PREFILL: the next prompt chunk, or canvas 0 right after the prompt; COMMIT: the next canvas."""
        following = slot.start + self.canvas_length
        prefilling = slot.phase == PREFILL
        begins = ~prefilling | (following >= slot.prompt_len)
        index = jnp.where(prefilling, 0, slot.canvas_index + 1)
        started = self._start_canvas(slot, index, jnp.where(prefilling, slot.prompt_len, following))
        return jax.tree_util.tree_map(lambda a, b: jnp.where(begins, a, b), started, slot.replace(start=following))

    def _step_noise(self, slot: CanvasSlots) -> tuple[jax.Array, jax.Array]:
        """The slot's denoising step's draws (step_noise at batch 1): uniforms float32 [1, L]
        and renoising tokens int32 [1, L]."""
        key = canvas_key(self._request_key(slot), slot.canvas_index)
        return step_noise(key, slot.denoise_step, 1, self.canvas_length, self.vocab_size)

    def step_inputs(self, slot: CanvasSlots) -> tuple[jax.Array, jax.Array]:
        p = slot.sampling
        temperature = annealed_temperature(p.t_min, p.t_span, p.max_denoising_steps, slot.denoise_step)
        uniform, _ = self._step_noise(slot)
        return temperature, uniform[0]

    def denoise(self, slot: CanvasSlots, logits: jax.Array) -> tuple[CanvasSlots, jax.Array]:
        temperature, uniform = self.step_inputs(slot)
        processed = logits.astype(jnp.float32) / temperature
        statistics = StepStatistics(
            argmax=jnp.argmax(processed, axis=-1).astype(jnp.int32),
            entropy=token_entropy(processed),
            drawn=sample(processed, uniform),
        )
        return self.denoise_with(slot, statistics), processed

    def denoise_with(self, slot: CanvasSlots, statistics: StepStatistics) -> CanvasSlots:
        p, step = slot.sampling, slot.denoise_step
        argmax, entropy = statistics.argmax, statistics.entropy
        _, renoise = self._step_noise(slot)
        accepted = entropy_bound_accept(entropy[None], p.entropy_bound)[0]
        # stable: equal to each of the last stability_threshold argmax canvases (vacuous for 0)
        compared = jnp.arange(self.max_stability) >= self.max_stability - p.stability_threshold
        stable = jnp.all(jnp.where(compared[:, None], slot.history == argmax[None, :], True))
        confident = jnp.mean(entropy) < p.confidence_threshold
        ends = (stable & confident) | (step + 1 >= p.max_denoising_steps)
        history = jnp.concatenate([slot.history[1:], argmax[None]]) if self.max_stability else slot.history
        noisy = jnp.where(accepted, statistics.drawn, renoise[0])
        stepped = slot.replace(
            noisy=noisy,
            changed=noisy != slot.noisy,
            sampled=accepted,
            history=history,
            denoise_step=step + 1,
            tokens=jax.lax.dynamic_update_slice(slot.tokens, argmax, (slot.start,)),
        )
        ended = self._end_canvas(stepped, argmax)
        return jax.tree_util.tree_map(lambda a, b: jnp.where(ends, a, b), ended, stepped)

    def _end_canvas(self, slot: CanvasSlots, argmax: jax.Array) -> CanvasSlots:
        """The canvas's answer (argmax, pad after its first EOS) and the slot's next phase.

        In (L 4, EOS 9, pad 0): argmax [5, 9, 7, 9]. Out: tokens [5, 9, 0, 0], phase DONE.
        """
        is_eos = jnp.isin(argmax, jnp.asarray(self.eos_ids, jnp.int32))
        after_first = jnp.cumsum(is_eos) - is_eos > 0
        answer = jnp.where(after_first, self.pad_id, argmax)
        has_eos = jnp.any(is_eos)
        last = slot.start + self.canvas_length >= slot.gen_end
        commit_step = jnp.full((self.canvas_length,), slot.passes, jnp.int32)
        return slot.replace(
            tokens=jax.lax.dynamic_update_slice(slot.tokens, answer, (slot.start,)),
            commit_step=jax.lax.dynamic_update_slice(slot.commit_step, commit_step, (slot.start,)),
            eos_found=has_eos,
            phase=jnp.where(has_eos | last, DONE, COMMIT).astype(jnp.int32),
        )

    def finished(self, slot: CanvasSlots) -> jax.Array:
        return slot.phase == DONE

    def num_tokens(self, slot: CanvasSlots) -> jax.Array:
        """Generated positions up to and including the first EOS, at most max_new_tokens."""
        pos = jnp.arange(slot.tokens.shape[0], dtype=jnp.int32)
        generated = jnp.minimum(slot.start + self.canvas_length, slot.prompt_len + slot.sampling.max_new_tokens)
        in_answer = (pos >= slot.prompt_len) & (pos < generated)
        is_eos = jnp.isin(slot.tokens, jnp.asarray(self.eos_ids, jnp.int32))
        end = jnp.min(jnp.where(in_answer & is_eos, pos + 1, generated))
        return (end - slot.prompt_len).astype(jnp.int32)
