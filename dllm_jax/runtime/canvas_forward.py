"""One DiffusionGemma pass over the flat encoder cache: every slot's rows, encoder or decoder.

Each slot brings R rows (R = the canvas length) at consecutive positions starting at
``start``, in one of two modes:
  encoder  (a chunk of its prompt, or its finished canvas) causal: row r sees the cached keys
           before ``start`` and the group's rows up to itself, in sliding layers only the
           window of W positions ending at its own; its K/V are written into the cache.
  decoder  (the canvas being denoised) bidirectional among the group's rows plus every
           cached key before ``start`` (sliding layers: the last W - 1 of them, as
           transformers' sliding cache keeps them); the embeddings go through
           self-conditioning; nothing is written.
This is dllm_jax.models.diffusion_gemma's encode and decode in one batch, with the prompt
encoded in chunks of R rows: the same keys, the same weights (the layers' encoder or decoder
scalar per group), the experts as one grouped GEMM over every row of the pass.

With a cached canvas (Flash-Cache on the canvas, ``canvas_length`` given), the decoder rows are
any rows of the canvas at [start, start + canvas_length): they write their K/V into the slot's
cache rows at their positions (past everything encoded: the rows the canvas's encoding
overwrites once it is finished) and attend to every cached key before start + canvas_length,
so the canvas rows this pass does not recompute are seen with the K/V of their last
recomputation. The decoder groups' rows can feed tracking scores: per cached key, the raw
q . k summed over the group's valid rows, the query heads and the layers from the third up.

Shapes: S slots (group s is slot s), R rows per slot, D model width, M = S * max_len cache rows.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.diffusion_gemma_config import AttentionKind, DiffusionGemmaConfig
from dllm_jax.models.experts import routed_products
from dllm_jax.models.gemma_layers import HeadNormRope
from dllm_jax.runtime.cached_forward import SCORE_START_LAYER
from dllm_jax.runtime.canvas_attention import canvas_attention_fn
from dllm_jax.runtime.canvas_cache import CanvasCache
from dllm_jax.runtime.expert_sharding import experts_split, sharded_expert_mlp
from pallas_kernels.norm import head_norm_rope as head_norm_kernel
from pallas_kernels.norm import moe_residual as moe_residual_kernel
from pallas_kernels.projection import scatter_rows


@struct.dataclass
class CanvasRows:
    """The rows of one pass.

    tokens, positions: int32 [S, R]; valid: bool [S, R] (invalid rows are computed, never
      written, and their outputs unused).
    decoder: bool [S], the group is a canvas (else encoder rows).
    start: int32 [S], the position of the group's first row: cached keys before it are visible.
    soft: [S, R, D] in the model dtype, the decoder groups' self-conditioning soft embeddings
      (zeros: no signal, the first step of a canvas).
    """

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    decoder: jax.Array
    start: jax.Array
    soft: jax.Array


# what may run each of the ops below (the per-head norms, the MoE block's end, the cache
# writes): XLA, the Triton kernel, the kernel in interpret mode
IMPLEMENTATIONS = ("xla", "pallas", "interpret")


def _check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")


def head_norm_fn(implementation: str) -> HeadNormRope | None:
    """The per-head norm an implementation name (IMPLEMENTATIONS) stands for, as
    DiffusionGemmaLayer's ``head_norm``: None for XLA; the kernel for the shapes it takes
    (powers of two: head_norm_rope.supports), XLA's function for the others."""
    _check_implementation(implementation)
    if implementation == "xla":
        return None
    interpret = implementation == "interpret"

    def run(x, weight, cos, sin, *, eps):
        if not head_norm_kernel.supports(*x.shape[1:]):
            return head_norm_kernel.head_norm_rope_reference(x, weight, cos, sin, eps=eps)
        return head_norm_kernel.head_norm_rope(x, weight, cos, sin, eps=eps, interpret=interpret)

    return run


