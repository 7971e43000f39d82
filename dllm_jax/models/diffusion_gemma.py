"""DiffusionGemma's network (the text model of google/diffusiongemma-26B-A4B-it), in Flax.

One Gemma 4 mixture-of-experts stack run in two modes that share every weight:
- ``encode``: causal over new prefix tokens (the prompt, then each finished canvas); writes the
  tokens' keys and values into the ``EncoderCache`` at their positions.
- ``decode``: the canvas rows, bidirectional among themselves and over the cache (read, never
  written); the canvas embeddings pass through self-conditioning on the previous step's logits.

A layer (``DiffusionGemmaLayer``) = RMSNorm -> q/k/v projections, per-head RMSNorm of q and k
(with weights) and of v (without), RoPE of the layer's kind -> attention with scale 1 -> o_proj
-> RMSNorm -> residual; then, from that residual, a dense GELU MLP and the routed experts
(dllm_jax.models.experts) side by side, each between its own norms, summed, normed, added to
the residual and multiplied by the layer's scalar (the encoder and decoder layers each have
their own). Sliding layers see a window of keys (see DiffusionGemmaConfig.sliding_window); full
layers see every key, have wider heads and fewer kv heads, and take v from the k projection.
Embeddings are scaled by sqrt(D); the LM head is the tied embedding; logits are soft-capped.

Parameter tree (``params``; the layers of each kind stacked on a leading axis, or a tuple of
per-layer trees as ``unstack_layers`` makes them)::

  embed_tokens/embedding                [V, D]
  sliding_layers/..., full_layers/...   one DiffusionGemmaLayer each, stacked [N_kind, ...]:
    input_layernorm/weight [D]; q_proj/kernel [D, H*Dh]; k_proj/kernel [D, KVH*Dh];
    v_proj/kernel [D, KVH*Dh] (sliding only); o_proj/kernel [H*Dh, D]; q_norm/weight [Dh];
    k_norm/weight [Dh]; post_attention_layernorm/weight; pre_feedforward_layernorm/weight;
    mlp/{gate_proj,up_proj}/kernel [D, F]; mlp/down_proj/kernel [F, D];
    post_feedforward_layernorm_1/weight; router/{proj/kernel [D, E], scale [D],
    per_expert_scale [E]}; pre_feedforward_layernorm_2/weight; experts/gate_up_proj [E, 2Fe, D];
    experts/down_proj [E, D, Fe]; post_feedforward_layernorm_2/weight;
    post_feedforward_layernorm/weight; layer_scalar [1]; encoder_layer_scalar [1]
  norm/weight                           [D]
  self_conditioning/{pre_norm/weight [D], gate_proj/kernel [D, F], up_proj/kernel [D, F],
                     down_proj/kernel [F, D]}

With config.quantization "fp8" or "int8-weights" (dllm_jax.models.quantization), each layer's
q/k/v/o projections and mlp's three hold ``qkernel`` [out, in] (8-bit) and ``scale`` [out]
instead of ``kernel``, and experts/gate_up_proj and experts/down_proj are each
{qkernel [E, out, in] (8-bit), scale [E, out]}; the router, the norms, self-conditioning and the
(tied) embedding stay in the model dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dllm_jax.models.diffusion_gemma_config import STACKS, AttentionKind, DiffusionGemmaConfig
from dllm_jax.models.experts import ExpertMLP, Experts, Router
from dllm_jax.models.gemma_layers import GatedMLP, GemmaRMSNorm, HeadNormRope, HeadRMSNorm, gelu_tanh, rms_normalize
from dllm_jax.models.layers import INIT, Linear, dot_inputs
from dllm_jax.models.quantization import quantize_params
from pallas_kernels.attention.reference import dense_attention
from pallas_kernels.sampling.inverse_cdf import soft_cap

Weights = Any
# the MoE block's three post-norms, as moe_output takes their weights: the dense MLP's, the
# experts', the block's
MOE_POST_NORMS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "post_feedforward_layernorm")
# (rows [T, D], dense MLP output [T, D], the experts' normed rows [T, D], routing weights float32
# [T, K], experts int32 [T, K], gate_up, down, the MOE_POST_NORMS' weights [D] each, the rows'
# layer scalars [T], *, eps) -> the layer's output rows [T, D]:
# (rows + norm(norm(dense) + norm(experts' sum))) * scalar, as output_and_mlp computes it
MoEOutput = Callable[..., jax.Array]
# Past this many rows the dots that share an input (q/k/v, the dense MLP's and
# self-conditioning's gate/up) read it apart (layers.dot_inputs), so XLA:GPU's DotMerger does not
# concatenate their weights on every step (1.1 ms of copies in the 32-slot 26B-A4B step on the
# H100, 2026-12-07-h, and 1.8 ms of slice copies for the head-norm kernel's operands). None
# (always merged) until timed in the step: diffusion_gemma_engine.py --merged-dots-max-rows 256
MERGED_DOTS_MAX_ROWS: int | None = None


class DiffusionGemmaLayer(nn.Module):
    """One layer of the given attention kind; rows are [..., T, D] in config.dtype.

    The methods are the pieces around attention, which the caller supplies (over the cache in
    ``encode``, over the cache plus the canvas in ``decode``). expert_mlp: what computes the
    routed experts (None: experts.grouped_expert_mlp; a mesh's, dllm_jax.runtime.expert_sharding).
    head_norm: what norms q, k and v per head and rotates q and k (gemma_layers.HeadRMSNorm's
    kernel; None: XLA). moe_output: what computes the routed experts and the block's end from
    them in one function (MoEOutput; None: the experts by expert_mlp, the post-norms by XLA).
    """

    config: DiffusionGemmaConfig
    kind: AttentionKind
    expert_mlp: ExpertMLP | None = None
    head_norm: HeadNormRope | None = None
    moe_output: MoEOutput | None = None

    def setup(self):
        c, kind = self.config, self.kind
        dt, eps = c.jnp_dtype, c.rms_norm_eps
        heads, head_dim, kv = c.n_heads, c.head_dim(kind), c.kv_heads(kind) * c.head_dim(kind)
        q = c.quantization
        self.input_layernorm = GemmaRMSNorm(eps, dt)
        self.q_proj = Linear(heads * head_dim, dt, q)
        self.k_proj = Linear(kv, dt, q)
        if kind is AttentionKind.SLIDING:
            self.v_proj = Linear(kv, dt, q)
        self.o_proj = Linear(c.d_model, dt, q)
        self.q_norm = HeadRMSNorm(eps, dt, kernel=self.head_norm)
        self.k_norm = HeadRMSNorm(eps, dt, kernel=self.head_norm)
        self.v_norm = HeadRMSNorm(eps, dt, with_scale=False, kernel=self.head_norm)
        self.post_attention_layernorm = GemmaRMSNorm(eps, dt)
        self.pre_feedforward_layernorm = GemmaRMSNorm(eps, dt)
        self.mlp = GatedMLP(c.mlp_hidden_size, c.d_model, dt, q, MERGED_DOTS_MAX_ROWS)
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(eps, dt)
        self.router = Router(c.n_experts, c.top_k_experts, eps, dt)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(eps, dt)
        self.experts = Experts(c.n_experts, c.d_model, c.expert_hidden_size, dt, q, self.expert_mlp)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(eps, dt)
        self.post_feedforward_layernorm = GemmaRMSNorm(eps, dt)
        self.layer_scalar = self.param("layer_scalar", nn.initializers.ones, (1,), dt)
        self.encoder_layer_scalar = self.param("encoder_layer_scalar", nn.initializers.ones, (1,), dt)

    def project_qkv(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Residual rows h [..., T, D] and positions int [..., T] -> q [..., T, H, Dh] and k, v
        [..., T, KVH, Dh] in config.dtype: normed per head, q and k rotated (in float32)."""
        c, kind = self.config, self.kind
        head_dim = c.head_dim(kind)
        x = self.input_layernorm(h)
        lead = x.shape[:-1]
        sliding = kind is AttentionKind.SLIDING
        xq, xk, *xv = dot_inputs(x, 3 if sliding else 2, MERGED_DOTS_MAX_ROWS)
        # [..., T, Dh / 2]: one angle per row and frequency, shared by the heads
        angles = positions.astype(jnp.float32)[..., None] * c.rope(kind).inverse_frequencies(head_dim)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        q = self.q_norm(self.q_proj(xq).reshape(*lead, c.n_heads, head_dim), cos, sin)
        k_raw = self.k_proj(xk).reshape(*lead, c.kv_heads(kind), head_dim)
        v_raw = self.v_proj(xv[0]).reshape(k_raw.shape) if sliding else k_raw
        return q, self.k_norm(k_raw, cos, sin), self.v_norm(v_raw)

    def output_and_mlp(self, h: jax.Array, attn: jax.Array, encoder: bool | jax.Array) -> jax.Array:
        """Residual rows h [..., T, D] and attention output [..., T, H*Dh] -> the layer's
        output rows; ``encoder`` picks the encoder's layer scalar (else the decoder's): a bool
        for all rows, or a bool array broadcast against h (e.g. [B, 1, 1], one per group of rows)."""
        h = h + self.post_attention_layernorm(self.o_proj(attn))
        mlp_out = self.mlp(self.pre_feedforward_layernorm(h))
        # [T', D]: the experts see the rows flat; the router reads the residual before any norm
        rows = h.reshape(-1, h.shape[-1])
        weights, experts = self.router(rows)
        expert_rows = self.pre_feedforward_layernorm_2(rows)
        if isinstance(encoder, bool):
            scalar = self.encoder_layer_scalar if encoder else self.layer_scalar
        else:
            scalar = jnp.where(encoder, self.encoder_layer_scalar, self.layer_scalar)
        if self.moe_output is None or self.is_initializing():
            dense = self.post_feedforward_layernorm_1(mlp_out)
            routed = self.experts(expert_rows, weights, experts).reshape(h.shape)
            return (h + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))) * scalar
        # the post-norms' weights, read from the params: their modules are not called here
        norms = self.variables["params"]
        out = self.moe_output(
            rows,
            mlp_out.reshape(rows.shape),
            expert_rows,
            weights,
            experts,
            self.experts.gate_up_proj,
            self.experts.down_proj,
            *(norms[name]["weight"] for name in MOE_POST_NORMS),
            jnp.broadcast_to(scalar, (*h.shape[:-1], 1)).reshape(-1),
            eps=self.config.rms_norm_eps,
        )
        return out.reshape(h.shape)

    def __call__(self, h: jax.Array, positions: jax.Array) -> jax.Array:
        """The layer over rows [B, T, D] that attend only to each other, bidirectionally (the
        decoder over an empty cache)."""
        q, k, v = self.project_qkv(h, positions)
        return self.output_and_mlp(h, dense_attention(q, k, v, jnp.ones((), bool), scale=1.0), encoder=False)


