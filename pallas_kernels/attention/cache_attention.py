"""Attention of groups of query rows over their slot's flat K/V cache, with the tracking score.

The kernel body is in _cache_attention_kernel.py; this module holds the block sizes, the
wrapper (validation, split combine, score reduction) and the plain-jnp reference.

Layout: group s (S groups of R query rows) reads cache rows ``group_slot[s] * max_len + j`` for
``j < key_len[s]`` of layer ``layer`` of the full [NL, M, KVH*Dh] caches (M = slots * max_len + 1;
the last row is the trash row). The verify pass adds ``key_exclude`` (cached keys to skip) and
``extra`` keys that live only in the query (with their own row-by-key mask). DiffusionGemma's
canvas attention (dllm_jax.runtime.canvas_attention) adds ``key_start``, each row's first
visible key (the start of a sliding window), its own rows as ``extra`` keys (a causal mask for
an encoder chunk, all of them for a canvas) and its logit ``scale`` (1: q and k are normed).

Performance at LLaDA-8B layer shapes (H=KVH=32, Dh=128, R=128 rows per slot, bf16; H200 at
~4.3 TB/s and ~800 TFLOP/s bf16, 132 SMs):
* Bytes: each program reads its group's K and V columns of one kv head once, so a slot's K/V
  is read once per call: 2 * Kd * 4096 * 2 B = 32 MiB at Kd=2048 (8 MiB at 512), plus q and the
  output (1 MiB each per slot). FLOPs: 4 * R * Kd * 4096 = 4.3 GFLOP per slot at 2048, an
  intensity of ~128 FLOP/B: close to the H200 ridge, so MMA efficiency matters as much as
  bandwidth; a 128-row tile per kv head is the largest the register file allows (a [128, 128]
  float32 accumulator on 8 warps).
* 32 slots: S * KVH = 1024 programs, ~4 waves at two programs per SM; no key split. The memory
  floor is ~1.07 GB / 4.3 TB/s = 250 us at Kd=2048 (62 us at 512).
* 1 slot: 32 programs would leave three quarters of the SMs idle, so the keys are split
  (flash decoding). The grid has ``num_splits`` programs per (group, kv head), but each group
  cuts its own key_len at run time into at most that many chunks of at least 2 * block_k keys:
  at NS=8, 2048 keys give 8 x 256 (256 programs) and 512 keys 4 x 128, the other programs
  exit at once. Each working split writes a normalised partial in q.dtype and a float32
  log-sum-exp, which XLA combines: 2 * splits * R * H*Dh * 2 B written and read (16 MiB at 8
  splits, half the K/V bytes at Kd=2048), so splitting only pays while the grid is small.
  8 slots (256 programs) need no split.
* Tracking score: per key tile one [BK, Dh] float32 multiply-add with the summed score
  queries (1/BQ of the QK^T work) and a [S, KVH, max_len] float32 partial (8 MiB at 32 slots)
  reduced by XLA; the published kernel's [rows, heads, keys] logits buffer is never written.
* Wider heads (DiffusionGemma: Dh 256 in sliding layers, 512 in full ones) take smaller
  tiles (default_attention_block_sizes): the accumulator [BQ, Dh] float32 and the q tile stay
  at the 128 x 128 budget (BQ 64 at Dh 256, 32 at 512), and the K and V tiles at [32, Dh] so
  that q + K/V x stages fit the 228 KiB of shared memory (at Dh 512: 32 + 2 x 2 x 32 KiB).
  The extra keys go through the same [block_k, Dh] tiles as the cached ones (256 own rows of
  a canvas would be 256 KiB of K and V at Dh 256 in one tile).
The bench script sweeps block_k, splits, warps and stages per case
(scripts/gpu/canvas_attention.py for DiffusionGemma's shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.cache_attention_kernel import KernelLayout, active_splits, attention_kernel
from pallas_kernels.attention.reference import dense_attention
from pallas_kernels.common import (
    NUM_SMS,
    as_bool,
    as_int32,
    cdiv,
    check_float,
    check_launch,
    check_power_of_two,
    check_shape,
    compiler_params,
    next_power_of_two,
)

Extra = tuple[jax.Array, jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes:
    """Tiling of ``cache_attention``.

    Attributes:
      block_q: most query rows per program (rows are flattened r * G + g); power of two >= 16.
        A call uses min(block_q, next power of two >= R * G), at least 16.
      block_k: keys per step; power of two >= 16.
      num_splits: most key splits per group (flash decoding); a group with key_len keys uses
        min(num_splits, ceil(key_len / (2 * block_k))) of them, cut from its own key range at
        run time. 1 = no combine step.
      num_warps, num_stages: Triton launch parameters.
    """

    block_q: int = 128
    block_k: int = 64
    num_splits: int = 1
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        check_power_of_two("block_q", self.block_q, 16)
        check_power_of_two("block_k", self.block_k, 16)
        if not isinstance(self.num_splits, int) or self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits!r}: expected an int >= 1")
        check_launch(self.num_warps, self.num_stages)


def default_attention_block_sizes(
    num_groups: int, rows: int, n_heads: int, n_kv_heads: int, max_len: int, head_dim: int = 128
) -> AttentionBlockSizes:
    """At Dh <= 128: 128-row tiles and 64-key steps; the most splits doubles while the grid has
    fewer programs than SMs and a full slot (max_len keys) still gives every split 128 keys.
    Three pipeline stages: the H200 sweep (BENCHMARKS.md) preferred them for 128-row tiles
    at 1, 8 and 32 slots (e.g. 32 slots x 2048 keys: 514 us against 678 us with two).
    Four warps where the row tiles alone fill the GPU (no split), eight where they are split
    (one slot's step): on the H100 (BENCHMARKS.md, 2026-12-07) four warps ran the LLaDA-8B
    decode step 2.7% faster at 8 slots and 0.9% at 32, and 2.1% slower at 1 slot (split keys).
    Wider heads keep BQ * Dh at 128 * 128 (the accumulator's registers) and take 32-key steps
    over two stages on 4 warps: the H200 sweep at Dh 256 (DiffusionGemma's sliding layers,
    BENCHMARKS.md, 2026-12-03) ran 64x32 on 4 warps 2.0-2.2x faster than on 8 (e.g. 32 slots
    x 1024 keys: 0.839 against 1.833 ms), and the H100 sweep at Dh 512 (the full layers,
    2026-12-07) ran 32x32 on 4 warps fastest: 1.005 ms at 32 slots x 256 keys against 1.27-2.57
    for 16- and 64-row tiles and value columns split over programs (tried, removed)."""
    group_rows = rows * (n_heads // n_kv_heads)
    most_rows = max(16, min(128, 128 * 128 // head_dim))
    block_q = min(most_rows, max(16, next_power_of_two(group_rows)))
    programs = num_groups * n_kv_heads * cdiv(group_rows, block_q)
    splits = 1
    while programs * splits < NUM_SMS and max_len // (2 * splits) >= 128:
        splits *= 2
    wide = head_dim > 128
    return AttentionBlockSizes(
        block_q,
        32 if wide else 64,
        splits,
        num_warps=8 if block_q * head_dim >= 64 * 128 and splits > 1 and not wide else 4,
        num_stages=3 if block_q >= 64 and not wide else 2,
    )


@dataclasses.dataclass(frozen=True)
class _Args:
    """Validated, normalised arguments shared by the kernel wrapper and the reference."""

    layer: jax.Array  # int32 []
    group_slot: jax.Array  # int32 [S], out-of-range slots replaced by 0
    key_len: jax.Array  # int32 [S], clipped to [0, max_len]; 0 for out-of-range slots
    key_start: jax.Array | None  # int32 [S, R] clipped to [0, max_len], or None (every row: 0)
    key_first: jax.Array  # int32 [S]: the first key any row sees, in [0, key_len]
    head_dim: int


def _check_args(
    q,
    k_cache,
    v_cache,
    layer,
    group_slot,
    key_len,
    score_rows,
    n_heads,
    n_kv_heads,
    max_len,
    key_exclude,
    extra,
    key_start=None,
    scale=None,
) -> _Args:
    check_float("q", q)
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape}: expected [S, R, H*Dh]")
    n_groups, n_rows, width = q.shape
    if not isinstance(n_heads, int) or not isinstance(n_kv_heads, int) or n_heads <= 0 or n_kv_heads <= 0:
        raise ValueError(f"n_heads={n_heads!r}, n_kv_heads={n_kv_heads!r}: expected positive ints")
    if n_heads % n_kv_heads or width % n_heads:
        raise ValueError(
            f"q.shape={q.shape}, n_heads={n_heads}, n_kv_heads={n_kv_heads}: expected "
            "H*Dh columns with H a multiple of KVH"
        )
    head_dim = width // n_heads
    kv_width = n_kv_heads * head_dim
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.ndim != 3 or cache.shape[2] != kv_width:
            raise ValueError(f"{name}.shape={cache.shape}: expected [NL, M, {kv_width}]")
        if cache.dtype != q.dtype:
            raise ValueError(f"{name}.dtype={cache.dtype}: expected q.dtype={q.dtype}")
    check_shape("v_cache", v_cache, k_cache.shape)
    if not isinstance(max_len, int) or not 0 < max_len <= k_cache.shape[1]:
        raise ValueError(f"max_len={max_len!r}: expected an int in [1, M={k_cache.shape[1]}]")
    if score_rows is not None:
        as_bool("score_rows", score_rows, (n_groups, n_rows))
    if key_exclude is not None:
        as_bool("key_exclude", key_exclude, (n_groups, max_len))
    if extra is not None:
        if len(extra) != 3:
            raise ValueError("extra: expected (k_extra, v_extra, extra_mask)")
        k_extra, v_extra, extra_mask = extra
        if k_extra.ndim != 3 or k_extra.shape[0] != n_groups or k_extra.shape[2] != kv_width:
            raise ValueError(f"k_extra.shape={k_extra.shape}: expected [{n_groups}, R2, {kv_width}]")
        check_shape("v_extra", v_extra, k_extra.shape)
        for name, arr in (("k_extra", k_extra), ("v_extra", v_extra)):
            if arr.dtype != q.dtype:
                raise ValueError(f"{name}.dtype={arr.dtype}: expected q.dtype={q.dtype}")
        as_bool("extra_mask", extra_mask, (n_groups, n_rows, k_extra.shape[1]))
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale={scale!r}: expected a Python float (static) or None")
    group_slot = as_int32("group_slot", group_slot, (n_groups,))
    key_len = as_int32("key_len", key_len, (n_groups,))
    # Memory safety: a slot outside the cache reads nothing instead of another buffer.
    slot_ok = (group_slot >= 0) & (group_slot < k_cache.shape[1] // max_len)
    key_len = jnp.where(slot_ok, jnp.clip(key_len, 0, max_len), 0)
    key_first = jnp.zeros((n_groups,), jnp.int32)
    if key_start is not None:
        key_start = jnp.clip(as_int32("key_start", key_start, (n_groups, n_rows)), 0, max_len)
        # the rows' ranges [key_start, key_len) share their end: their union starts at the min
        key_first = jnp.minimum(jnp.min(key_start, axis=1), key_len)
    return _Args(
        layer=as_int32("layer", layer, ()),
        group_slot=jnp.where(slot_ok, group_slot, 0),
        key_len=key_len,
        key_start=key_start,
        key_first=key_first,
        head_dim=head_dim,
    )


def _logit_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / head_dim**0.5 if scale is None else float(scale)


def _pad_extra(extra: Extra, width: int) -> Extra:
    """Pads the extra keys to `width` columns (hidden by the mask)."""
    k_extra, v_extra, extra_mask = extra
    pad = width - k_extra.shape[1]
    if not pad:
        return extra
    return (
        jnp.pad(k_extra, ((0, 0), (0, pad), (0, 0))),
        jnp.pad(v_extra, ((0, 0), (0, pad), (0, 0))),
        jnp.pad(extra_mask, ((0, 0), (0, 0), (0, pad))),
    )


def _combine_splits(part: jax.Array, lse: jax.Array, active: jax.Array, dtype) -> jax.Array:
    """Merges per-split normalised outputs [NS, S, R, H*Dh] with their log-sum-exp [NS, S, R, H];
    active bool [NS, S] marks the splits that wrote (the others hold garbage, never read)."""
    n_splits, n_groups, n_rows, n_heads = lse.shape
    lse = jnp.where(active[:, :, None, None], lse, -jnp.inf)
    # split 0 is always active, so the max is finite and inactive weights are exactly 0
    weight = jnp.exp(lse - jnp.max(lse, axis=0))
    # [NS, S, R, H, Dh]
    part = jnp.where(active[:, :, None, None, None], part.reshape(n_splits, n_groups, n_rows, n_heads, -1), 0)
    part = part.astype(jnp.float32)
    out = jnp.sum(weight[..., None] * part, axis=0) / jnp.sum(weight, axis=0)[..., None]
    return out.reshape(n_groups, n_rows, -1).astype(dtype)


_STATIC = ("n_heads", "n_kv_heads", "max_len", "interpret", "block_sizes")
# the Triton kernel and the reference also take the logit scale (the TPU kernel does not)
_STATIC_SCALED = _STATIC + ("scale",)


@functools.partial(jax.jit, static_argnames=_STATIC_SCALED)
def cache_attention(
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
    key_start: jax.Array | None = None,
    scale: float | None = None,
    interpret: bool = False,
    block_sizes: AttentionBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of each group's query rows over its slot's cached keys.

    Args:
      q: [S, R, H*Dh] RoPE'd queries; the R rows of group s belong to slot group_slot[s].
      k_cache, v_cache: [NL, M, KVH*Dh] in q.dtype (read only).
      layer: int32 scalar.
      group_slot: int32 [S]; keys of group s are cache rows group_slot[s] * max_len + j. A slot
        outside [0, M // max_len) reads no keys.
      key_len: int32 [S]; keys j < key_len[s] are visible (clipped to [0, max_len]).
      score_rows: bool [S, R], rows whose raw logits feed the tracking score; None = no score
        rows (the kernel skips the score work and the scores are zero).
      n_heads, n_kv_heads: H, KVH; query head h reads kv head h // (H // KVH).
      max_len: cache rows per slot.
      key_exclude: optional bool [S, max_len]; True hides that cached key (and zeroes its score).
      extra: optional (k_extra [S, R2, KVH*Dh], v_extra [S, R2, KVH*Dh], extra_mask bool
        [S, R, R2]): in-query keys, row r of group s sees extra key c iff extra_mask[s, r, c].
      key_start: optional int32 [S, R]: row r of group s sees only the cached keys j >=
        key_start[s, r] (clipped to [0, max_len]; None: from 0). The tracking score covers the
        keys some row of the group sees: [min_r key_start[s, r], key_len[s]).
      scale: the logits' factor, a static Python float; None: 1 / sqrt(Dh).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      block_sizes: tiling; default ``default_attention_block_sizes``.
    Returns:
      out [S, R, H*Dh] in q.dtype (a row that sees no key gets zeros) and scores float32
      [S, max_len]: scores[s, j] = sum over score rows r and heads h of
      q[s, r, h] . k[slot * max_len + j, h // G] (raw, unscaled) for keys some row of the
      group sees, else 0.
    """
    args = _check_args(
        q,
        k_cache,
        v_cache,
        layer,
        group_slot,
        key_len,
        score_rows,
        n_heads,
        n_kv_heads,
        max_len,
        key_exclude,
        extra,
        key_start,
        scale,
    )
    n_groups, n_rows, _ = q.shape
    group = n_heads // n_kv_heads
    blocks = block_sizes or default_attention_block_sizes(n_groups, n_rows, n_heads, n_kv_heads, max_len, args.head_dim)
    block_q = min(blocks.block_q, max(16, next_power_of_two(n_rows * group)))
    # Pad R so that the flattened rows r * G + g fill whole tiles: every row a program touches
    # is real, and no store needs a row mask.
    row_multiple = block_q // math.gcd(block_q, group)
    padded_rows = cdiv(n_rows, row_multiple) * row_multiple
    pad = padded_rows - n_rows
    key_start = args.key_start
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0)))
        if score_rows is not None:
            score_rows = jnp.pad(score_rows, ((0, 0), (0, pad)))
        if extra is not None:
            extra = (extra[0], extra[1], jnp.pad(extra[2], ((0, 0), (0, pad), (0, 0))))
        if key_start is not None:
            # padded rows see no cached key (and, above, no extra key)
            key_start = jnp.pad(key_start, ((0, 0), (0, pad)), constant_values=max_len)
    q_tiles = padded_rows * group // block_q
    n_splits = min(blocks.num_splits, cdiv(max_len, 2 * blocks.block_k))
    # whole key steps of extra keys (hidden by the mask past R2)
    extra_width = 0 if extra is None else cdiv(extra[0].shape[1], blocks.block_k) * blocks.block_k
    lay = KernelLayout(
        group=group,
        head_dim=args.head_dim,
        block_q=block_q,
        block_k=blocks.block_k,
        q_tiles=q_tiles,
        n_splits=n_splits,
        max_len=max_len,
        split_output=n_splits > 1,
        scores=score_rows is not None,
        exclude=key_exclude is not None,
        extra_width=extra_width,
        key_start=key_start is not None,
        scale=_logit_scale(scale, args.head_dim),
    )

    inputs = [args.layer.reshape(1), args.group_slot, args.key_first, args.key_len, q, k_cache, v_cache]
    if lay.key_start:
        inputs.append(key_start)
    if lay.scores:
        inputs.append(score_rows.astype(jnp.float32))
    if lay.exclude:
        inputs.append(key_exclude)
    if extra is not None:
        inputs.extend(_pad_extra(extra, extra_width))
    if lay.split_output:
        out_shape = [
            jax.ShapeDtypeStruct((n_splits, *q.shape), q.dtype),
            jax.ShapeDtypeStruct((n_splits, n_groups, padded_rows, n_heads), jnp.float32),
        ]
    else:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if lay.scores:
        out_shape.append(jax.ShapeDtypeStruct((n_groups, n_kv_heads * q_tiles, max_len), jnp.float32))

    results = pl.pallas_call(
        functools.partial(attention_kernel, lay=lay),
        grid=(q_tiles, n_kv_heads, n_splits, n_groups),
        out_shape=out_shape,
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="cache_attention",
    )(*inputs)

    if lay.split_output:
        active = active_splits(args.key_len - args.key_first, n_splits, blocks.block_k)
        out = _combine_splits(results[0], results[1], jnp.arange(n_splits)[:, None] < active[None, :], q.dtype)
    else:
        out = results[0]
    out = out[:, :n_rows]
    if not lay.scores:
        return out, jnp.zeros((n_groups, max_len), jnp.float32)
    # Score partials outside a group's [key_first, key_len) were never written: select, never add, them.
    positions = jnp.arange(max_len)[None, :]
    valid = (positions >= args.key_first[:, None]) & (positions < args.key_len[:, None])
    return out, jnp.where(valid, jnp.sum(results[-1], axis=1), 0.0)


