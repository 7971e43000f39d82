"""DiffusionGemma's canvas attention as the Triton cache-attention kernel (interpret mode on the
CPU) against the kernel's jnp reference and XLA's canvas_cache_attention, on fresh random
inputs over a NaN-poisoned cache: sliding layers (a per-row first key), full layers, encoder
chunks (causal own rows) and canvases (all own rows), GQA, Dh 32 and 64 standing in for 256
and 512, scores on and off, rows that see no cached key and rows that see no key at all; plus
the CUDA (Triton) lowering at the 26B-A4B shapes.

The cache has exactly S * max_len rows, as DiffusionGemma's (no trash row), so a key tile that
runs past a slot's end reads the next slot's (NaN) rows or past the array: masked either way.
Interpret mode fills a pallas_call's outputs with NaN before the kernel runs, so a row the
kernel never writes fails the finiteness checks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from tolerances import assert_close

from dllm_jax.models.diffusion_gemma_config import AttentionKind, diffusion_gemma_26b_a4b_config
from dllm_jax.runtime.canvas_attention import canvas_attention_fn, canvas_cache_attention, canvas_cache_attention_pallas
from dllm_jax.runtime.kernel_routing import Kernels, canvas_attention
from pallas_kernels.attention.cache_attention import (
    AttentionBlockSizes,
    cache_attention_reference,
    default_attention_block_sizes,
)

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

LAYER = 1
WINDOW = 10  # the sliding layers' W
MAX_LEN = 48
N_SLOTS = 5


@dataclasses.dataclass
class CanvasCase:
    """One call's arguments (the caches' layer LAYER of 2) and what each row may see."""

    q: jax.Array  # [S, R, H, Dh]
    k_cache: jax.Array  # [2, N_SLOTS * MAX_LEN, KVH * Dh]
    v_cache: jax.Array
    key_start: jax.Array  # int32 [S, R]
    key_end: jax.Array  # int32 [S]
    own_k: jax.Array  # [S, R, KVH, Dh]
    own_v: jax.Array
    own_mask: jax.Array  # bool [S, R, R]
    score_rows: jax.Array | None  # bool [S, R]
    group_slot: jax.Array  # int32 [S]
    row_sees_a_key: np.ndarray  # bool [S, R]
    seen_keys: np.ndarray  # bool [S, MAX_LEN]: the cached keys some row of the group sees

    @property
    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            LAYER,
            self.key_start,
            self.key_end,
            self.own_k,
            self.own_v,
            self.own_mask,
        )

    @property
    def kwargs(self) -> dict:
        return dict(max_len=MAX_LEN, scale=1.0, score_rows=self.score_rows, group_slot=self.group_slot)


# (mode, start, valid rows) of each group, slots GROUP_SLOTS:
#   an encoder chunk at 30 (sliding: row r's window starts at 30 + r - W + 1, so rows >= W - 1
#     see no cached key, only their own rows in the window);
#   a canvas at 0 (no cached key at all: only its own rows);
#   a canvas at 37 with its last 3 rows invalid (not seen as own keys);
#   an encoder chunk of invalid rows at 20: rows that see no own key (and in full layers the
#     cached keys before 20; in sliding ones those in their window);
#   an encoder chunk of invalid rows at 0: rows that see no key at all.
GROUPS = (("encoder", 30, None), ("canvas", 0, None), ("canvas", 37, -3), ("encoder", 20, 0), ("encoder", 0, 0))
GROUP_SLOTS = (2, 0, 4, 1, 3)


def _windows(kind: AttentionKind, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """key_start int32 [S, R], key_end int32 [S] and own_mask bool [S, R, R] of GROUPS, as
    dllm_jax.runtime.canvas_forward builds them (uncached canvas).

    In (W 10, an encoder chunk at 30, sliding): key_start [21, 22, 23, ...], key_end 30, own
    row r sees own rows r - 9 .. r; a canvas at 37: key_start 28 for every row, all own rows.
    """
    rows = np.arange(n_rows)
    key_start, key_end, own_mask = [], [], []
    for mode, start, valid in GROUPS:
        valid_rows = np.ones(n_rows, bool)
        if valid is not None:
            valid_rows[valid:] = False
        positions = start + rows
        anchor = positions if mode == "encoder" else np.full(n_rows, start)
        first = anchor - WINDOW + 1 if kind is AttentionKind.SLIDING else np.zeros(n_rows, int)
        if mode == "encoder":
            mask = rows[None, :] <= rows[:, None]
            if kind is AttentionKind.SLIDING:
                mask &= rows[None, :] > rows[:, None] - WINDOW
        else:
            mask = np.ones((n_rows, n_rows), bool)
        key_start.append(first)
        key_end.append(start)
        own_mask.append(mask & valid_rows[None, :])
    return np.array(key_start, np.int32), np.array(key_end, np.int32), np.array(own_mask)


def make_canvas_case(
    seed: int, *, kind: AttentionKind, dtype, n_heads: int, n_kv_heads: int, head_dim: int, n_rows: int, scores: bool
) -> CanvasCase:
    """Fresh random inputs; the cache is NaN everywhere but the keys some row of a group sees
    in layer LAYER (keys outside every window, past key_end, other slots' tails, the other
    layer), so a read of any other row shows as NaN."""
    rng = np.random.default_rng(seed)
    n_groups = len(GROUPS)
    kv_width = n_kv_heads * head_dim
    key_start, key_end, own_mask = _windows(kind, n_rows)
    positions = np.arange(MAX_LEN)
    # [S, R, MAX_LEN]
    row_sees = (positions >= np.clip(key_start, 0, None)[:, :, None]) & (positions < key_end[:, None, None])
    seen_keys = row_sees.any(axis=1)
    k_cache = np.full((2, N_SLOTS * MAX_LEN, kv_width), np.nan, np.float32)
    v_cache = k_cache.copy()
    for group, slot in enumerate(GROUP_SLOTS):
        cache_rows = slot * MAX_LEN + np.flatnonzero(seen_keys[group])
        k_cache[LAYER, cache_rows] = rng.standard_normal((len(cache_rows), kv_width))
        v_cache[LAYER, cache_rows] = rng.standard_normal((len(cache_rows), kv_width))

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return CanvasCase(
        q=normal(n_groups, n_rows, n_heads, head_dim),
        k_cache=jnp.asarray(k_cache, dtype),
        v_cache=jnp.asarray(v_cache, dtype),
        key_start=jnp.asarray(key_start),
        key_end=jnp.asarray(key_end),
        own_k=normal(n_groups, n_rows, n_kv_heads, head_dim),
        own_v=normal(n_groups, n_rows, n_kv_heads, head_dim),
        own_mask=jnp.asarray(own_mask),
        score_rows=jnp.asarray(rng.random((n_groups, n_rows)) < 0.5) if scores else None,
        group_slot=jnp.asarray(GROUP_SLOTS, jnp.int32),
        row_sees_a_key=row_sees.any(axis=2) | own_mask.any(axis=2),
        seen_keys=seen_keys,
    )


def _reference(case: CanvasCase) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's jnp reference on the case (the cache_attention signature)."""
    S, R, H, Dh = case.q.shape
    kv_heads = case.own_k.shape[2]
    out, scores = cache_attention_reference(
        case.q.reshape(S, R, H * Dh),
        case.k_cache,
        case.v_cache,
        jnp.int32(LAYER),
        case.group_slot,
        case.key_end,
        case.score_rows,
        n_heads=H,
        n_kv_heads=kv_heads,
        max_len=MAX_LEN,
        extra=(case.own_k.reshape(S, R, -1), case.own_v.reshape(S, R, -1), case.own_mask),
        key_start=case.key_start,
        scale=1.0,
    )
    return np.asarray(out, np.float32), np.asarray(scores)


