"""Fused q/k/v projection + rotate-half RoPE + K/V cache write (Pallas, Triton backend).

One launch per layer replaces three GEMMs, a RoPE pass over their float32 products and two
scatters: every program computes one (row tile, projection, head, rotary chunk) tile of
``x @ w`` in float32, rotates q and k in registers, rounds once, and stores q into its output
rows and k / v straight into their flat cache rows. The weights and caches are the full
layer-stacked arrays; ``layer`` is read inside the kernel, so a ``lax.scan`` over layers never
slices them.

Tiling. A program owns ``block_rows`` query rows and ``block_pairs`` rotary pairs of one head:
output columns ``[c, c + BH)`` and ``[c + Dh/2, c + Dh/2 + BH)``, each with its own float32
accumulator, so rotate-half needs neither value slicing nor a shuffle. The reduction over D
runs in ``block_d`` steps (software-pipelined by Triton). Grid axis 0 is the row tile, the
fastest-varying launch axis: the row tiles that share one weight slice run in the same wave,
so that slice comes from HBM once and from L2 for the others.

Performance at LLaDA-8B layer shapes (D=4096, H=KVH=32, Dh=128, bf16; H200: ~4.3 TB/s,
~800 TFLOP/s dense bf16, 132 SMs, 50 MB L2):
* 1 slot (N=128 rows): 12.9 GFLOP against 96 MiB of weights, so it is memory bound with a
  floor of about 23 us. One row tile (BM=128) reads every weight byte exactly once; the
  parallelism comes from the columns: 3*32 heads * (64/BH) programs = 96 at BH=64 (a quarter of
  the SMs idle) and 192 half-size programs at BH=32 (all resident if two fit per SM: ~72 KiB
  of shared memory each at 3 stages), which costs re-reading the 1 MiB of x from L2 twice as
  often. The XLA path pays three GEMM launches, a float32 round trip
  of the [128, 12288] product and two scatters on top of the same weight stream.
* 32 slots (N=4096): 412 GFLOP, compute bound (~0.5 ms at cuBLAS rates). The fused epilogue
  saves the XLA path's float32 [4096, 12288] write and re-read (~400 MB, ~0.1 ms) and the
  scatters; what is left to win or lose is the MMA efficiency of 128x128 (or 256x128) tiles
  against cuBLAS. 32 row tiles x 96 columns = 3072 programs, ~12 waves: no occupancy issue.
The bench script (scripts/bench_kernels.py) sweeps BM, BH, BK, warps and stages per case.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    NUM_SMS,
    as_int32,
    cdiv,
    check_float,
    check_launch,
    check_power_of_two,
    check_shape,
    compiler_params,
    next_power_of_two,
)
from pallas_kernels.projection.rope import apply_rope, rope_cos_sin, rope_frequencies


@dataclasses.dataclass(frozen=True)
class QKVBlockSizes:
    """Tiling of the fused projection (all but the launch parameters are powers of two >= 16).

    Attributes:
      block_rows: query rows per program (BM).
      block_pairs: rotary pairs per program (BH); must divide head_dim // 2.
      block_d: reduction tile over the model dimension (BK); must divide d_model.
      num_warps, num_stages: Triton launch parameters (stages = software-pipeline depth).
    """

    block_rows: int = 128
    block_pairs: int = 64
    block_d: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        check_power_of_two("block_rows", self.block_rows, 16)
        check_power_of_two("block_pairs", self.block_pairs, 16)
        check_power_of_two("block_d", self.block_d, 16)
        check_launch(self.num_warps, self.num_stages)


def default_qkv_block_sizes(n_rows: int, d_model: int, head_dim: int, n_columns: int) -> QKVBlockSizes:
    """A small heuristic: 128-row tiles, then narrower column tiles while the grid is below one
    program per SM (the 1-slot case), never narrower than 32 pairs.

    Args:
      n_rows: N, query rows of the call.
      d_model: D.
      head_dim: Dh.
      n_columns: total output columns, (H + 2 * KVH) * Dh.
    """
    block_rows = min(128, max(16, next_power_of_two(n_rows)))
    block_pairs = min(64, head_dim // 2)
    while block_pairs > 32 and cdiv(n_rows, block_rows) * n_columns // (2 * block_pairs) < NUM_SMS:
        block_pairs //= 2
    block_d = min(64, d_model)
    num_warps = 8 if block_rows * block_pairs >= 128 * 64 else 4
    return QKVBlockSizes(block_rows, block_pairs, block_d, num_warps, num_stages=3)


def _qkv_kernel(
    layer_ref,
    pos_ref,
    rows_ref,
    inv_freq_ref,
    x_ref,
    wq_ref,
    wk_ref,
    wv_ref,
    bq_ref,
    bk_ref,
    bv_ref,
    _k_in,
    _v_in,
    q_ref,
    k_ref,
    v_ref,
    *,
    n_q_chunks: int,
    n_kv_chunks: int,
    head_dim: int,
    blocks: QKVBlockSizes,
):
    """One (row tile, column chunk) program; column chunks are [q heads | k heads | v heads]."""
    bm, bh, bk = blocks.block_rows, blocks.block_pairs, blocks.block_d
    half = head_dim // 2
    chunks_per_head = half // bh
    row0 = pl.program_id(0) * bm
    chunk = pl.program_id(1)
    layer = layer_ref[0]
    d_model = x_ref.shape[1]

    def project(w_ref, b_ref, col):
        """x rows @ w[layer][:, col:col+BH] (+ b[layer][col:col+BH]) and the same at col + half,
        float32 [BM, BH] each."""

        def step(t, accs):
            acc1, acc2 = accs
            x = x_ref[pl.ds(row0, bm), pl.ds(t * bk, bk)]
            w1 = w_ref[layer, pl.ds(t * bk, bk), pl.ds(col, bh)]
            w2 = w_ref[layer, pl.ds(t * bk, bk), pl.ds(col + half, bh)]
            acc1 += jnp.dot(x, w1, preferred_element_type=jnp.float32)
            acc2 += jnp.dot(x, w2, preferred_element_type=jnp.float32)
            return acc1, acc2

        zeros = jnp.zeros((bm, bh), jnp.float32)
        acc1, acc2 = lax.fori_loop(0, d_model // bk, step, (zeros, zeros))
        b1 = b_ref[layer, pl.ds(col, bh)].astype(jnp.float32)
        b2 = b_ref[layer, pl.ds(col + half, bh)].astype(jnp.float32)
        return acc1 + b1[None, :], acc2 + b2[None, :]

    def rotate(acc1, acc2, pair0):
        """Rotate-half RoPE of pairs [pair0, pair0 + BH) on the float32 accumulators."""
        positions = pos_ref[pl.ds(row0, bm)].astype(jnp.float32)
        angles = positions[:, None] * inv_freq_ref[pl.ds(pair0, bh)][None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        return acc1 * cos - acc2 * sin, acc2 * cos + acc1 * sin

    def column(local_chunk):
        """(first output column of the chunk, first rotary pair) for a chunk index of one projection."""
        pair0 = (local_chunk % chunks_per_head) * bh
        return (local_chunk // chunks_per_head) * head_dim + pair0, pair0

    def write_cache(cache_ref, col, out1, out2):
        # Each query row goes to its own flat cache row: a row-scattered store.
        rows = rows_ref[pl.ds(row0, bm)][:, None]
        cols = col + jnp.arange(bh, dtype=jnp.int32)[None, :]
        plgpu.store(cache_ref.at[layer, rows, cols], out1.astype(cache_ref.dtype))
        plgpu.store(cache_ref.at[layer, rows, cols + half], out2.astype(cache_ref.dtype))

    @pl.when(chunk < n_q_chunks)
    def _q():
        col, pair0 = column(chunk)
        out1, out2 = rotate(*project(wq_ref, bq_ref, col), pair0)
        plgpu.store(q_ref.at[pl.ds(row0, bm), pl.ds(col, bh)], out1.astype(q_ref.dtype))
        plgpu.store(q_ref.at[pl.ds(row0, bm), pl.ds(col + half, bh)], out2.astype(q_ref.dtype))

    @pl.when((chunk >= n_q_chunks) & (chunk < n_q_chunks + n_kv_chunks))
    def _k():
        col, pair0 = column(chunk - n_q_chunks)
        write_cache(k_ref, col, *rotate(*project(wk_ref, bk_ref, col), pair0))

    @pl.when(chunk >= n_q_chunks + n_kv_chunks)
    def _v():
        col, _ = column(chunk - n_q_chunks - n_kv_chunks)
        write_cache(v_ref, col, *project(wv_ref, bv_ref, col))


def _biases(wq, wk, wv, biases):
    """(bq, bk, bv) [NL, width] each, checked; zeros for a model without q/k/v biases."""
    if biases is None:
        return tuple(jnp.zeros((w.shape[0], w.shape[2]), w.dtype) for w in (wq, wk, wv))
    if len(biases) != 3:
        raise ValueError(f"biases: expected (bq, bk, bv), got {len(biases)} arrays")
    for name, b, w in zip(("bq", "bk", "bv"), biases, (wq, wk, wv)):
        check_shape(name, b, (w.shape[0], w.shape[2]))
        if b.dtype != w.dtype:
            raise ValueError(f"{name}.dtype={b.dtype}: expected the weights' dtype {w.dtype}")
    return tuple(biases)


def _check_args(x, wq, wk, wv, k_cache, v_cache, n_heads, n_kv_heads):
    """Shape/dtype validation shared by the kernel and the reference; returns (D, Dh)."""
    check_float("x", x)
    if x.ndim != 2:
        raise ValueError(f"x.shape={x.shape}: expected [N, D]")
    d_model = x.shape[1]
    if not isinstance(n_heads, int) or not isinstance(n_kv_heads, int) or n_heads <= 0 or n_kv_heads <= 0:
        raise ValueError(f"n_heads={n_heads!r}, n_kv_heads={n_kv_heads!r}: expected positive ints")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if wq.ndim != 3 or wq.shape[1] != d_model or wq.shape[2] % n_heads:
        raise ValueError(f"wq.shape={wq.shape}: expected [NL, {d_model}, n_heads * head_dim]")
    n_layers = wq.shape[0]
    head_dim = wq.shape[2] // n_heads
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} (wq.shape={wq.shape}, n_heads={n_heads}) must be even")
    kv_width = n_kv_heads * head_dim
    check_shape("wk", wk, (n_layers, d_model, kv_width))
    check_shape("wv", wv, (n_layers, d_model, kv_width))
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name}.dtype={w.dtype}: expected x.dtype={x.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, cache)
        if cache.ndim != 3 or cache.shape[0] != n_layers or cache.shape[2] != kv_width:
            raise ValueError(f"{name}.shape={cache.shape}: expected [{n_layers}, M, {kv_width}]")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {v_cache.shape} {v_cache.dtype} differs from k_cache {k_cache.shape} {k_cache.dtype}"
        )
    return d_model, head_dim


def _safe_rows(cache_rows: jax.Array, n_cache_rows: int) -> jax.Array:
    """Out-of-range cache rows go to the trash row M-1 (XLA's scatter would drop them)."""
    in_range = (cache_rows >= 0) & (cache_rows < n_cache_rows)
    return jnp.where(in_range, cache_rows, n_cache_rows - 1)


@functools.partial(
    jax.jit,
    static_argnames=("n_heads", "n_kv_heads", "rope_theta", "interpret", "block_sizes"),
    donate_argnames=("k_cache", "v_cache"),
)
def qkv_rope_cache(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    positions: jax.Array,
    cache_rows: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    *,
    n_heads: int,
    n_kv_heads: int,
    rope_theta: float,
    interpret: bool = False,
    block_sizes: QKVBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q/k/v projection of x, RoPE on q and k, k and v written into the layer's cache rows.

    Args:
      x: [N, D] normed query rows (bfloat16 or float32); the weights share its dtype.
      wq: [NL, D, H*Dh] query weights of all layers.
      wk, wv: [NL, D, KVH*Dh] key / value weights of all layers.
      positions: int32 [N] rotary position of each row.
      cache_rows: int32 [N] flat cache row of each query row. Padding rows point at the trash
        row M-1; rows outside [0, M) are sent there too.
      k_cache, v_cache: [NL, M, KVH*Dh] (donated; updated in place).
      layer: int32 scalar, the layer whose weights and cache rows are used (0 <= layer < NL).
      biases: (bq [NL, H*Dh], bk, bv [NL, KVH*Dh]) added to the float32 products before RoPE
        (Dream / Qwen2), in the weights' dtype; None = no biases.
      n_heads, n_kv_heads: H and KVH.
      rope_theta: RoPE base; angle of pair i = position * theta^(-2i/Dh) in float32.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      block_sizes: tiling; default ``default_qkv_block_sizes``.
    Returns:
      (q [N, H*Dh] in x.dtype, k_cache, v_cache). q and k are rotated in float32 and rounded
      once (q to x.dtype, k to the cache dtype); v is not rotated. Cache rows not named by
      cache_rows are untouched.
    """
    d_model, head_dim = _check_args(x, wq, wk, wv, k_cache, v_cache, n_heads, n_kv_heads)
    bq, bk, bv = _biases(wq, wk, wv, biases)
    n_rows = x.shape[0]
    positions = as_int32("positions", positions, (n_rows,))
    cache_rows = _safe_rows(as_int32("cache_rows", cache_rows, (n_rows,)), k_cache.shape[1])
    layer = as_int32("layer", layer, ()).reshape(1)
    blocks = block_sizes or default_qkv_block_sizes(n_rows, d_model, head_dim, wq.shape[2] + 2 * wk.shape[2])
    if (head_dim // 2) % blocks.block_pairs:
        raise ValueError(f"block_pairs={blocks.block_pairs} must divide head_dim // 2 = {head_dim // 2}")
    if d_model % blocks.block_d:
        raise ValueError(f"block_d={blocks.block_d} must divide d_model = {d_model}")

    # Pad the rows to whole tiles; the padding rows write the trash row and are dropped from q.
    padded = cdiv(n_rows, blocks.block_rows) * blocks.block_rows
    pad = padded - n_rows
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        positions = jnp.pad(positions, (0, pad))
        cache_rows = jnp.pad(cache_rows, (0, pad), constant_values=k_cache.shape[1] - 1)
    chunks_per_head = head_dim // 2 // blocks.block_pairs
    n_q_chunks = n_heads * chunks_per_head
    n_kv_chunks = n_kv_heads * chunks_per_head
    kernel = functools.partial(
        _qkv_kernel, n_q_chunks=n_q_chunks, n_kv_chunks=n_kv_chunks, head_dim=head_dim, blocks=blocks
    )
    q, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(padded // blocks.block_rows, n_q_chunks + 2 * n_kv_chunks),
        out_shape=(
            jax.ShapeDtypeStruct((padded, wq.shape[2]), x.dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ),
        input_output_aliases={11: 1, 12: 2},
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="qkv_rope_cache",
    )(layer, positions, cache_rows, rope_frequencies(head_dim, rope_theta), x, wq, wk, wv, bq, bk, bv, k_cache, v_cache)
    return q[:n_rows], k_cache, v_cache


@functools.partial(
    jax.jit,
    static_argnames=("n_heads", "n_kv_heads", "rope_theta", "interpret", "block_sizes"),
    donate_argnames=("k_cache", "v_cache"),
)
def qkv_rope_cache_reference(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    positions: jax.Array,
    cache_rows: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    *,
    n_heads: int,
    n_kv_heads: int,
    rope_theta: float,
    interpret: bool = False,
    block_sizes: QKVBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-jnp ``qkv_rope_cache`` (the XLA path): GEMMs with float32 results, the model's
    RoPE, then scatters into the layer's cache rows. ``interpret`` and ``block_sizes`` are
    accepted for signature parity and ignored."""
    del interpret, block_sizes
    _, head_dim = _check_args(x, wq, wk, wv, k_cache, v_cache, n_heads, n_kv_heads)
    bq, bk, bv = _biases(wq, wk, wv, biases)
    n_rows = x.shape[0]
    positions = as_int32("positions", positions, (n_rows,))
    cache_rows = _safe_rows(as_int32("cache_rows", cache_rows, (n_rows,)), k_cache.shape[1])
    layer = as_int32("layer", layer, ())
    # [N, Dh/2] each; one angle per row, shared by all heads
    cos, sin = rope_cos_sin(positions, head_dim, rope_theta)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def project(w, b, heads):
        # [N, heads, Dh] float32
        y = jnp.dot(x, w[layer], preferred_element_type=jnp.float32) + b[layer].astype(jnp.float32)
        return y.reshape(n_rows, heads, head_dim)

    q = apply_rope(project(wq, bq, n_heads), cos, sin).reshape(n_rows, -1)
    k = apply_rope(project(wk, bk, n_kv_heads), cos, sin).reshape(n_rows, -1)
    v = project(wv, bv, n_kv_heads).reshape(n_rows, -1)
    k_cache = k_cache.at[layer, cache_rows].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, cache_rows].set(v.astype(v_cache.dtype))
    return q.astype(x.dtype), k_cache, v_cache