class SelfConditioning(nn.Module):
    """post_norm(embeddings + MLP(pre_norm(soft embeddings))), post_norm without a weight."""

    config: DiffusionGemmaConfig

    @nn.compact
    def __call__(self, embeddings: jax.Array, soft_embeddings: jax.Array) -> jax.Array:
        c = self.config
        dt = c.jnp_dtype
        x = GemmaRMSNorm(c.rms_norm_eps, dt, name="pre_norm")(soft_embeddings)
        x_gate, x_up = dot_inputs(x, 2, MERGED_DOTS_MAX_ROWS)
        gate = Linear(c.mlp_hidden_size, dt, name="gate_proj")(x_gate)
        up = Linear(c.mlp_hidden_size, dt, name="up_proj")(x_up)
        signal = Linear(c.d_model, dt, name="down_proj")(gelu_tanh(gate) * up)
        return rms_normalize(embeddings + signal, c.rms_norm_eps)


@struct.dataclass
class EncoderCache:
    """The encoder's keys and values of every position before the canvas.

    keys, values: per attention kind (its value string), [N_kind, B, S, KVH, Dh] in the model
      dtype; layer j of the kind's stack at [j]; position p at [:, :, p] (RoPE'd keys, normed
      values).
    valid: bool [B, S]; False for padding tokens (never attended) and unfilled positions.
    length: int32 []; positions [0, length) are filled (the next token's position).
    """

    keys: dict[str, jax.Array]
    values: dict[str, jax.Array]
    valid: jax.Array
    length: jax.Array