def check_kernel(case: CanvasCase, blocks: AttentionBlockSizes | None) -> None:
    """The kernel (interpret mode) against the reference, and XLA's canvas attention against
    the reference, on the rows that see a key; the kernel's other rows are zeros."""
    S, R, H, Dh = case.q.shape
    got = canvas_cache_attention_pallas(*case.args, **case.kwargs, interpret=True, block_sizes=blocks)
    xla = canvas_cache_attention(*case.args, **case.kwargs)
    out_ref, scores_ref = _reference(case)
    with_scores = case.score_rows is not None
    out, scores = got if with_scores else (got, None)
    assert out.shape == (S, R, H * Dh) and out.dtype == case.q.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "an output row is unwritten or read a hidden key"
    sees = case.row_sees_a_key
    assert sees.any() and not sees.all()
    assert (out[~sees] == 0).all(), "a row that sees no key must get zeros"
    assert_close(out[sees], out_ref[sees], case.q.dtype, "kernel out")
    xla_out = np.asarray(xla[0] if with_scores else xla, np.float32)
    assert_close(xla_out[sees], out_ref[sees], case.q.dtype, "xla out")
    if with_scores:
        scores = np.asarray(scores)
        assert scores.shape == (S, MAX_LEN) and np.isfinite(scores).all()
        assert (scores[~case.seen_keys] == 0).all(), "a key no row sees has a score"
        assert_close(scores, scores_ref, jnp.float32, "kernel scores")
        assert_close(np.asarray(xla[1]), scores_ref, jnp.float32, "xla scores")


SLIDING_SMALL = dict(kind=AttentionKind.SLIDING, n_heads=4, n_kv_heads=2, head_dim=32)  # Dh 256-like, G 2
FULL_SMALL = dict(kind=AttentionKind.FULL, n_heads=4, n_kv_heads=1, head_dim=64)  # Dh 512-like, G 4


