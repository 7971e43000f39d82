"""The Pallas Triton body of ``cache_attention`` (the wrapper and reference are in cache_attention.py).

One program = one (query tile, kv head, key split, group). It loads its query rows once
(the G query heads of the kv head, flattened to rows f = r * G + g), then streams its share of
the group's cache keys (the split is cut from the group's key_len at run time) in ``block_k`` tiles with an online softmax (float32 logits, P rounded
to the value dtype before P.V), adds the in-query "extra" keys in split 0, and writes either
the final rows or a normalised partial + log-sum-exp for the split combine. The tracking score
is linear in q: the program sums its score rows' queries into one float32 vector and takes
one dot product per key, on the K tile it already holds.
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
      extra_width: padded number of extra (in-query) keys; 0 = none.
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


def active_splits(key_len: jax.Array, n_splits: int, block_k: int) -> jax.Array:
    """Splits that hold keys for a group of key_len keys: at most n_splits, each with at least
    2 * block_k keys, at least one. Splits at or past this count write nothing."""
    min_keys = 2 * block_k
    return jnp.clip((key_len + min_keys - 1) // min_keys, 1, n_splits)


def _softmax_step(carry, logits, v):
    """Online-softmax update with a [BQ, BK] float32 logit tile and its [BK, Dh] values."""
    m, l, acc = carry
    m, l, alpha, p = online_softmax_weights(m, l, logits)
    return m, l, acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def attention_kernel(*refs, lay: KernelLayout):
    """Refs: layer [1], group_slot [S], key_len [S], q [S, R, H*Dh], k_cache, v_cache
    [NL, M, KVH*Dh], then (if present) score weights f32 [S, R], key_exclude bool [S, max_len],
    k_extra, v_extra [S, R2p, KVH*Dh], extra_mask bool [S, R, R2p]; outputs: out [S, R, H*Dh]
    or (partial out [NS, S, R, H*Dh], lse f32 [NS, S, R, H]), then (if scores) score partials
    f32 [S, KVH * q_tiles, max_len]."""
    refs = list(refs)
    layer_ref, slot_ref, len_ref, q_ref, k_ref, v_ref = refs[:6]
    rest = refs[6:]
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
    scale = 1.0 / dh**0.5

    if lay.scores:
        # [Dh]: sum of the score rows' queries of this tile
        q_sum = jnp.sum(q.astype(jnp.float32) * weight_ref[g_idx, rows][:, None], axis=0)

    kv_cols = pl.ds(kv_head * dh, dh)
    # this group's keys, cut into `splits` chunks of whole steps (run time, from key_len)
    splits = active_splits(key_len, lay.n_splits, bk)
    chunk = ((key_len + splits - 1) // splits + bk - 1) // bk * bk
    start = split * chunk
    stop = jnp.minimum(key_len, start + chunk)
    n_steps = (jnp.maximum(stop - start, 0) + bk - 1) // bk

    def key_step(t, carry):
        first = start + t * bk
        in_range = first + jnp.arange(bk, dtype=jnp.int32) < stop
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
        logits = jnp.where(visible[None, :], dot_t(q, k) * scale, MASKED_LOGIT)
        return _softmax_step(carry, logits, v)

    carry = lax.fori_loop(0, n_steps, key_step, initial_state((bq,), dh))

    if lay.extra_width:
        k_extra_ref, v_extra_ref, extra_mask_ref = extra_refs
        width = lay.extra_width

        def with_extra(carry):
            k = k_extra_ref[g_idx, pl.ds(0, width), kv_cols]
            v = v_extra_ref[g_idx, pl.ds(0, width), kv_cols]
            seen = extra_mask_ref[g_idx, rows[:, None], jnp.arange(width, dtype=jnp.int32)[None, :]]
            logits = jnp.where(seen, dot_t(q, k) * scale, MASKED_LOGIT)
            return _softmax_step(carry, logits, v)

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
