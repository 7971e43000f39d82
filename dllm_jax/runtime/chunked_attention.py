"""Attention over the flat K/V cache in key chunks with an online softmax (the XLA path).

What CPUs, TPUs and ``backend="xla"`` run. Same signature and semantics as
``pallas_kernels.attention.cache_attention.cache_attention_reference`` (and the kernels), but no
[groups, heads, rows, keys] score tensor and no per-slot copy of the keys is ever
materialised: a ``lax.while_loop`` over chunks of ``block_k`` keys gathers each group's
chunk of K and V rows straight from the cache and updates a running max, denominator and float32
accumulator, and adds the chunk's tracking scores (the score rows' summed queries times the
chunk's keys: the one vector-matrix product, cut along the keys). The loop runs only as many
chunks as the longest group's key_len needs. The score and the output of a layer come out of
the same loop, so no part of the attention can be scheduled after the next layer's cache
write (which would keep an old copy of the cache alive).

Peak temporaries per call: the chunk's logits, float32 [S, H, R, block_k] (block_k is chosen
so that they stay under ``LOGIT_BUDGET_BYTES``), the K and V chunks [S, block_k,
KVH*Dh] in the cache dtype, and the float32 accumulator [S, H, R, Dh].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention.online_softmax import initial_state, online_softmax_weights
from pallas_kernels.attention.reference import MASKED_LOGIT

Extra = tuple[jax.Array, jax.Array, jax.Array]

# Most bytes of one chunk's float32 logits under the default key block (LLaDA-8B at 32 slots
# of 128 rows over 640 keys: 2 chunks of 320 keys, 160 MiB; a full pass over 32 slots of 640
# rows: 7 chunks of 96 keys, 240 MiB).
LOGIT_BUDGET_BYTES = 256 << 20
MAX_BLOCK_K = 512
MIN_BLOCK_K = 8


def default_block_k(n_groups: int, n_rows: int, n_heads: int, max_len: int) -> int:
    """Keys per chunk: as few chunks as keep each chunk's float32 logits under the budget (and
    at most MAX_BLOCK_K keys), cut evenly from max_len and rounded up to a multiple of 8
    (640 keys at 32 slots of 128 rows: 2 x 320)."""
    per_key = max(1, n_groups * n_rows * n_heads * 4)
    bound = max(MIN_BLOCK_K, min(MAX_BLOCK_K, LOGIT_BUDGET_BYTES // per_key))
    chunks = -(-max_len // bound)
    per_chunk = -(-max_len // chunks)
    return -(-per_chunk // 8) * 8


def softmax_update(carry, logits, v):
    """Online-softmax step. logits f32 [S, KVH, G, R, K] (hidden keys at MASKED_LOGIT);
    v [S, K, KVH, Dh] (hidden keys zeroed). P is rounded to v's dtype before P.V."""
    m, l, acc = carry
    m, l, alpha, p = online_softmax_weights(m, l, logits)
    pv = jnp.einsum("skgrj,sjkd->skgrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, l, acc * alpha[..., None] + pv


def chunked_cache_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    group_slot: jax.Array,
    key_len: jax.Array,
    score_rows: jax.Array | None,
    *,
    n_heads: int,
    n_kv_heads: int,
    max_len: int,
    key_exclude: jax.Array | None = None,
    extra: Extra | None = None,
    interpret: bool = False,
    block_sizes: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of each group's query rows over its slot's cached keys.

    Args:
      q: [S, R, H*Dh] RoPE'd queries; the R rows of group s belong to slot group_slot[s].
      k_cache, v_cache: [NL, M, KVH*Dh] (read only).
      layer: int32 scalar.
      group_slot: int32 [S]; keys of group s are cache rows group_slot[s] * max_len + j. A slot
        outside [0, M // max_len) reads no keys.
      key_len: int32 [S]; keys j < key_len[s] are visible (clipped to [0, max_len]).
      score_rows: bool [S, R] rows whose raw logits feed the tracking score, or None.
      n_heads, n_kv_heads: H, KVH; query head h reads kv head h // (H // KVH).
      max_len: cache rows per slot.
      key_exclude: optional bool [S, max_len]; True hides that cached key (and zeroes its score).
      extra: optional (k_extra [S, R2, KVH*Dh], v_extra [S, R2, KVH*Dh], extra_mask bool
        [S, R, R2]): in-query keys, row r of group s sees extra key c iff extra_mask[s, r, c].
      interpret: accepted for signature parity with the kernels (ignored).
      block_sizes: keys per chunk (None: ``default_block_k``).
    Returns:
      out [S, R, H*Dh] in q.dtype (scale 1/sqrt(Dh); a row that sees no key gets a finite
      value) and scores float32 [S, max_len]: the sum over score rows and query heads of the
      raw q . k of each visible key, 0 for hidden keys.
    """
    del interpret
    n_groups, n_rows, width = q.shape
    head_dim = width // n_heads
    group = n_heads // n_kv_heads
    block_k = block_sizes or default_block_k(n_groups, n_rows, n_heads, max_len)
    n_chunks = -(-max_len // block_k)
    cache_rows = k_cache.shape[1]
    layer = jnp.asarray(layer, jnp.int32)
    group_slot = jnp.asarray(group_slot, jnp.int32)
    # a slot outside the cache reads nothing (as the kernels)
    slot_ok = (group_slot >= 0) & (group_slot < cache_rows // max_len)
    key_len = jnp.where(slot_ok, jnp.clip(jnp.asarray(key_len, jnp.int32), 0, max_len), 0)
    first_row = jnp.where(slot_ok, group_slot, 0) * max_len
    if key_exclude is not None:
        # padded to whole chunks; the padding is past max_len, hence past every key_len
        key_exclude = jnp.pad(key_exclude, ((0, 0), (0, n_chunks * block_k - max_len)))

    # [S, KVH, G, R, Dh]: query heads next to the kv head they read
    q5 = q.reshape(n_groups, n_rows, n_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    scale = 1.0 / head_dim**0.5
    with_scores = score_rows is not None
    if with_scores:
        # [S, KVH, Dh]: the score is linear in q, so the score rows and query heads add up first
        q_sum = jnp.einsum("skgrd,sr->skd", q5.astype(jnp.float32), score_rows.astype(jnp.float32))

    def chunk_keys(cache, first):
        """Each group's keys [first, first + block_k) of `layer`: [S, K, KVH, Dh] and visibility [S, K]."""
        j = first + jnp.arange(block_k, dtype=jnp.int32)
        visible = j[None, :] < key_len[:, None]
        if key_exclude is not None:
            visible &= ~lax.dynamic_slice_in_dim(key_exclude, first, block_k, axis=1)
        rows = jnp.minimum(first_row[:, None] + j[None, :], cache_rows - 1)
        block = cache[layer, rows].reshape(n_groups, block_k, n_kv_heads, head_dim)
        # hidden rows may hold anything (NaN included): zero them, never multiply them
        return jnp.where(visible[:, :, None, None], block, 0), visible

    def step(t, carry):
        softmax, scores = carry
        first = t * block_k
        k, visible = chunk_keys(k_cache, first)
        v, _ = chunk_keys(v_cache, first)
        logits = jnp.einsum("skgrd,sjkd->skgrj", q5, k, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(visible[:, None, None, None, :], logits, MASKED_LOGIT)
        softmax = softmax_update(softmax, logits, v)
        if with_scores:
            part = jnp.einsum("skd,sjkd->sj", q_sum, k.astype(jnp.float32))
            scores = lax.dynamic_update_slice_in_dim(scores, part, first, axis=1)
        return softmax, scores

    softmax = initial_state((n_groups, n_kv_heads, group, n_rows), head_dim)
    scores = jnp.zeros((n_groups, n_chunks * block_k if with_scores else 0), jnp.float32)
    # only the chunks the longest group needs
    steps = (jnp.max(key_len) + block_k - 1) // block_k
    softmax, scores = lax.fori_loop(0, steps, step, (softmax, scores))

    if extra is not None:
        k_extra, v_extra, extra_mask = extra
        n_extra = k_extra.shape[1]
        k = k_extra.reshape(n_groups, n_extra, n_kv_heads, head_dim)
        v = v_extra.reshape(n_groups, n_extra, n_kv_heads, head_dim)
        logits = jnp.einsum("skgrd,sjkd->skgrj", q5, k, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(extra_mask[:, None, None], logits, MASKED_LOGIT)
        softmax = softmax_update(softmax, logits, v)

    _, l, acc = softmax
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(n_groups, n_rows, width).astype(q.dtype)
    if not with_scores:
        return out, jnp.zeros((n_groups, max_len), jnp.float32)
    # chunks past the longest key_len were never written (zeros)
    valid = jnp.arange(max_len)[None, :] < key_len[:, None]
    return out, jnp.where(valid, scores[:, :max_len], 0.0)
