"""The Pallas Triton body of ``cache_attention`` (the wrapper and reference are in cache_attention.py).

One program = one (query tile, kv head, key split, group). It loads its query rows once
(the G query heads of the kv head, flattened to rows f = r * G + g), then streams its share of
the group's cache keys [key_first, key_len) (the split is cut from that range at run time) in
``block_k`` tiles with an online softmax (float32 logits, P rounded to the value dtype before
P.V), adds the in-query "extra" keys in split 0, ``block_k`` of them at a time, and writes
either the final rows or a normalised partial + log-sum-exp for the split combine. With a
per-row first key (``key_start``), each row's logits before its own first key are hidden, and
a program whose rows all start later skips the key tiles before them (not with scores: every
program writes the score partials of the whole range). The tracking score is linear in q: the
program sums its score rows' queries into one float32 vector and takes one dot product per key,
on the K tile it already holds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.online_softmax import initial_state, online_softmax_weights
from pallas_kernels.attention.reference import MASKED_LOGIT
from pallas_kernels.common import dot_t


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """Static facts of one call.

    Attributes:
      group: G = H // KVH query heads per kv head.
      head_dim: Dh.
      block_q: query rows (flattened r * G + g) per program.
      block_k: keys per step.
      q_tiles: programs along the flattened rows: R * G / block_q (the wrapper pads R).
      n_splits: most key splits per group (see active_splits).
      max_len: cache rows per slot.
      split_output: write partials + log-sum-exp (more than one split) instead of final rows.
      scores: compute the tracking-score partials.
      exclude: a key_exclude input is present.
      extra_width: padded number of extra (in-query) keys, a multiple of block_k; 0 = none.
      key_start: a per-row first key input is present.
      scale: the logits' factor.
    """

    group: int
    head_dim: int
    block_q: int
    block_k: int
    q_tiles: int
    n_splits: int
    max_len: int
    split_output: bool
    scores: bool
    exclude: bool
    extra_width: int
    key_start: bool
    scale: float


def active_splits(n_keys: jax.Array, n_splits: int, block_k: int) -> jax.Array:
    """Splits that hold keys for a group of n_keys keys: at most n_splits, each with at least
    2 * block_k keys, at least one. Splits at or past this count write nothing."""
    min_keys = 2 * block_k
    return jnp.clip((n_keys + min_keys - 1) // min_keys, 1, n_splits)


def _softmax_step(carry, logits, v, visible=None):
    """Online-softmax update with a [BQ, BK] float32 logit tile and its [BK, Dh] values;
    visible: optional bool [BQ, BK] where rows differ in the keys they see."""
    m, l, acc = carry
    m, l, alpha, p = online_softmax_weights(m, l, logits, visible)
    return m, l, acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def attention_kernel(*refs, lay: KernelLayout):
    """Refs: layer [1], group_slot [S], key_first [S] (the first key any row of the group
    sees), key_len [S], q [S, R, H*Dh], k_cache, v_cache [NL, M, KVH*Dh], then (if present)
    key_start int32 [S, R], score weights f32 [S, R], key_exclude bool [S, max_len], k_extra,
    v_extra [S, R2p, KVH*Dh], extra_mask bool [S, R, R2p]; outputs: out [S, R, H*Dh] or
    (partial out [NS, S, R, H*Dh], lse f32 [NS, S, R, H]), then (if scores) score partials
    f32 [S, KVH * q_tiles, max_len]."""
    refs = list(refs)
    layer_ref, slot_ref, key_first_ref, len_ref, q_ref, k_ref, v_ref = refs[:7]
    rest = refs[7:]
    start_ref = rest.pop(0) if lay.key_start else None
    weight_ref = rest.pop(0) if lay.scores else None
    exclude_ref = rest.pop(0) if lay.exclude else None
    extra_refs = [rest.pop(0) for _ in range(3)] if lay.extra_width else None
    out_refs = [rest.pop(0) for _ in range(2 if lay.split_output else 1)]
    score_ref = rest.pop(0) if lay.scores else None

    q_tile, kv_head, split, g_idx = (pl.program_id(i) for i in range(4))
    bq, bk, dh, group = lay.block_q, lay.block_k, lay.head_dim, lay.group
    layer = layer_ref[0]
    key_len = len_ref[g_idx]
    first_row = slot_ref[g_idx] * lay.max_len

    # flattened query rows f = r * G + g of this tile (the wrapper pads R so that all are real)
    flat = q_tile * bq + jnp.arange(bq, dtype=jnp.int32)
    rows = flat // group
    heads = kv_head * group + flat % group
    cols = heads[:, None] * dh + jnp.arange(dh, dtype=jnp.int32)[None, :]
    # [BQ, Dh]: row f holds q[g_idx, f // G, head kv_head * G + f % G]
    q = q_ref[g_idx, rows[:, None], cols]
    scale = lay.scale

    if lay.scores:
        # [Dh]: sum of the score rows' queries of this tile
        q_sum = jnp.sum(q.astype(jnp.float32) * weight_ref[g_idx, rows][:, None], axis=0)

    kv_cols = pl.ds(kv_head * dh, dh)
    # this group's keys [key_first, key_len), cut into `splits` chunks of whole steps (run time)
    key_first = key_first_ref[g_idx]
    n_keys = jnp.maximum(key_len - key_first, 0)
    splits = active_splits(n_keys, lay.n_splits, bk)
    chunk = ((n_keys + splits - 1) // splits + bk - 1) // bk * bk
    start = key_first + split * chunk
    stop = jnp.minimum(key_len, start + chunk)
    n_steps = (jnp.maximum(stop - start, 0) + bk - 1) // bk
    first_step = 0
    if lay.key_start:
        # [BQ]: each row's first visible key
        row_start = start_ref[g_idx, rows]
        if not lay.scores:
            # no row of this tile sees a key before its earliest start
            first_step = jnp.clip((jnp.min(row_start) - start) // bk, 0, n_steps)

    def key_step(t, carry):
        first = start + t * bk
        keys = first + jnp.arange(bk, dtype=jnp.int32)
        in_range = keys < stop
        visible = in_range
        if lay.exclude:
            skipped = plgpu.load(exclude_ref.at[g_idx, pl.ds(first, bk)], mask=in_range, other=True)
            visible = in_range & jnp.logical_not(skipped)
        kv_mask = jnp.broadcast_to(visible[:, None], (bk, dh))
        cache_rows = pl.ds(first_row + first, bk)
        k = plgpu.load(k_ref.at[layer, cache_rows, kv_cols], mask=kv_mask, other=0)
        v = plgpu.load(v_ref.at[layer, cache_rows, kv_cols], mask=kv_mask, other=0)
        if lay.scores:
            # hidden keys were loaded as 0, so their partial score is 0
            part = jnp.sum(k.astype(jnp.float32) * q_sum[None, :], axis=1)
            score_row = kv_head * lay.q_tiles + q_tile
            plgpu.store(score_ref.at[g_idx, score_row, pl.ds(first, bk)], part, mask=in_range)
        if not lay.key_start:
            logits = jnp.where(visible[None, :], dot_t(q, k) * scale, MASKED_LOGIT)
            return _softmax_step(carry, logits, v)
        # [BQ, BK]: a key before a row's first key is hidden from that row only
        seen = visible[None, :] & (keys[None, :] >= row_start[:, None])
        logits = jnp.where(seen, dot_t(q, k) * scale, MASKED_LOGIT)
        return _softmax_step(carry, logits, v, seen)

    carry = lax.fori_loop(first_step, n_steps, key_step, initial_state((bq,), dh))

    if lay.extra_width:
        k_extra_ref, v_extra_ref, extra_mask_ref = extra_refs

        def extra_step(t, carry):
            extra_rows = pl.ds(t * bk, bk)
            k = k_extra_ref[g_idx, extra_rows, kv_cols]
            v = v_extra_ref[g_idx, extra_rows, kv_cols]
            # [BQ, BK]
            seen = extra_mask_ref[g_idx, rows[:, None], t * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]]
            logits = jnp.where(seen, dot_t(q, k) * scale, MASKED_LOGIT)
            return _softmax_step(carry, logits, v, seen)

        def with_extra(carry):
            return lax.fori_loop(0, lay.extra_width // bk, extra_step, carry)

        carry = lax.cond(split == 0, with_extra, lambda c: c, carry)

    m, l, acc = carry
    has_keys = l > 0
    l_safe = jnp.where(has_keys, l, 1.0)
    out = acc / l_safe[:, None]
    if lay.split_output:
        part_ref, lse_ref = out_refs

        @pl.when(split < splits)
        def _write_partial():
            plgpu.store(part_ref.at[split, g_idx, rows[:, None], cols], out.astype(part_ref.dtype))
            lse = jnp.where(has_keys, m + jnp.log(l_safe), MASKED_LOGIT)
            plgpu.store(lse_ref.at[split, g_idx, rows, heads], lse)

    else:
        (out_ref,) = out_refs
        plgpu.store(out_ref.at[g_idx, rows[:, None], cols], out.astype(out_ref.dtype))
