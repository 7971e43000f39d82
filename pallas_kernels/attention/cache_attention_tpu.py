"""Cache attention with the tracking score as a Pallas TPU (Mosaic) kernel.

Same signature and semantics as ``cache_attention.cache_attention`` (the Triton kernel) and
``cache_attention.cache_attention_reference``; this file holds the Mosaic kernel and its
wrapper. Nothing here has run on a real TPU: the tests run it in interpret mode on the CPU and
lower it for TPU (``lowering_platforms=("tpu",)`` with an abstract TPU v5e), which runs the
Pallas -> Mosaic lowering; Mosaic's layout passes run only in the TPU compiler.

Layout. Query rows are regrouped per kv head, [S, KVH, G * Rp, Dh] (row f = g * Rp + r, Rp
= R padded to 16), so one program's q block holds the G query heads of one kv head. The
grid is (group, kv head, query tile, key block); the key block axis is innermost and
sequential, with the online-softmax state (running max, denominator, float32 accumulator)
in VMEM scratch. Group s reads cache rows ``group_slot[s] * max_len + j``: group_slot, key_len
and the layer are scalar-prefetched into SMEM, and the K/V BlockSpecs' index maps turn them
into the block of [block_k, Dh] rows of the flat [NL, M, KVH*Dh] cache (block_k divides
max_len). Key blocks past a group's key_len map to its last needed block, so the pipeline
fetches nothing new for them, and the program skips them. The verify pass's in-query keys
are one more step after the last key block.

Tracking score: linear in q, so the wrapper sums the score rows' queries per kv head
(float32 [S, KVH, 1, Dh]) and the kernel takes one [1, Dh] x [Dh, block_k] product per key
block on the K block it already holds; the wrapper adds the kv heads.

TPU constraints this layout keeps: every block's last two dims are multiples of (8, 128) or
the array's full dims (Dh must be a multiple of 128 unless KVH == 1: LLaDA-8B and Dream-7B
have Dh = 128), no gather inside the kernel, only 2-D values.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.cache_attention import _STATIC, Extra, _check_args
from pallas_kernels.attention.reference import MASKED_LOGIT
from pallas_kernels.common import cdiv, dot_t

ROW_PADDING = 16  # bf16 packs 16 rows per (8, 128) tile
MAX_BLOCK_Q = 512
# K and V blocks of 2048 x 128 bf16 (double-buffered: 2 MiB) and [BQ, 2048] float32 logits
# (4 MiB at BQ = 512) fit the 16 MiB of VMEM a v5e kernel may use by default.
MAX_WHOLE_SLOT_KEYS = 2048


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Tiling of ``cache_attention_tpu``.

    block_k: keys per grid step; must divide max_len and be a multiple of 8 (None: all of
      max_len up to 2048 keys, else the largest of 512, 256, ..., 8 dividing it).
    block_q: most query rows (G * Rp flattened) per program (a multiple of 16).
    """

    block_k: int | None = None
    block_q: int = MAX_BLOCK_Q

    def __post_init__(self):
        if self.block_k is not None and (not isinstance(self.block_k, int) or self.block_k < 8 or self.block_k % 8):
            raise ValueError(f"block_k={self.block_k!r}: expected a multiple of 8")
        if not isinstance(self.block_q, int) or self.block_q < ROW_PADDING or self.block_q % ROW_PADDING:
            raise ValueError(f"block_q={self.block_q!r}: expected a multiple of {ROW_PADDING}")


def _key_block(max_len: int, requested: int | None) -> int:
    """Keys per grid step: the whole slot up to MAX_WHOLE_SLOT_KEYS keys (a TPU grid step costs
    ~0.35 us, so fewer, larger steps), else the largest power of two dividing max_len."""
    if requested is not None:
        if max_len % requested:
            raise ValueError(f"block_k={requested} does not divide max_len={max_len}")
        return requested
    if max_len % 8 == 0 and max_len <= MAX_WHOLE_SLOT_KEYS:
        return max_len
    for block in (512, 256, 128, 64, 32, 16, 8):
        if max_len % block == 0:
            return block
    raise ValueError(f"max_len={max_len}: the TPU kernel needs a multiple of 8 (the engine's are multiples of 32)")


@dataclasses.dataclass(frozen=True)
class _Layout:
    block_q: int
    block_k: int
    head_dim: int
    n_kb: int  # key blocks per slot: max_len // block_k
    n_qt: int  # query tiles per kv head
    scores: bool
    exclude: bool
    n_extra: int  # in-query keys (0: none)


