"""DiffusionGemma's attention over the flat encoder cache plus the pass's own rows.

Every row of a pass belongs to one slot (group s is slot s) and sees two sets of keys:
  cached  positions [key_start[s, r], key_end[s]) of its slot in the cache: the encoder's K/V
          of everything before the group's rows (key_start: 0 in full layers; in sliding
          layers the window's first position, per row);
  own     the group's rows themselves (their fresh K/V, never read back from the cache), as
          ``own_mask[s, r, c]`` allows: causal for an encoder chunk, all of them for a canvas.
Softmax over both, with DiffusionGemma's logit scale (1: q and k are normed per head). Like
dllm_jax.runtime.chunked_attention, the cached keys are read in chunks of block_k positions
gathered straight from the cache with an online softmax (pallas_kernels.attention.online_softmax),
so no [S, H, R, keys] score tensor and no per-slot copy of the keys is made; only the chunks
between the smallest key_start and the largest key_end are read.

Example (one canvas row, sliding window W = 4, the canvas at positions [10, 16)): key_start
10 - (W - 1) = 7, key_end 10: cached keys 7, 8, 9, then the 6 canvas rows.

With ``score_rows``, it also returns each cached key's tracking score, Flash-Cache's: the sum
over the score rows and query heads of the raw logits q . k (linear in q: the rows' queries are
summed first, one vector-matrix product per slot and chunk).

Two implementations of one signature (CANVAS_ATTENTIONS; the kernel routing picks one,
kernel_routing.canvas_attention): ``canvas_cache_attention`` in XLA (CPUs, TPUs, and the
reference the kernel is checked against), and ``canvas_cache_attention_pallas``, the Triton
cache-attention kernel (pallas_kernels.attention.cache_attention) with each row's first key as
its ``key_start``, the group's own rows as its in-query ``extra`` keys under own_mask, and the
logit scale. XLA's version runs as many separate fusions per layer (transposes, converts, the
chunk loop's reductions); the kernel reads each slot's keys once per kv head and query tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dllm_jax.runtime.chunked_attention import default_block_k, softmax_update
from pallas_kernels.attention.cache_attention import AttentionBlockSizes, cache_attention
from pallas_kernels.attention.online_softmax import initial_state
from pallas_kernels.attention.reference import MASKED_LOGIT

# what may run the canvas attention: XLA, the Triton kernel, the kernel in interpret mode
CANVAS_ATTENTIONS = ("xla", "pallas", "interpret")


def canvas_cache_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: int,
    key_start: jax.Array,
    key_end: jax.Array,
    own_k: jax.Array,
    own_v: jax.Array,
    own_mask: jax.Array,
    *,
    max_len: int,
    scale: float = 1.0,
    block_k: int | None = None,
    score_rows: jax.Array | None = None,
    group_slot: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Softmax attention of each group's rows over its slot's cached keys and its own rows.

    Args:
      q: [S, R, H, Dh] RoPE'd queries of S groups (group s: slot group_slot[s], else slot s).
      k_cache, v_cache: [N, S * max_len, KVH * Dh] (read only); layer: the stack index (static).
      key_start: int32 [S, R], key_end: int32 [S]: the cached positions each row sees.
      own_k, own_v: [S, R, KVH, Dh] the group's own keys and values; own_mask: bool [S, R, R].
      max_len: cache rows per slot; scale: the logits' factor; block_k: cached keys per chunk
        (None: dllm_jax.runtime.chunked_attention.default_block_k).
      score_rows: bool [S, R], the rows whose logits feed the tracking scores (None: no scores).
      group_slot: int32 [S], each group's slot (None: group s is slot s).
    Returns:
      [S, R, H * Dh] in q.dtype (a row that sees no key gets zeros), and with score_rows the
      scores float32 [S, max_len] of the cached keys (0 for keys no row sees).
    """
    S, R, H, Dh = q.shape
    kv_heads = own_k.shape[2]
    group = H // kv_heads
    block_k = block_k or default_block_k(S, R, H, max_len)
    cache_rows = k_cache.shape[1]
    slots = jnp.arange(S, dtype=jnp.int32) if group_slot is None else group_slot.astype(jnp.int32)
    key_end = jnp.clip(key_end.astype(jnp.int32), 0, max_len)
    key_start = jnp.clip(key_start.astype(jnp.int32), 0, max_len)
    # [S, KVH, G, R, Dh]: query heads next to the kv head they read
    q5 = q.reshape(S, R, kv_heads, group, Dh).transpose(0, 2, 3, 1, 4)

    def chunk(first, cache):
        """Keys [first, first + block_k) of every slot: [S, K, KVH, Dh], and which row sees which [S, R, K]."""
        j = first + jnp.arange(block_k, dtype=jnp.int32)
        visible = (j[None, None, :] >= key_start[:, :, None]) & (j[None, None, :] < key_end[:, None, None])
        rows = jnp.minimum(slots[:, None] * max_len + j[None, :], cache_rows - 1)
        block = cache[layer, rows].reshape(S, block_k, kv_heads, Dh)
        # a key no row sees may hold anything (rows past a slot's end, NaN of an earlier request)
        seen = jnp.any(visible, axis=1)
        return jnp.where(seen[:, :, None, None], block, 0), visible

    with_scores = score_rows is not None
    if with_scores:
        # [S, KVH, Dh]: the score rows' queries summed over rows and the heads of each kv head
        q_sum = jnp.einsum("skgrd,sr->skd", q5.astype(jnp.float32), score_rows.astype(jnp.float32))

    def step(t, carry):
        state, scores = carry
        k, visible = chunk(t * block_k, k_cache)
        v, _ = chunk(t * block_k, v_cache)
        logits = jnp.einsum("skgrd,sjkd->skgrj", q5, k, preferred_element_type=jnp.float32) * scale
        state = softmax_update(state, jnp.where(visible[:, None, None], logits, MASKED_LOGIT), v)
        if with_scores:
            part = jnp.einsum("skd,sjkd->sj", q_sum, k.astype(jnp.float32))
            scores = lax.dynamic_update_slice_in_dim(
                scores, jnp.where(jnp.any(visible, axis=1), part, 0.0), t * block_k, 1
            )
        return state, scores

    state = initial_state((S, kv_heads, group, R), Dh)
    n_chunks = -(-max_len // block_k)
    scores = jnp.zeros((S, n_chunks * block_k if with_scores else 0), jnp.float32)
    # only the chunks some row of some slot sees
    lowest = jnp.min(jnp.where(key_start < key_end[:, None], key_start, max_len))
    state, scores = lax.fori_loop(lowest // block_k, (jnp.max(key_end) + block_k - 1) // block_k, step, (state, scores))
    logits = jnp.einsum("skgrd,sjkd->skgrj", q5, own_k, preferred_element_type=jnp.float32) * scale
    _, l, acc = softmax_update(state, jnp.where(own_mask[:, None, None], logits, MASKED_LOGIT), own_v)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(S, R, H * Dh).astype(q.dtype)
    return (out, scores[:, :max_len]) if with_scores else out


def canvas_cache_attention_pallas(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: int,
    key_start: jax.Array,
    key_end: jax.Array,
    own_k: jax.Array,
    own_v: jax.Array,
    own_mask: jax.Array,
    *,
    max_len: int,
    scale: float = 1.0,
    score_rows: jax.Array | None = None,
    group_slot: jax.Array | None = None,
    interpret: bool = False,
    block_sizes: AttentionBlockSizes | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``canvas_cache_attention`` as the Triton cache-attention kernel (same arguments and
    results, without XLA's block_k; q, the caches and own_k/own_v in one dtype).

    Args:
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      block_sizes: the kernel's tiling (None: default_attention_block_sizes for these shapes).
    Returns:
      [S, R, H * Dh] in q.dtype (a row that sees no key gets zeros), and with score_rows the
      scores float32 [S, max_len] (0 for keys no row sees).
    """
    S, R, H, Dh = q.shape
    kv_heads = own_k.shape[2]
    slots = jnp.arange(S, dtype=jnp.int32) if group_slot is None else group_slot.astype(jnp.int32)
    # [S, R, KVH * Dh]: the own rows as in-query keys, in the cache's column layout
    extra = (own_k.reshape(S, R, kv_heads * Dh), own_v.reshape(S, R, kv_heads * Dh), own_mask)
    out, scores = cache_attention(
        q.reshape(S, R, H * Dh),
        k_cache,
        v_cache,
        jnp.int32(layer),
        slots,
        key_end,
        score_rows,
        n_heads=H,
        n_kv_heads=kv_heads,
        max_len=max_len,
        extra=extra,
        key_start=key_start,
        scale=float(scale),
        interpret=interpret,
        block_sizes=block_sizes,
    )
    return (out, scores) if score_rows is not None else out


# The widest heads the kernel takes (scripts/gpu/canvas_attention.py, BENCHMARKS.md): a 26B-A4B
# sliding layer (Dh 256) ran 2.7-3.2x faster than XLA's chunked softmax at 8 and 32 slots (H200,
# 2026-12-03), a full layer (Dh 512) 1.83-1.96x on its default 32 x 32 tiling (H100, 2026-12-07).
# Wider heads (no model of ours has them; never timed) stay on XLA.
KERNEL_MAX_HEAD_DIM = 512


def canvas_attention_fn(implementation: str, head_dim: int | None = None):
    """The canvas attention an implementation name (CANVAS_ATTENTIONS) stands for, called as
    ``canvas_cache_attention``; XLA's for heads wider than KERNEL_MAX_HEAD_DIM."""
    if implementation not in CANVAS_ATTENTIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {CANVAS_ATTENTIONS}")
    if implementation == "xla" or (head_dim or 0) > KERNEL_MAX_HEAD_DIM:
        return canvas_cache_attention
    return functools.partial(canvas_cache_attention_pallas, interpret=implementation == "interpret")