def init_cache(config: DiffusionGemmaConfig, batch: int, max_length: int) -> EncoderCache:
    """An empty cache of max_length positions (zeros, never uninitialised memory)."""
    shapes = {
        kind.value: (config.layers_of(kind), batch, max_length, config.kv_heads(kind), config.head_dim(kind))
        for kind in AttentionKind
        if config.layers_of(kind)
    }
    zeros = {name: jnp.zeros(shape, config.jnp_dtype) for name, shape in shapes.items()}
    return EncoderCache(
        keys=zeros, values=dict(zeros), valid=jnp.zeros((batch, max_length), bool), length=jnp.zeros((), jnp.int32)
    )


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: DiffusionGemmaConfig, rng: jax.Array) -> Weights:
    """Random parameters (normal(0.02) matrices, unit norm weights and scalars) in config.dtype,
    then quantized as config.quantization says. One compiled program per config (eagerly, each
    parameter's draw would be compiled and run on its own)."""
    plain = dataclasses.replace(config, quantization="none")
    return quantize_params(_init_plain_params(plain, rng), config.quantization)


def _init_plain_params(config: DiffusionGemmaConfig, rng: jax.Array) -> Weights:
    dt = config.jnp_dtype
    rng_embed, rng_layers, rng_sc = jax.random.split(rng, 3)
    h = jnp.zeros((1, 2, config.d_model), dt)
    positions = jnp.zeros((1, 2), jnp.int32)
    params: dict[str, Any] = {"embed_tokens": {"embedding": INIT(rng_embed, (config.vocab_size, config.d_model), dt)}}
    for kind, kind_rng in zip(AttentionKind, jax.random.split(rng_layers, len(AttentionKind))):
        count = config.layers_of(kind)
        if count:
            layer = DiffusionGemmaLayer(config, kind)
            init_one = lambda r, layer=layer: layer.init(r, h, positions)["params"]  # noqa: E731
            params[STACKS[kind]] = jax.vmap(init_one)(jax.random.split(kind_rng, count))
    params["norm"] = {"weight": jnp.ones((config.d_model,), dt)}
    params["self_conditioning"] = SelfConditioning(config).init(rng_sc, h, h)["params"]
    return params