@functools.partial(jax.jit, static_argnames=_STATIC_SCALED)
def cache_attention_reference(
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
    key_start: jax.Array | None = None,
    scale: float | None = None,
    interpret: bool = False,
    block_sizes: AttentionBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp ``cache_attention``: gather each group's keys, the model's dense attention,
    and the score from materialised raw logits. ``interpret`` and ``block_sizes`` are accepted
    for signature parity and ignored."""
    del interpret, block_sizes
    args = _check_args(
        q,
        k_cache,
        v_cache,
        layer,
        group_slot,
        key_len,
        score_rows,
        n_heads,
        n_kv_heads,
        max_len,
        key_exclude,
        extra,
        key_start,
        scale,
    )
    n_groups, n_rows, _ = q.shape
    head_dim = args.head_dim
    positions = jnp.arange(max_len)
    # [S, R, max_len]: which cached keys each row sees; [S, max_len]: which some row sees
    row_visible = positions[None, None, :] < args.key_len[:, None, None]
    if args.key_start is not None:
        row_visible &= positions[None, None, :] >= args.key_start[:, :, None]
    if key_exclude is not None:
        row_visible &= ~key_exclude[:, None, :]
    visible = jnp.any(row_visible, axis=1)
    # [S, max_len, KVH, Dh]; hidden keys zeroed so whatever the cache holds there cannot leak
    rows = args.group_slot[:, None] * max_len + positions[None, :]
    k = jnp.where(visible[..., None], k_cache[args.layer, rows], 0).reshape(n_groups, max_len, n_kv_heads, head_dim)
    v = jnp.where(visible[..., None], v_cache[args.layer, rows], 0).reshape(n_groups, max_len, n_kv_heads, head_dim)
    # [S, R, KVH, G, Dh]
    q5 = q.reshape(n_groups, n_rows, n_kv_heads, n_heads // n_kv_heads, head_dim)

    scores = jnp.zeros((n_groups, max_len), jnp.float32)
    if score_rows is not None:
        # [S, R, KVH, G, max_len] raw logits
        raw = jnp.einsum("srkgd,sjkd->srkgj", q5, k, preferred_element_type=jnp.float32)
        raw = jnp.where(score_rows[:, :, None, None, None], raw, 0.0)
        scores = jnp.where(visible, jnp.sum(raw, axis=(1, 2, 3)), 0.0)

    mask = jnp.broadcast_to(row_visible, (n_groups, n_rows, max_len))
    if extra is not None:
        k_extra, v_extra, extra_mask = extra
        n_extra = k_extra.shape[1]
        k = jnp.concatenate([k, k_extra.reshape(n_groups, n_extra, n_kv_heads, head_dim)], axis=1)
        v = jnp.concatenate([v, v_extra.reshape(n_groups, n_extra, n_kv_heads, head_dim)], axis=1)
        mask = jnp.concatenate([mask, extra_mask], axis=2)
    out = dense_attention(q.reshape(n_groups, n_rows, n_heads, head_dim), k, v, mask, _logit_scale(scale, head_dim))
    # a row that sees no key: zeros (dense_attention would average over every hidden key)
    return jnp.where(jnp.any(mask, axis=2)[..., None], out, 0), scores
