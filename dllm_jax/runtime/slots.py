"""Per-slot decode state and the operations every policy shares (install, commit, finish).

A slot holds one request. Its canvas is ``tokens[:L]``: the prompt at [0, P), the generation
at [P, P + G) (initially [MASK]), and EOS padding from P + G on. Positions are per slot;
``decoded`` marks committed ones (the prompt counts as decoded). Functions here act on ONE
slot (no batch axis); the decode loop vmaps them over the slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dllm_jax.sampling.params import knobs

# Slots.error codes: why a request ended without finishing (0: it did not).
ERROR_NONE = 0
ERROR_NON_FINITE = 1  # the model produced NaN or +-inf logits at one of its candidates
ERROR_STEP_LIMIT = 2  # it ran more steps than its length allows (a commit rule stopped committing)
ERROR_MESSAGES = {
    ERROR_NON_FINITE: "the model produced non-finite logits (NaN or inf) for this request",
    ERROR_STEP_LIMIT: "the request exceeded its step bound without finishing",
}


# Per-slot values the engine derives for a request (no SamplingParams field of their own), each
# stored right after the knob it derives from: step_limit (a hard bound on the request's steps)
# from gen_length, stream (its random stream within its seed) from seed, t_span (t_max - t_min,
# subtracted in double precision as transformers' temperature schedule does) from t_max.
ENGINE_VALUES: dict[str, tuple[tuple[str, type], ...]] = {
    "gen_length": (("step_limit", np.int32),),
    "seed": (("stream", np.int32),),
    "t_max": (("t_span", np.float32),),
}


def _slot_fields() -> tuple[tuple[str, type], ...]:
    fields = []
    for name, spec in knobs().items():
        fields.append((spec.slot_name or name, spec.dtype))
        fields += ENGINE_VALUES.get(name, ())
    return tuple(fields)


SLOT_FIELDS: tuple[tuple[str, type], ...] = _slot_fields()
"""(name, numpy dtype) of each per-slot value of a request, in leaf order: the SamplingParams knobs
(dllm_jax.sampling.params.knob) and the ENGINE_VALUES after the knob each derives from."""

SlotSampling = struct.dataclass(
    type(
        "SlotSampling",
        (),
        {
            "__module__": __name__,
            "__annotations__": {name: "jax.Array" for name, _ in SLOT_FIELDS},
            "__doc__": "One request's sampling values as the device holds them, one field per SLOT_FIELDS entry;\n"
            "each leaf is one scalar per request: [B] in Slots, [Q] in the request ring.",
        },
    )
)


def zero_sampling(shape: tuple[int, ...]) -> SlotSampling:
    """SlotSampling of the given leading shape, all zero (an empty slot or ring entry)."""
    return SlotSampling(**{name: jnp.zeros(shape, dtype) for name, dtype in SLOT_FIELDS})


@struct.dataclass
class Slots:
    """Decode state of the slots; every leaf has a leading [B] axis (none inside policies).

    tokens: int32 [B, L] canvas; drafts: int32 [B, L] latest argmax of each window position
      (Flash-Verify); decoded: bool [B, L]; scores: float32 [B, L] tracking scores of the last
      main pass; pinned: bool [B, L] positions committed by the last commit stage (refreshed
      first at the next step).
    prompt_len, key_len (keys attended: [0, key_len)), gen_end (= P + G), bound (exclusive
      end of the answer: gen_end until an EOS is committed, then that EOS position + 1),
      eos_found, block_start, block_step (block policies): int32/bool [B].
    active: holds an unfinished request; needs_full: its next step is a full pass;
      request: index of the request in the queue.
    steps, passes (main forward passes), verify_passes, accepted (drafts accepted by
      verification), start_iter (loop iteration at install): per-request counters [B].
    sampling: the request's SlotSampling [B]; error: int32 [B] an ERROR_* code (non-zero ends it).
    commit_step: int32 [B, L] the slot's step at which each position was committed (-1: not
      committed, the prompt included); verified: bool [B, L] committed by Flash-Verify.
    drift: float32 [B, L] how much each position's K/V changed at its last refresh in a sparse
      pass (dllm_jax.runtime.row_drift; 0 until it is refreshed in one).
    logprob: float32 [B, L] each committed token's log-probability at its commit; top_ids int32
      [B, L, K] and top_logprobs float32 [B, L, K]: that step's K most likely tokens (K: the
      loop's max_logprobs); written only for requests that ask (sampling.logprobs >= 0).
    """

    tokens: jax.Array
    drafts: jax.Array
    decoded: jax.Array
    scores: jax.Array
    pinned: jax.Array
    prompt_len: jax.Array
    key_len: jax.Array
    gen_end: jax.Array
    bound: jax.Array
    eos_found: jax.Array
    block_start: jax.Array
    block_step: jax.Array
    active: jax.Array
    needs_full: jax.Array
    request: jax.Array
    steps: jax.Array
    passes: jax.Array
    verify_passes: jax.Array
    accepted: jax.Array
    start_iter: jax.Array
    sampling: SlotSampling
    error: jax.Array
    commit_step: jax.Array
    verified: jax.Array
    drift: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def empty_slots(num_slots: int, max_len: int, max_logprobs: int = 0) -> Slots:
    """Slots holding nothing (all inactive), recording up to max_logprobs alternatives per token."""
    B, L, K = num_slots, max_len, max_logprobs
    i32 = lambda: jnp.zeros((B,), jnp.int32)  # noqa: E731
    return Slots(
        tokens=jnp.zeros((B, L), jnp.int32),
        drafts=jnp.zeros((B, L), jnp.int32),
        decoded=jnp.zeros((B, L), bool),
        scores=jnp.zeros((B, L), jnp.float32),
        pinned=jnp.zeros((B, L), bool),
        prompt_len=i32(),
        key_len=i32(),
        gen_end=i32(),
        bound=i32(),
        eos_found=jnp.zeros((B,), bool),
        block_start=i32(),
        block_step=i32(),
        active=jnp.zeros((B,), bool),
        needs_full=jnp.zeros((B,), bool),
        request=i32(),
        steps=i32(),
        passes=i32(),
        verify_passes=i32(),
        accepted=i32(),
        start_iter=i32(),
        sampling=zero_sampling((B,)),
        error=i32(),
        commit_step=jnp.full((B, L), -1, jnp.int32),
        verified=jnp.zeros((B, L), bool),
        drift=jnp.zeros((B, L), jnp.float32),
        logprob=jnp.zeros((B, L), jnp.float32),
        top_ids=jnp.zeros((B, L, K), jnp.int32),
        top_logprobs=jnp.zeros((B, L, K), jnp.float32),
    )


def step_rng(sampling: SlotSampling, step: jax.Array) -> jax.Array:
    """The random key of a request's step: its seed, its stream within the seed, the step."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(sampling.seed), sampling.stream), step)