def abstract_params(config: DiffusionGemmaConfig) -> Weights:
    """The parameter tree as jax.ShapeDtypeStruct leaves, without allocating."""
    return jax.eval_shape(lambda rng: init_params(config, rng), jax.random.key(0))


def count_params(params: Weights) -> int:
    """Number of parameters of a (possibly abstract) tree."""
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params))


def active_params_per_token(config: DiffusionGemmaConfig, params: Weights) -> int:
    """Parameters one token's forward pass reads: all but the experts it is not routed to."""
    experts = [params[STACKS[kind]]["experts"] for kind in AttentionKind if STACKS[kind] in params]
    expert_params = count_params(experts)
    return count_params(params) - expert_params * (config.n_experts - config.top_k_experts) // config.n_experts


def unstack_layers(params: Weights) -> Weights:
    """params with each layer stack as a tuple of per-layer trees (copies of the slices), so an
    unrolled layer loop reads each layer's weights without slicing the stack every call."""
    out = dict(params)
    for name in STACKS.values():
        stack = params.get(name)
        if stack is not None and not isinstance(stack, (list, tuple)):
            count = jax.tree_util.tree_leaves(stack)[0].shape[0]
            out[name] = tuple(jax.tree_util.tree_map(lambda w, i=i: w[i], stack) for i in range(count))
    return out


def layer_params(config: DiffusionGemmaConfig, params: Weights, layer: int) -> Weights:
    """Layer ``layer``'s parameter tree, from a stacked or unstacked params tree."""
    stack = params[STACKS[config.layer_types[layer]]]
    index = config.stack_index(layer)
    if isinstance(stack, (list, tuple)):
        return stack[index]
    return jax.tree_util.tree_map(lambda w: w[index], stack)


