"""One model pass over a set of query rows that reads and writes the flat K/V cache.

Every decode step of every method is this pass (or the read-only verify pass): the query rows
of a group (all rows of a group belong to one slot) are embedded, and in every layer their
K/V are written into their cache rows before the group's rows attend to the slot's keys
``[0, key_len)`` in the cache, so queries see each other's fresh K/V and everything else as
cached. Logits are computed only for the candidate rows.

Shapes: S groups, R query rows per group, C candidate rows per group, L = max_len positions
per slot, D model width, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Block, Transformer, Weights
from dllm_jax.runtime.batch_invariance import INVARIANT_BLOCK_K, LAYER_TAP_ORDER, LayerTaps, invariant_ops, map_groups
from dllm_jax.runtime.chunked_attention import chunked_cache_attention
from dllm_jax.runtime.flat_cache import FlatCache, flat_rows
from dllm_jax.runtime.kernel_routing import Kernels, fp8_qkv_to_cache, fused_fp8_qkv, pass_producers

# The published code accumulates tracking scores from the third layer up (block_idx > 1).
SCORE_START_LAYER = 2

# With XLA's attention (the xla backend, the portable path), a pass over more than twice this
# many rows runs its attention output and MLP in chunks of whole groups of at most this many
# rows, one chunk at a time: unchunked, the full pass over 32 slots (20480 rows at LLaDA-8B)
# held its gate, up and SwiGLU activations, [rows, 12288] each, at once (2.17 GiB of
# temporaries over weights + cache on the H200; 1.70 GiB in chunks). Sparse steps (128 rows
# per slot) and 8-slot full passes stay in one piece; chunks of 2560+ rows keep the GEMMs
# large. With the Pallas attention (auto on a GPU or TPU) the pass stays in one piece: there
# the temporaries are within 2 GiB anyway, and the 32-slot full pass measured 541 ms in one
# piece against 688 ms in chunks (BENCHMARKS.md).
MLP_CHUNK_ROWS = 4096


def mlp_chunk_groups(groups: int, rows: int) -> int:
    """Groups per chunk of output_and_mlp_in_chunks for S groups of R rows (S: one chunk)."""
    if groups * rows <= 2 * MLP_CHUNK_ROWS:
        return groups
    return max([g for g in range(1, groups + 1) if groups % g == 0 and g * rows <= MLP_CHUNK_ROWS], default=1)


def output_and_mlp_in_chunks(block: Block, lp: Weights, h: jax.Array, attn: jax.Array) -> jax.Array:
    """Block.output_and_mlp of rows h [S, R, D] and attention outputs attn [S, R, H*Dh],
    in chunks of mlp_chunk_groups(S, R) groups. The chunks are unrolled slices, not a loop:
    with a lax.map around them the xla backend's compiled temporaries at 32 slots measured
    6.53 GiB on the H200 (2.17 GiB unchunked, 1.70 GiB unrolled). Every op of it is row-wise,
    so the result is the same."""
    S, R = h.shape[:2]
    per_chunk = mlp_chunk_groups(S, R)
    if per_chunk == S:
        return block.apply(lp, h, attn, method=Block.output_and_mlp)
    return jnp.concatenate(
        [
            block.apply(lp, h[g : g + per_chunk], attn[g : g + per_chunk], method=Block.output_and_mlp)
            for g in range(0, S, per_chunk)
        ]
    )


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """Static description of a pass.

    max_len: L, cache rows per slot.
    kernels: which ops run as Pallas kernels (default: none, pure XLA).
    score_scale: factor applied to the summed raw logits of the score rows (1 / (W * H) for
      Flash-Cache's mean over window rows and heads); None = no tracking scores.
    mesh: the device mesh, if any; only the Pallas kernels need it (to run on each device's
      heads), the XLA ops are split by GSPMD.
    """

    max_len: int
    kernels: Kernels = Kernels()
    score_scale: float | None = None
    mesh: Mesh | None = None


@dataclasses.dataclass(frozen=True)
class VerifyKeys:
    """Extra inputs of the read-only verify pass.

    key_exclude: bool [S, L], cached keys the group must not read (their rows are in the query).
    extra_mask: bool [S, R, R], which in-query rows each query row may attend to.
    """

    key_exclude: jax.Array
    extra_mask: jax.Array


def _xla_layer_attention(config, spec, q, k_cache, v_cache, layer, group_slot, key_len, score_rows, verify, extra_kv):
    """The XLA path's attention: chunked over keys, never a full score tensor (chunked_attention)."""
    S, R = q.shape[:2]
    slots = jnp.arange(S, dtype=jnp.int32) if group_slot is None else group_slot
    key_exclude = extra = None
    if verify is not None:
        k_extra, v_extra = extra_kv
        key_exclude = verify.key_exclude
        extra = (k_extra.reshape(S, R, -1), v_extra.reshape(S, R, -1), verify.extra_mask)

    invariant = spec.kernels.invariant

    def attend(q, slots, key_len, score_rows, key_exclude, extra):
        return chunked_cache_attention(
            q,
            k_cache,
            v_cache,
            layer,
            slots,
            key_len,
            score_rows,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            max_len=spec.max_len,
            key_exclude=key_exclude,
            extra=extra,
            block_sizes=INVARIANT_BLOCK_K if invariant else None,
        )

    args = (
        q.reshape(S, R, -1),
        slots,
        key_len,
        score_rows if spec.score_scale is not None else None,
        key_exclude,
        extra,
    )
    # batch-invariant: one group at a time and a fixed key chunk, so that neither the number
    # of groups nor max_len (the prompt bucket) changes a row's online-softmax order
    out, scores = map_groups(attend, *args) if invariant else attend(*args)
    return out, (scores if spec.score_scale is not None else None)


def cached_forward(
    config: ModelConfig,
    spec: PassSpec,
    params: Weights,
    cache: FlatCache,
    tokens: jax.Array,
    positions: jax.Array,
    row_valid: jax.Array,
    group_slot: jax.Array | None,
    key_len: jax.Array,
    candidate_rows: jax.Array,
    score_rows: jax.Array | None = None,
    verify: VerifyKeys | None = None,
    taps: bool = False,
) -> tuple[jax.Array, jax.Array | None, FlatCache] | tuple[jax.Array, jax.Array | None, FlatCache, dict]:
    """Runs the model on the query rows over the cache.

    Args:
      tokens, positions: int32 [S, R] input token and rotary position of each query row.
      row_valid: bool [S, R]; invalid rows write to their slot's trash row, outputs unused.
      group_slot: int32 [S] slot of each group, or None when group s is slot s (S = slots).
      key_len: int32 [S] number of key positions of each group's slot.
      candidate_rows: int32 [S, C] rows whose logits are returned.
      score_rows: bool [S, R] rows feeding the tracking score (when spec.score_scale is set).
      verify: read-only pass (Flash-Verify): the rows' K/V are not written to the cache;
        instead each row attends to the allowed cached keys plus the allowed in-query rows.
      taps: a debug pass: also return the intermediates, {"embed": [S, R, D], "layers":
        {name: [NL, S, R, ...]} (batch_invariance.LAYER_TAP_ORDER), "logits": [S, C, V]}.
    Returns:
      logits [S, C, V] (model dtype), scores float32 [S, L] or None, the updated cache
      (and the taps when asked).
    """
    S, R = tokens.shape
    slots = jnp.arange(S, dtype=jnp.int32) if group_slot is None else group_slot
    rows = flat_rows(slots, positions, row_valid, spec.max_len)
    block = Block(config, pass_producers(config, spec))
    model = Transformer(config)
    h = h_embed = model.apply({"params": params}, tokens, method=Transformer.embed)
    layers = params["layers"]
    per_layer = isinstance(layers, (list, tuple))
    if spec.kernels.qkv or spec.kernels.attention or spec.kernels.scatter:
        from dllm_jax.runtime.kernel_routing import pallas_layer_attention, pallas_qkv_to_cache, pallas_scatter_kv
    if per_layer and spec.kernels.qkv:
        raise ValueError("the fused projection kernel reads layer-stacked weights; use stacked params")
    if spec.kernels.qkv and config.quantization != "none":
        raise ValueError(
            f"the fused projection kernel reads {config.dtype} kernels, not quantization={config.quantization!r}: "
            "use backend 'auto' or 'xla'"
        )
    # q/k/v computed and written to the cache inside one kernel (no k, v of their own)
    fused_qkv = spec.kernels.qkv and verify is None
    fused_fp8 = verify is None and fused_fp8_qkv(config, spec, S * R)

    def ops(layer_taps: LayerTaps | None = None):
        """The contexts every model call runs in: tap recording (outermost), invariant matmuls and norms."""
        stack = contextlib.ExitStack()
        if layer_taps is not None:
            stack.enter_context(layer_taps.recording())
        if spec.kernels.invariant:
            stack.enter_context(invariant_ops(spec.kernels))
        return stack

    def layer_step(carry, lp, layer):
        """One block; lp: this layer's params; layer: its index (int32 when scanned).
        Returns the carry and the layer's taps ({} unless taps)."""
        layer_taps = LayerTaps() if taps else None
        h, k_cache, v_cache, scores = carry
        lp = {"params": lp}
        with ops(layer_taps):
            x = block.apply(lp, h, method=Block.attention_input)
        extra_kv = None
        if fused_qkv:
            q, k_cache, v_cache = pallas_qkv_to_cache(config, spec, layers, x, positions, rows, k_cache, v_cache, layer)
        elif fused_fp8:
            weights = lp["params"] if per_layer else layers
            q, k_cache, v_cache = fp8_qkv_to_cache(config, spec, weights, x, positions, rows, k_cache, v_cache, layer)
        else:
            with ops(layer_taps):
                q, k, v = block.apply(lp, x, positions, method=Block.project_qkv)
            if verify is not None:
                extra_kv = (k, v)
            elif spec.kernels.scatter:
                k_cache, v_cache = pallas_scatter_kv(spec, k_cache, v_cache, k, v, rows, layer)
            else:
                k_cache = k_cache.at[layer, rows].set(k.reshape(S, R, -1))
                v_cache = v_cache.at[layer, rows].set(v.reshape(S, R, -1))
        if spec.kernels.attention:
            out, layer_scores = pallas_layer_attention(
                config, spec, q, k_cache, v_cache, layer, group_slot, key_len, score_rows, verify, extra_kv
            )
        else:
            out, layer_scores = _xla_layer_attention(
                config, spec, q, k_cache, v_cache, layer, group_slot, key_len, score_rows, verify, extra_kv
            )
        if scores is not None and not (per_layer and layer < SCORE_START_LAYER):
            scores = scores + jnp.where(layer >= SCORE_START_LAYER, layer_scores, 0.0)
        with ops(layer_taps):
            if layer_taps is None and not spec.kernels.attention:
                h = output_and_mlp_in_chunks(block, lp, h, out.reshape(S, R, -1))
            else:  # taps record inside the block's methods: one piece, one record per name
                h = block.apply(lp, h, out.reshape(S, R, -1), method=Block.output_and_mlp)
        if layer_taps is None:
            return (h, k_cache, v_cache, scores), {}
        for name, value in (
            ("q", q),
            ("k", None if fused_qkv or fused_fp8 else k),
            ("v", None if fused_qkv or fused_fp8 else v),
            ("attention", out),
            ("attention_scores", layer_scores),
            ("residual", h),
        ):
            layer_taps.put(name, value)
        return (h, k_cache, v_cache, scores), {
            n: layer_taps.values[n] for n in LAYER_TAP_ORDER if n in layer_taps.values
        }

    carry = (h, cache.k, cache.v, None if spec.score_scale is None else jnp.zeros((S, spec.max_len), jnp.float32))
    if per_layer:
        # separate arrays per layer, unrolled: no layer's weights are sliced (copied) out of a stack
        per_layer_taps = []
        for layer, lp in enumerate(layers):
            carry, layer_tap = layer_step(carry, lp, layer)
            per_layer_taps.append(layer_tap)
        stacked_taps = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_layer_taps)
    else:

        def scan_step(carry, layer):
            return layer_step(carry, jax.tree_util.tree_map(lambda w: w[layer], layers), layer)

        carry, stacked_taps = jax.lax.scan(scan_step, carry, jnp.arange(config.n_layers, dtype=jnp.int32))
    h, k_cache, v_cache, scores = carry
    # [S, C, D] -> [S, C, V]: the LM head runs on candidate rows only
    h_candidates = jnp.take_along_axis(h, candidate_rows[:, :, None], axis=1)
    with ops():
        logits = model.apply({"params": params}, h_candidates, method=Transformer.logits)
    if scores is not None:
        scores = scores * spec.score_scale
    if taps:
        return (
            logits,
            scores,
            FlatCache(k=k_cache, v=v_cache),
            {"embed": h_embed, "layers": stacked_taps, "logits": logits},
        )
    return logits, scores, FlatCache(k=k_cache, v=v_cache)