def install(
    slot: Slots,
    prompt: jax.Array,
    prompt_len: jax.Array,
    request: jax.Array,
    sampling: SlotSampling,
    key_len: jax.Array,
    mask_id: int,
    eos_id: int,
    iteration: jax.Array,
) -> Slots:
    """Puts a request into a slot: prompt, [MASK] canvas, EOS padding; next step is a full pass.

    prompt: int32 [P_max] (padded), prompt_len: its true length P; the canvas has
    sampling.gen_length [MASK] positions after it.
    """
    L = slot.tokens.shape[0]
    pos = jnp.arange(L, dtype=jnp.int32)
    padded = jnp.zeros((L,), jnp.int32).at[: prompt.shape[0]].set(prompt[:L])
    gen_end = prompt_len + sampling.gen_length
    tokens = jnp.where(pos < prompt_len, padded, jnp.where(pos < gen_end, mask_id, eos_id))
    zero = jnp.zeros((), jnp.int32)
    return Slots(
        tokens=tokens,
        drafts=tokens,
        decoded=pos < prompt_len,
        scores=jnp.zeros((L,), jnp.float32),
        pinned=jnp.zeros((L,), bool),
        prompt_len=prompt_len,
        key_len=key_len,
        gen_end=gen_end,
        bound=gen_end,
        eos_found=jnp.zeros((), bool),
        block_start=prompt_len,
        block_step=zero,
        active=jnp.ones((), bool),
        needs_full=jnp.ones((), bool),
        request=request,
        steps=zero,
        passes=zero,
        verify_passes=zero,
        accepted=zero,
        start_iter=iteration,
        sampling=sampling,
        error=zero,
        commit_step=jnp.full((L,), -1, jnp.int32),
        verified=jnp.zeros((L,), bool),
        drift=jnp.zeros((L,), jnp.float32),
        logprob=jnp.zeros((L,), jnp.float32),
        top_ids=jnp.zeros_like(slot.top_ids),
        top_logprobs=jnp.zeros_like(slot.top_logprobs),
    )