def moe_output_fn(implementation: str, grouped_gemm: str) -> dg.MoEOutput | None:
    """DiffusionGemmaLayer's ``moe_output`` an implementation name (IMPLEMENTATIONS) stands for:
    None for XLA; else the experts' grouped GEMMs by ``grouped_gemm`` (experts.routed_products)
    and their sum, the post-norms, the residual and the layer scalar by
    pallas_kernels.norm.moe_residual (its reference for widths the kernel does not take)."""
    _check_implementation(implementation)
    if implementation == "xla":
        return None
    interpret = implementation == "interpret"

    def run(h, dense, x, weights, experts, gate_up, down, w_dense, w_routed, w_out, scale, *, eps):
        products, position = routed_products(x, weights, experts, gate_up, down, grouped_gemm=grouped_gemm)
        args = (h, dense, products, position, weights, w_dense, w_routed, w_out, scale)
        if not moe_residual_kernel.supports(h.shape[-1]):
            return moe_residual_kernel.moe_residual_reference(*args, eps=eps)
        return moe_residual_kernel.moe_residual(*args, eps=eps, interpret=interpret)

    return run


def cache_write_fn(implementation: str) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """(k_cache, v_cache [NL, M, W], k_rows, v_rows [N, W], rows int32 [N] (M: not written),
    layer) -> the caches with the rows written, by XLA's scatter or
    pallas_kernels.projection.scatter_rows, which skips the rows a pass drops (IMPLEMENTATIONS;
    XLA's scatter for widths the kernel does not tile)."""
    _check_implementation(implementation)
    interpret = implementation == "interpret"

    def write(k_cache, v_cache, k_rows, v_rows, rows, layer):
        if implementation == "xla" or not scatter_rows.supports(k_cache.shape[-1]):
            return k_cache.at[layer, rows].set(k_rows, mode="drop"), v_cache.at[layer, rows].set(v_rows, mode="drop")
        return scatter_rows.scatter_kv_rows(
            k_cache, v_cache, k_rows, v_rows, rows, layer, drop=True, interpret=interpret
        )

    return write


def _key_windows(
    config: DiffusionGemmaConfig, rows: CanvasRows, cached_canvas: bool
) -> dict[AttentionKind, tuple[jax.Array, jax.Array]]:
    """Per attention kind: the first cached key each row sees, int32 [S, R], and which of the
    group's own rows it sees, bool [S, R, R] (a cached canvas's decoder rows: none, they are
    in the cache).

    In (W 4, an encoder chunk at positions 8..10, all valid): sliding key_start [5, 6, 7],
    own rows [[T, F, F], [T, T, F], [T, T, T]]; a canvas at 8..10: key_start [5, 5, 5], all True.
    """
    S, R = rows.tokens.shape
    W = config.sliding_window
    decoder = rows.decoder[:, None]
    # the position a row's window ends at: its own (encoder), the canvas's start (decoder)
    anchor = jnp.where(decoder, rows.start[:, None], rows.positions)
    causal = rows.positions[:, None, :] <= rows.positions[:, :, None]
    in_window = rows.positions[:, None, :] > rows.positions[:, :, None] - W
    seen = rows.valid[:, None, :]
    bidirectional = jnp.broadcast_to(seen & (not cached_canvas), (S, R, R))
    full = jnp.where(decoder[:, :, None], bidirectional, causal & seen)
    sliding = jnp.where(decoder[:, :, None], bidirectional, causal & in_window & seen)
    return {
        AttentionKind.FULL: (jnp.zeros((S, R), jnp.int32), full),
        AttentionKind.SLIDING: (anchor - W + 1, sliding),
    }