@pytest.mark.parametrize(
    "shape, dtype, n_rows, scores, blocks",
    [
        # 20 rows x G 2 in 16-row tiles (rows padded to 24: 3 tiles), own keys in two 16-key steps
        (SLIDING_SMALL, "float32", 20, True, AttentionBlockSizes(16, 16, num_splits=1, num_warps=4, num_stages=2)),
        # no scores: the tiles skip the key steps before their rows' windows; two key splits
        (SLIDING_SMALL, "bfloat16", 12, False, AttentionBlockSizes(32, 16, num_splits=2, num_warps=4, num_stages=2)),
        # the default tiling for these shapes
        (SLIDING_SMALL, "bfloat16", 12, True, None),
        (FULL_SMALL, "float32", 12, True, AttentionBlockSizes(16, 16, num_splits=3, num_warps=4, num_stages=2)),
        (FULL_SMALL, "bfloat16", 20, False, AttentionBlockSizes(32, 32, num_splits=1, num_warps=4, num_stages=2)),
    ],
)
def test_kernel_matches_the_reference_and_xla_on_encoder_chunks_and_canvases(shape, dtype, n_rows, scores, blocks):
    case = make_canvas_case(n_rows, dtype=dtype, n_rows=n_rows, scores=scores, **shape)
    check_kernel(case, blocks)


def test_the_routing_runs_the_kernel_only_where_the_triton_attention_runs():
    assert canvas_attention(Kernels()) == "xla"
    assert canvas_attention(Kernels(attention=True)) == "pallas"
    assert canvas_attention(Kernels(attention=True, interpret=True)) == "interpret"
    assert canvas_attention(Kernels(attention=True, mosaic=True)) == "xla"  # TPU: XLA's path
    assert canvas_attention_fn("xla") is canvas_cache_attention
    # the 26B-A4B full layers' 512-wide heads on the kernel, wider ones on XLA
    assert canvas_attention_fn("pallas", head_dim=512).func is canvas_cache_attention_pallas
    assert canvas_attention_fn("pallas", head_dim=1024) is canvas_cache_attention
    with pytest.raises(ValueError, match="implementation"):
        canvas_attention_fn("triton")


def test_default_tiling_keeps_wide_heads_within_registers_and_shared_memory():
    llada = default_attention_block_sizes(32, 128, 32, 32, 2048)
    assert (llada.block_q, llada.block_k, llada.num_stages) == (128, 64, 3)
    sliding = default_attention_block_sizes(32, 256, 16, 8, 2048, head_dim=256)
    full = default_attention_block_sizes(32, 256, 16, 2, 2048, head_dim=512)
    for blocks, head_dim in ((sliding, 256), (full, 512)):
        assert blocks.block_q * head_dim <= 128 * 128
        # q tile + K and V tiles per stage, bf16, within the H200's 228 KiB
        assert 2 * head_dim * (blocks.block_q + 2 * blocks.num_stages * blocks.block_k) <= 228 << 10


def _lowering_args(kind: AttentionKind, n_groups: int, max_len: int, scores: bool):
    """Abstract bfloat16 arguments of one canvas attention at the 26B-A4B shapes (256 rows)."""
    config = diffusion_gemma_26b_a4b_config()
    H, KVH, Dh, R = config.n_heads, config.kv_heads(kind), config.head_dim(kind), config.canvas_length
    bf16, spec = jnp.bfloat16, jax.ShapeDtypeStruct
    cache = spec((config.layers_of(kind), n_groups * max_len, KVH * Dh), bf16)
    own = spec((n_groups, R, KVH, Dh), bf16)
    args = (spec((n_groups, R, H, Dh), bf16), cache, cache)
    rest = (spec((n_groups, R), jnp.int32), spec((n_groups,), jnp.int32), own, own, spec((n_groups, R, R), jnp.bool_))
    score_rows = spec((n_groups, R), jnp.bool_) if scores else None
    return args, rest, score_rows


@pytest.mark.parametrize(
    "kind, n_groups, scores",
    [(AttentionKind.SLIDING, 32, True), (AttentionKind.FULL, 32, False), (AttentionKind.SLIDING, 1, False)],
)
def test_triton_lowering_at_26b_a4b_shapes(kind, n_groups, scores):
    args, rest, score_rows = _lowering_args(kind, n_groups, 2048, scores)

    def attend(q, k_cache, v_cache, key_start, key_end, own_k, own_v, own_mask, score_rows):
        return canvas_cache_attention_pallas(
            q, k_cache, v_cache, 3, key_start, key_end, own_k, own_v, own_mask, max_len=2048, score_rows=score_rows
        )

    text = lower_for_cuda(jax.jit(attend), *args, *rest, score_rows)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert 'name = "cache_attention"' in text