def _kernel(*refs, lay: _Layout):
    """Refs: scalar prefetch (slot [S], key_len [S], layer [1]), then q [BQ, Dh], k, v
    [BK, Dh], (q_sum [1, Dh] f32), (exclude row [1, BK], column [BK, 1] int32), (k_extra,
    v_extra [R2, Dh], extra_mask [BQ, R2] int32); outputs out [BQ, Dh], (scores [1, BK] f32);
    scratch m, l [BQ, 1], acc [BQ, Dh] f32."""
    refs = list(refs)
    _, len_ref, _ = refs[:3]
    q_ref, k_ref, v_ref = refs[3:6]
    rest = refs[6:]
    q_sum_ref = rest.pop(0) if lay.scores else None
    ex_row_ref, ex_col_ref = (rest.pop(0), rest.pop(0)) if lay.exclude else (None, None)
    extra_refs = [rest.pop(0) for _ in range(3)] if lay.n_extra else None
    out_ref = rest.pop(0)
    score_ref = rest.pop(0) if lay.scores else None
    m_ref, l_ref, acc_ref = rest

    s, qt, kb = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bk = lay.block_k
    key_len = len_ref[s]
    needed = (key_len + bk - 1) // bk
    scale = 1.0 / lay.head_dim**0.5

    @pl.when(kb == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASKED_LOGIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def softmax_step(logits, v):
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(logits - m_new)
        l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = acc_ref[...] * alpha + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        m_ref[...] = m_new

    first = kb * bk
    # the key block's visibility as a row [1, BK] (logit columns) and a column [BK, 1] (V rows)
    visible_row = first + lax.broadcasted_iota(jnp.int32, (1, bk), 1) < key_len
    visible_col = first + lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < key_len
    if lay.exclude:
        visible_row &= ex_row_ref[...] == 0
        visible_col &= ex_col_ref[...] == 0

    @pl.when(kb < needed)
    def _keys():
        k = k_ref[...]
        # hidden rows may hold anything (NaN included): select them away, never multiply them
        v = jnp.where(visible_col, v_ref[...], 0)
        logits = jnp.where(visible_row, dot_t(q_ref[...], k) * scale, MASKED_LOGIT)
        softmax_step(logits, v)

    if lay.scores:
        part = dot_t(q_sum_ref[...], k_ref[...].astype(jnp.float32))
        # every score block is written (zeros for skipped blocks and query tiles after the first)
        score_ref[...] = jnp.where(visible_row & (kb < needed) & (qt == 0), part, 0.0)

    @pl.when(kb == lay.n_kb - 1)
    def _finish():
        if lay.n_extra:
            k_extra_ref, v_extra_ref, mask_ref = extra_refs
            logits = jnp.where(mask_ref[...] != 0, dot_t(q_ref[...], k_extra_ref[...]) * scale, MASKED_LOGIT)
            softmax_step(logits, v_extra_ref[...])
        l = l_ref[...]
        out_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def cache_attention_tpu(
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
    block_sizes: TpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of each group's query rows over its slot's cached keys (TPU kernel).

    Arguments and results as ``pallas_kernels.attention.cache_attention.cache_attention_reference``:
    q [S, R, H*Dh]; k_cache, v_cache [NL, M, KVH*Dh]; layer int32 []; group_slot, key_len int32
    [S]; score_rows bool [S, R] or None; key_exclude bool [S, max_len]; extra (k_extra,
    v_extra [S, R2, KVH*Dh], extra_mask bool [S, R, R2]). Returns out [S, R, H*Dh] in q.dtype
    and scores float32 [S, max_len]. block_sizes: ``TpuBlockSizes`` (None: defaults).
    """
    args = _check_args(
        q, k_cache, v_cache, layer, group_slot, key_len, score_rows, n_heads, n_kv_heads, max_len, key_exclude, extra
    )
    blocks = block_sizes or TpuBlockSizes()
    n_groups, n_rows, width = q.shape
    head_dim, group = args.head_dim, n_heads // n_kv_heads
    if not interpret and head_dim % 128 and n_kv_heads > 1:
        raise ValueError(f"head_dim={head_dim}: the TPU kernel needs a multiple of 128 (or one kv head)")
    block_k = _key_block(max_len, blocks.block_k)
    n_kb = max_len // block_k
    padded_rows = cdiv(n_rows, ROW_PADDING) * ROW_PADDING
    flat_rows = group * padded_rows
    block_q = min(blocks.block_q, flat_rows)
    n_qt = cdiv(flat_rows, block_q)
    tiled_rows = n_qt * block_q

    def per_kv_head(x):
        """[S, R, H*Dh] -> [S, KVH, tiled rows, Dh], row f = g * Rp + r."""
        x = jnp.pad(
            x.reshape(n_groups, n_rows, n_kv_heads, group, -1),
            ((0, 0), (0, padded_rows - n_rows), (0, 0), (0, 0), (0, 0)),
        )
        x = x.transpose(0, 2, 3, 1, 4).reshape(n_groups, n_kv_heads, flat_rows, -1)
        return jnp.pad(x, ((0, 0), (0, 0), (0, tiled_rows - flat_rows), (0, 0)))

    lay = _Layout(
        block_q=block_q,
        block_k=block_k,
        head_dim=head_dim,
        n_kb=n_kb,
        n_qt=n_qt,
        scores=score_rows is not None,
        exclude=key_exclude is not None,
        n_extra=0 if extra is None else extra[0].shape[1],
    )

    def kv_index(s, h, qt, kb, slot_ref, len_ref, layer_ref):
        last = jnp.maximum((len_ref[s] + block_k - 1) // block_k - 1, 0)
        return layer_ref[0], slot_ref[s] * n_kb + jnp.minimum(kb, last), h

    kv_spec = pl.BlockSpec((None, block_k, head_dim), kv_index)
    inputs = [per_kv_head(q), k_cache, v_cache]
    in_specs = [pl.BlockSpec((None, None, block_q, head_dim), lambda s, h, qt, kb, *_: (s, h, qt, 0)), kv_spec, kv_spec]
    if lay.scores:
        weights = score_rows.astype(jnp.float32)
        q_sum = jnp.einsum(
            "srkgd,sr->skd", q.reshape(n_groups, n_rows, n_kv_heads, group, head_dim).astype(jnp.float32), weights
        )
        inputs.append(q_sum[:, :, None, :])
        in_specs.append(pl.BlockSpec((None, None, 1, head_dim), lambda s, h, qt, kb, *_: (s, h, 0, 0)))
    if lay.exclude:
        excluded = key_exclude.astype(jnp.int32)
        inputs += [excluded.reshape(n_groups, n_kb, 1, block_k), excluded.reshape(n_groups, max_len, 1)]
        in_specs += [
            pl.BlockSpec((None, None, 1, block_k), lambda s, h, qt, kb, *_: (s, kb, 0, 0)),
            pl.BlockSpec((None, block_k, 1), lambda s, h, qt, kb, *_: (s, kb, 0)),
        ]
    if extra is not None:
        k_extra, v_extra, extra_mask = extra
        n_extra = lay.n_extra
        # [S, R, R2] -> [S, tiled rows, R2]: row f = g * Rp + r reads row r's mask
        mask = jnp.pad(extra_mask.astype(jnp.int32), ((0, 0), (0, padded_rows - n_rows), (0, 0)))
        mask = jnp.pad(jnp.tile(mask, (1, group, 1)), ((0, 0), (0, tiled_rows - flat_rows), (0, 0)))
        extra_spec = pl.BlockSpec((None, n_extra, head_dim), lambda s, h, qt, kb, *_: (s, 0, h))
        inputs += [k_extra, v_extra, mask]
        in_specs += [
            extra_spec,
            extra_spec,
            pl.BlockSpec((None, block_q, n_extra), lambda s, h, qt, kb, *_: (s, qt, 0)),
        ]

    out_shape = [jax.ShapeDtypeStruct((n_groups, n_kv_heads, tiled_rows, head_dim), q.dtype)]
    out_specs = [pl.BlockSpec((None, None, block_q, head_dim), lambda s, h, qt, kb, *_: (s, h, qt, 0))]
    if lay.scores:
        out_shape.append(jax.ShapeDtypeStruct((n_groups, n_kv_heads * n_qt * n_kb, 1, block_k), jnp.float32))
        out_specs.append(
            pl.BlockSpec((None, None, 1, block_k), lambda s, h, qt, kb, *_: (s, (h * n_qt + qt) * n_kb + kb, 0, 0))
        )

    results = pl.pallas_call(
        functools.partial(_kernel, lay=lay),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(n_groups, n_kv_heads, n_qt, n_kb),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((block_q, 1), jnp.float32),
                pltpu.VMEM((block_q, 1), jnp.float32),
                pltpu.VMEM((block_q, head_dim), jnp.float32),
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="cache_attention_tpu",
    )(args.group_slot, args.key_len, args.layer.reshape(1), *inputs)

    out = results[0][:, :, :flat_rows].reshape(n_groups, n_kv_heads, group, padded_rows, head_dim)
    out = out[:, :, :, :n_rows].transpose(0, 3, 1, 2, 4).reshape(n_groups, n_rows, width)
    if not lay.scores:
        return out, jnp.zeros((n_groups, max_len), jnp.float32)
    scores = results[1].reshape(n_groups, n_kv_heads * n_qt, max_len).sum(axis=1)
    return out, scores