def canvas_forward(
    config: DiffusionGemmaConfig,
    weights: dg.Weights,
    cache: CanvasCache,
    rows: CanvasRows,
    *,
    max_len: int,
    canvas_length: int | None = None,
    with_scores: bool = False,
    group_slot: jax.Array | None = None,
    mesh: Mesh | None = None,
    grouped_gemm: str = "xla",
    attention: str = "xla",
    head_norm: str = "xla",
    moe_output: str = "xla",
    cache_write: str = "xla",
) -> tuple[jax.Array, CanvasCache] | tuple[jax.Array, CanvasCache, jax.Array]:
    """Runs the model on the rows over the cache.

    Args:
      weights: DiffusionGemma's parameter tree, its layer stacks stacked or as per-layer
        tuples (dllm_jax.models.diffusion_gemma.unstack_layers: read in place, no slicing).
      cache: the slots' encoder cache; max_len: its rows per slot.
      canvas_length: the decoder groups are rows of a cached canvas of this length (see the
        module doc); None: each decoder group is a whole canvas, read-only.
      with_scores: also return the decoder groups' tracking scores.
      group_slot: int32 [S], the slot of each group (None: group s is slot s); a group of
        invalid rows may name any slot.
      mesh: the device mesh, if any (the slots are one data shard's): the routed experts run
        on their devices (dllm_jax.runtime.expert_sharding); GSPMD splits the rest.
      grouped_gemm: what runs the experts' grouped GEMMs (dllm_jax.models.experts.GROUPED_GEMMS;
        the kernel routing's choice, kernel_routing.grouped_gemm).
      attention: what runs the attention over [cache; own rows]
        (dllm_jax.runtime.canvas_attention.CANVAS_ATTENTIONS; kernel_routing.canvas_attention).
      head_norm: what norms q/k/v per head and rotates q and k (IMPLEMENTATIONS; kernel_routing.head_norm).
      moe_output: what sums the routed experts' outputs and applies the MoE block's post-norms
        and residual (IMPLEMENTATIONS; kernel_routing.moe_output); XLA where the mesh splits the
        experts (an expert or tensor axis).
      cache_write: what writes the K/V rows into the cache (IMPLEMENTATIONS;
        kernel_routing.cache_write).
    Returns:
      the last layer's output rows [S, R, D] (before the final norm), the cache with the
      written rows (the encoder groups' valid rows; with canvas_length, the decoder groups'
      too), and with_scores the tracking scores float32 [S, max_len] of the cached keys.
    """
    S, R = rows.tokens.shape
    cached_canvas = canvas_length is not None
    embedded = dg.embed(config, weights, rows.tokens)
    conditioned = dg.SelfConditioning(config).apply({"params": weights["self_conditioning"]}, embedded, rows.soft)
    h = jnp.where(rows.decoder[:, None, None], conditioned, embedded)
    windows = _key_windows(config, rows, cached_canvas)
    written = rows.valid & (~rows.decoder[:, None] | cached_canvas)
    # the cached keys a group sees end at its start, or past a cached canvas
    key_end = rows.start + jnp.where(rows.decoder & cached_canvas, canvas_length or 0, 0)
    score_rows = rows.valid & rows.decoder[:, None] if with_scores else None
    scores = jnp.zeros((S, max_len), jnp.float32)
    slots = jnp.arange(S, dtype=jnp.int32) if group_slot is None else group_slot.astype(jnp.int32)
    cache_rows = jax.tree_util.tree_leaves(cache)[0].shape[1]
    # [S, R] cache row of each written row; the cache's length (out of range) drops the others
    targets = jnp.where(written, slots[:, None] * max_len + rows.positions, cache_rows)
    encoder = ~rows.decoder[:, None, None]
    expert_mlp = sharded_expert_mlp(mesh, grouped_gemm)
    norm = head_norm_fn(head_norm)
    moe = moe_output_fn("xla" if experts_split(mesh) else moe_output, grouped_gemm)
    write = cache_write_fn(cache_write)
    attends = {
        kind: canvas_attention_fn(
            attention, config.full_head_dim if kind is AttentionKind.FULL else config.sliding_head_dim
        )
        for kind in set(config.layer_types)
    }
    keys, values = dict(cache.keys), dict(cache.values)
    for layer in range(config.n_layers):
        kind = config.layer_types[layer]
        j, name = config.stack_index(layer), kind.value
        module = dg.DiffusionGemmaLayer(config, kind, expert_mlp, norm, moe)
        variables = {"params": dg.layer_params(config, weights, layer)}
        q, k, v = module.apply(variables, h, rows.positions, method=dg.DiffusionGemmaLayer.project_qkv)
        # the writes land at or after each group's start, where no row of this pass reads
        keys[name], values[name] = write(
            keys[name], values[name], k.reshape(S * R, -1), v.reshape(S * R, -1), targets.reshape(S * R), j
        )
        key_start, own_mask = windows[kind]
        scored = score_rows if layer >= SCORE_START_LAYER else None
        attn = attends[kind](
            q,
            keys[name],
            values[name],
            j,
            key_start,
            key_end,
            k,
            v,
            own_mask,
            max_len=max_len,
            scale=1.0,
            score_rows=scored,
            group_slot=group_slot,
        )
        if scored is not None:
            attn, layer_scores = attn
            scores = scores + layer_scores
        h = module.apply(variables, h, attn, encoder, method=dg.DiffusionGemmaLayer.output_and_mlp)
    cache = CanvasCache(keys=keys, values=values)
    return (h, cache, scores) if with_scores else (h, cache)