def embed(config: DiffusionGemmaConfig, params: Weights, tokens: jax.Array) -> jax.Array:
    """int tokens [...] -> rows [..., D]: the embedding times sqrt(D) (the factor in the model dtype)."""
    table = params["embed_tokens"]["embedding"]
    return jnp.take(table, tokens, axis=0) * _embed_scale(config)


def soft_embeddings(config: DiffusionGemmaConfig, params: Weights, logits: jax.Array) -> jax.Array:
    """Self-conditioning input: softmax(logits) (float32, rounded to the model dtype) times the
    embedding table, times sqrt(D). logits [..., V] -> [..., D]."""
    table = params["embed_tokens"]["embedding"]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(table.dtype)
    return embed_probabilities(config, params, probs)


def embed_probabilities(config: DiffusionGemmaConfig, params: Weights, probs: jax.Array) -> jax.Array:
    """probs [..., V] in the model dtype (soft_embeddings' softmax, or the canvas sampler
    kernel's) times the embedding table, times sqrt(D): [..., D] in the model dtype."""
    table = params["embed_tokens"]["embedding"]
    return jnp.dot(probs, table, preferred_element_type=jnp.float32).astype(table.dtype) * _embed_scale(config)


def _embed_scale(config: DiffusionGemmaConfig) -> jax.Array:
    # sqrt(D) as a float32 rounded to the model dtype (transformers' buffer: 55.4256 -> 55.5 in bf16)
    return jnp.asarray(np.float32(config.d_model**0.5), config.jnp_dtype)


def head_logits(
    config: DiffusionGemmaConfig, params: Weights, h: jax.Array, *, float32_result: bool = True
) -> jax.Array:
    """Final norm and the tied LM head, before the soft-cap: [..., D] -> [..., V] in the model dtype.

    float32_result: the GEMM writes float32, then rounded to the model dtype (as transformers);
    else it writes the model dtype itself (the same rounding of the same float32 accumulation
    up to its order, and no separate conversion pass over [..., V]).
    """
    x = rms_normalize(h, config.rms_norm_eps, params["norm"]["weight"])
    table = params["embed_tokens"]["embedding"]
    if float32_result:
        return jnp.dot(x, table.T, preferred_element_type=jnp.float32).astype(table.dtype)
    return jnp.dot(x, table.T, preferred_element_type=table.dtype)


def final_logits(config: DiffusionGemmaConfig, params: Weights, h: jax.Array) -> jax.Array:
    """Final norm, tied LM head (rounded to the model dtype) and soft-cap: [..., D] -> float32 [..., V]."""
    return soft_cap(head_logits(config, params, h).astype(jnp.float32), config.final_logit_softcap)


def encode(
    config: DiffusionGemmaConfig,
    params: Weights,
    tokens: jax.Array,
    cache: EncoderCache,
    token_valid: jax.Array | None = None,
    *,
    return_hidden: bool = False,
):
    """The encoder over new tokens, written into the cache after its ``length`` positions.

    Query row i (position length + i) attends causally: to the valid keys at positions <= its
    own, and in sliding layers only to the last sliding_window of them.

    Args:
      tokens: int [B, T].
      cache: holds positions [0, cache.length); needs room for T more.
      token_valid: bool [B, T]; False marks padding (left padding of a batch of prompts).
      return_hidden: also return the residual rows after the embedding and after each layer.
    Returns:
      (cache with the T positions filled, final-normed rows [B, T, D]), plus the list of
      n_layers + 1 residual row arrays [B, T, D] when return_hidden.
    """
    B, T = tokens.shape
    start = cache.length
    if token_valid is None:
        token_valid = jnp.ones((B, T), bool)
    positions = start + jnp.arange(T, dtype=jnp.int32)
    valid = jax.lax.dynamic_update_slice(cache.valid, token_valid, (0, start))
    key_positions = jnp.arange(cache.valid.shape[1], dtype=jnp.int32)
    # [B, T, S] True = may attend
    causal = valid[:, None, :] & (key_positions[None, :] <= positions[:, None])[None]
    masks = {
        AttentionKind.FULL: causal,
        AttentionKind.SLIDING: causal & (key_positions[None, :] > positions[:, None] - config.sliding_window),
    }
    keys, values = dict(cache.keys), dict(cache.values)
    h = embed(config, params, tokens)
    hidden = [h]
    row_positions = jnp.broadcast_to(positions, (B, T))
    for layer in range(config.n_layers):
        kind = config.layer_types[layer]
        module = DiffusionGemmaLayer(config, kind)
        variables = {"params": layer_params(config, params, layer)}
        q, k, v = module.apply(variables, h, row_positions, method=DiffusionGemmaLayer.project_qkv)
        j, name = config.stack_index(layer), kind.value
        keys[name] = jax.lax.dynamic_update_slice(keys[name], k[None], (j, 0, start, 0, 0))
        values[name] = jax.lax.dynamic_update_slice(values[name], v[None], (j, 0, start, 0, 0))
        attn = dense_attention(q, keys[name][j], values[name][j], masks[kind], scale=1.0)
        h = module.apply(variables, h, attn, True, method=DiffusionGemmaLayer.output_and_mlp)
        hidden.append(h)
    cache = cache.replace(keys=keys, values=values, valid=valid, length=start + T)
    out = rms_normalize(h, config.rms_norm_eps, params["norm"]["weight"])
    return (cache, out, hidden) if return_hidden else (cache, out)