def commit_tokens(
    slot: Slots, positions: jax.Array, tokens: jax.Array, commit: jax.Array, eos_id: int, stop_at_eos: bool
) -> Slots:
    """Writes the committed candidates into the canvas and applies the EOS rule.

    positions, tokens, commit: [C]. With stop_at_eos, the first commit stage that commits an
    EOS sets bound = (largest EOS position it committed) + 1, once per request: positions at
    or after the bound are never generated. commit_step records the slot's current step.
    """
    L = slot.tokens.shape[0]
    target = jnp.where(commit, positions, L)  # L is out of range: dropped
    new_tokens = slot.tokens.at[target].set(tokens, mode="drop")
    decoded = slot.decoded.at[target].set(True, mode="drop")
    commit_step = slot.commit_step.at[target].set(slot.steps, mode="drop")
    slot = slot.replace(tokens=new_tokens, decoded=decoded, commit_step=commit_step)
    if not stop_at_eos:
        return slot
    eos_hits = commit & (tokens == eos_id)
    first_eos_commit = jnp.any(eos_hits) & ~slot.eos_found
    eos_bound = jnp.max(jnp.where(eos_hits, positions + 1, 0))
    return slot.replace(
        bound=jnp.where(first_eos_commit, eos_bound, slot.bound).astype(jnp.int32),
        eos_found=slot.eos_found | first_eos_commit,
    )


def cut_decoded(slot: Slots) -> jax.Array:
    """True once the answer's first sampling.max_new_tokens positions are all decoded: the
    answer is cut there, so nothing after them can change it."""
    pos = jnp.arange(slot.tokens.shape[0])
    in_cut = (pos >= slot.prompt_len) & (pos < slot.prompt_len + slot.sampling.max_new_tokens)
    return ~jnp.any(in_cut & ~slot.decoded)


def answer_remaining(slot: Slots) -> jax.Array:
    """True while some position before the answer bound is still undecoded (section D.3)."""
    pos = jnp.arange(slot.tokens.shape[0])
    return jnp.any(~slot.decoded & (pos < slot.bound))


def answer_length(slot: Slots, eos_id: int) -> jax.Array:
    """Generated positions up to and including the first EOS of the answer (G if none)."""
    pos = jnp.arange(slot.tokens.shape[0])
    in_answer = (pos >= slot.prompt_len) & (pos < slot.gen_end)
    first_eos = jnp.min(jnp.where(in_answer & slot.decoded & (slot.tokens == eos_id), pos, slot.gen_end - 1))
    return (first_eos + 1 - slot.prompt_len).astype(jnp.int32)


def smallest_undecoded(slot: Slots, count: int) -> tuple[jax.Array, jax.Array]:
    """The `count` smallest undecoded positions below key_len, ascending, and their validity."""
    L = slot.tokens.shape[0]
    pos = jnp.arange(L, dtype=jnp.int32)
    key = jnp.where(~slot.decoded & (pos < slot.key_len), pos, L)
    neg_top, _ = jax.lax.top_k(-key, count)
    positions = -neg_top
    return jnp.minimum(positions, L - 1), positions < L