def decode(
    config: DiffusionGemmaConfig,
    params: Weights,
    canvas: jax.Array,
    cache: EncoderCache,
    self_conditioning_logits: jax.Array | None = None,
    self_conditioning_mask: jax.Array | None = None,
    *,
    return_hidden: bool = False,
):
    """The decoder over one canvas at positions [cache.length, cache.length + L).

    Every canvas row attends to every canvas row and to the valid cached keys: all of them in
    full layers, the last sliding_window - 1 positions in sliding layers. The cache is read only.

    Args:
      canvas: int [B, L].
      self_conditioning_logits: float [B, L, V], the previous step's (processed) logits, or
        None (the first step: a zero signal).
      self_conditioning_mask: bool [B]; rows where it is False get the zero signal.
      return_hidden: also return the residual rows after self-conditioning and after each layer.
    Returns:
      logits float32 [B, L, V] (soft-capped), plus the hidden list when return_hidden.
    """
    B, L = canvas.shape
    start = cache.length
    positions = jnp.broadcast_to(start + jnp.arange(L, dtype=jnp.int32), (B, L))
    key_positions = jnp.arange(cache.valid.shape[1], dtype=jnp.int32)
    cached = cache.valid & (key_positions < start)[None]
    window = cached & (key_positions >= start - (config.sliding_window - 1))[None]
    canvas_keys = jnp.ones((B, L, L), bool)
    # [B, L, S + L] True = may attend: the cached keys, then the canvas
    masks = {
        kind: jnp.concatenate([jnp.broadcast_to(m[:, None, :], (B, L, m.shape[1])), canvas_keys], axis=-1)
        for kind, m in ((AttentionKind.FULL, cached), (AttentionKind.SLIDING, window))
    }
    embeddings = embed(config, params, canvas)
    if self_conditioning_logits is None:
        soft = jnp.zeros_like(embeddings)
    else:
        soft = soft_embeddings(config, params, self_conditioning_logits)
        if self_conditioning_mask is not None:
            soft = jnp.where(self_conditioning_mask[:, None, None], soft, jnp.zeros_like(soft))
    h = SelfConditioning(config).apply({"params": params["self_conditioning"]}, embeddings, soft)
    hidden = [h]
    for layer in range(config.n_layers):
        kind = config.layer_types[layer]
        module = DiffusionGemmaLayer(config, kind)
        variables = {"params": layer_params(config, params, layer)}
        q, k, v = module.apply(variables, h, positions, method=DiffusionGemmaLayer.project_qkv)
        j, name = config.stack_index(layer), kind.value
        keys = jnp.concatenate([cache.keys[name][j], k], axis=1)
        values = jnp.concatenate([cache.values[name][j], v], axis=1)
        attn = dense_attention(q, keys, values, masks[kind], scale=1.0)
        h = module.apply(variables, h, attn, False, method=DiffusionGemmaLayer.output_and_mlp)
        hidden.append(h)
    logits = final_logits(config, params, h)
    return (logits, hidden) if return_hidden else logits
