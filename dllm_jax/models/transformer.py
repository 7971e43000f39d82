"""The bidirectional transformer both families share, as Flax linen modules.

One block = RMSNorm -> q/k/v (+ biases when config.qkv_bias) -> rotate-half RoPE (float32)
-> bidirectional attention (grouped-query when n_kv_heads < n_heads) -> attn_out -> RMSNorm
-> SwiGLU MLP, with residuals. Blocks are stacked with ``nn.scan`` (parameters carry a
leading [n_layers] axis), so 32 layers compile to one loop body. The family files
(llada.py, dream.py) name the family's classes; what differs between families is the config
(biases, GQA, tied head) and the logit alignment (config.logit_shift), which this module's
output does not apply: row i of the logits is the output at position i.

The block's methods are the per-layer pieces the cached decode engine reuses:
``attention_input`` (norm), ``project_qkv`` (projection + RoPE), ``output_and_mlp``;
the engine supplies its own attention (over a flat K/V cache) in between.

Parameter tree (``params`` collection), the same names for every family::

  wte/embedding               [V, D]
  layers/attn_norm/weight     [NL, D]
  layers/{q,k,v}_proj/kernel  [NL, D, H*Dh] (k, v: [NL, D, KVH*Dh])
  layers/{q,k,v}_proj/bias    [NL, H*Dh] (k, v: [NL, KVH*Dh])   (only with qkv_bias)
  layers/attn_out/kernel      [NL, H*Dh, D]
  layers/ff_norm/weight       [NL, D]
  layers/{ff_proj,up_proj}/kernel [NL, D, F]   (ff_proj is the SiLU-gated branch)
  layers/ff_out/kernel        [NL, F, D]
  ln_f/weight                 [D]
  lm_head/kernel              [D, V]  (absent when weight_tying)

With config.quantization set, each of the seven block projections holds ``qkernel`` [NL, out, in]
(8-bit) and ``scale`` [NL, out] instead of ``kernel``, and (unless weight_tying) wte holds
``qembedding`` [V, D] (int8) and ``scale`` [V] instead of ``embedding`` (dllm_jax.models.quantization);
biases stay.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.layers import Embedding, Fp8Producers, Linear, RMSNorm, dot_inputs, swiglu
from dllm_jax.models.quantization import QuantizedRows, quantize_params, quantizes_embedding
from pallas_kernels.attention.reference import dense_attention
from pallas_kernels.projection.rope import apply_rope, rope_cos_sin

Weights = Any  # the model's weights: a nested dict of arrays (Flax's "params" collection)

# Up to this many rows, q/k/v read the same normed rows and XLA:GPU's DotMerger may merge their
# dots (it concatenates the weights of dots that share an input). Past it, each projection reads
# its own copy of the rows (an optimization barrier), so the dots stay apart. At LLaDA-8B shape
# (BENCHMARKS.md, "q/k/v apart past 256 rows"): merged, 128 rows (the 1-slot step) are one Triton
# GEMM reading the weights in place, 1.6% faster than apart on an H100; in the traces of larger
# passes (the 8-slot step, a 1-slot full pass) cuBLAS runs the merged dot and the concatenated
# weights are copied on every call: apart is 4.9% faster at 512 rows, 5.1% at 1024 (8 slots),
# 1.4% at 4096 and 3.3% for a 1-slot full pass of 640 (H200). 256 rows were not measured apart.
MERGED_QKV_MAX_ROWS = 256


class Block(nn.Module):
    """One transformer block. Inputs are [..., T, D] residual rows in config.dtype.

    producers (fp8 models only): the norms and SwiGLU hand their projections rows quantized in
    their own epilogue (layers.Fp8Producers), so attention_input returns QuantizedRows and
    each activation is quantized once (SwiGLU reads the gate and up GEMMs' products before
    their scales, and scales them itself); None: every fp8 projection quantizes its input.
    """

    config: ModelConfig
    producers: Fp8Producers | None = None

    def setup(self):
        c = self.config
        dt = c.jnp_dtype
        self.attn_norm = RMSNorm(c.rms_norm_eps, dt)
        q = c.quantization
        self.q_proj = Linear(c.n_heads * c.head_dim, dt, q, use_bias=c.qkv_bias)
        self.k_proj = Linear(c.kv_dim, dt, q, use_bias=c.qkv_bias)
        self.v_proj = Linear(c.kv_dim, dt, q, use_bias=c.qkv_bias)
        self.attn_out = Linear(c.d_model, dt, q)
        self.ff_norm = RMSNorm(c.rms_norm_eps, dt)
        self.ff_proj = Linear(c.mlp_hidden_size, dt, q)
        self.up_proj = Linear(c.mlp_hidden_size, dt, q)
        self.ff_out = Linear(c.d_model, dt, q)

    def attention_input(self, h: jax.Array) -> jax.Array | QuantizedRows:
        """The pre-attention RMSNorm: [..., T, D] -> [..., T, D] (quantized with producers)."""
        return self.attn_norm(h, self.producers)

    def project_qkv(self, x: jax.Array | QuantizedRows, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Normed rows -> RoPE'd q [..., T, H, Dh], k and v [..., T, KVH, Dh], in config.dtype.

        RoPE is applied to the float32 accumulators (biases added before it) and the result
        rounded once, as the fused kernel does. positions: int [..., T] absolute positions.
        """
        c = self.config
        dt = c.jnp_dtype
        lead = x.shape[:-1]
        xq = xk = xv = x
        if isinstance(x, jax.Array):  # fp8 rows: the merger is off
            xq, xk, xv = dot_inputs(x, 3, MERGED_QKV_MAX_ROWS)
        q = self.q_proj(xq, jnp.float32).reshape(*lead, c.n_heads, c.head_dim)
        k = self.k_proj(xk, jnp.float32).reshape(*lead, c.n_kv_heads, c.head_dim)
        v = self.v_proj(xv, jnp.float32).reshape(*lead, c.n_kv_heads, c.head_dim)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        # [..., T, 1, Dh/2]: one angle per row, shared by all heads
        cos, sin = cos[..., None, :], sin[..., None, :]
        return apply_rope(q, cos, sin).astype(dt), apply_rope(k, cos, sin).astype(dt), v.astype(dt)

    def output_and_mlp(self, h: jax.Array, attn: jax.Array) -> jax.Array:
        """Residual rows h [..., T, D] and attention output [..., T, H*Dh] -> next residual rows."""
        dt = self.config.jnp_dtype
        h = h + self.attn_out(attn).astype(dt)
        x = self.ff_norm(h, self.producers)
        if self.producers is None:
            hidden = swiglu(self.ff_proj(x).astype(dt), self.up_proj(x).astype(dt))
        else:  # the producer applies the GEMMs' scales itself
            hidden = self.producers.swiglu(self.ff_proj(x, unscaled=True), self.up_proj(x, unscaled=True))
        return h + self.ff_out(hidden).astype(dt)

    def __call__(self, h: jax.Array, positions: jax.Array, mask: jax.Array) -> tuple[jax.Array, None]:
        """Full bidirectional block over [B, T, D]; mask broadcastable to [B, T, T]."""
        q, k, v = self.project_qkv(self.attention_input(h), positions)
        return self.output_and_mlp(h, dense_attention(q, k, v, mask)), None


class Transformer(nn.Module):
    """The whole mask predictor: tokens -> output logits of every position (no causal mask)."""

    config: ModelConfig

    def setup(self):
        c = self.config
        dt = c.jnp_dtype
        self.wte = Embedding(c.vocab_size, c.d_model, dt, quantized=quantizes_embedding(c.quantization, c.weight_tying))
        self.layers = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=c.n_layers,
        )(c)
        self.ln_f = RMSNorm(c.rms_norm_eps, dt)
        if not c.weight_tying:
            self.lm_head = Linear(c.vocab_size, dt)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """int tokens [...] -> residual rows [..., D]."""
        return self.wte(tokens)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm and LM head: [..., D] -> [..., V] in config.dtype."""
        x = self.ln_f(h)
        if self.config.weight_tying:
            return self.wte.attend(x).astype(self.config.jnp_dtype)
        return self.lm_head(x)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        key_valid: jax.Array | None = None,
    ) -> jax.Array:
        """Output logits of every position (row i: the output at position i; for a family with
        logit_shift 1 it predicts token i + 1, see dllm_jax.models.predictions).

        Args:
          tokens: int [B, T].
          positions: int [B, T]; default 0..T-1.
          key_valid: bool [B, T]; False marks padding keys nobody attends to. Default all True.
        Returns:
          [B, T, V] logits in config.dtype.
        """
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if key_valid is None:
            key_valid = jnp.ones((B, T), dtype=bool)
        h = self.embed(tokens)
        h, _ = self.layers(h, positions, key_valid[:, None, :])
        return self.logits(h)


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: ModelConfig, rng: jax.Array) -> Weights:
    """Random parameters (normal(0.02) matrices, unit norms, zero biases) in config.dtype,
    then quantized as config.quantization says. One compiled program per config (eagerly, each
    parameter's draw would be compiled and run on its own)."""
    tokens = jnp.zeros((1, 2), dtype=jnp.int32)
    plain = dataclasses.replace(config, quantization="none")
    return quantize_params(Transformer(plain).init(rng, tokens)["params"], config.quantization)


def init_params_per_layer(config: ModelConfig, rng: jax.Array) -> Weights:
    """Random parameters with params["layers"] a tuple of per-layer trees, built layer by layer
    (no layer-stacked copy ever exists: device memory stays at the model's size)."""
    top_rng, *layer_rngs = jax.random.split(rng, config.n_layers + 1)
    top = init_params(dataclasses.replace(config, n_layers=1), top_rng)
    h = jnp.zeros((1, 2, config.d_model), config.jnp_dtype)
    positions = jnp.zeros((1, 2), jnp.int32)
    plain_block = Block(dataclasses.replace(config, quantization="none"))

    def init_block(rng):
        params = plain_block.init(rng, h, positions, jnp.ones((1, 1, 2), bool))["params"]
        return quantize_params({"layers": params}, config.quantization)["layers"]

    init_block = jax.jit(init_block)
    return {**{k: v for k, v in top.items() if k != "layers"}, "layers": tuple(init_block(r) for r in layer_rngs)}


def unstack_layers(params: Weights) -> Weights:
    """params with "layers" as a tuple of per-layer trees (copies of the stacked slices).

    The decode engine unrolls its layer loop over such params, so no layer's weights are
    sliced out of the stack (which XLA does with a copy) at every step.
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n_layers = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return {**params, "layers": tuple(jax.tree_util.tree_map(lambda w: w[i], layers) for i in range(n_layers))}


def abstract_params(config: ModelConfig) -> Weights:
    """The parameter tree as jax.ShapeDtypeStruct leaves, without allocating."""
    return jax.eval_shape(lambda rng: init_params(config, rng), jax.random.key(0))


def count_params(params: Weights) -> int:
    return sum(int(leaf.size) for leaf in jax.tree_util.tree_leaves(params))


def forward(config: ModelConfig, params: Weights, tokens: jax.Array, positions=None, key_valid=None) -> jax.Array:
    """Functional full forward: Transformer(config).apply on the params tree; [B, T, V] output
    logits (not aligned: see predictions)."""
    return Transformer(config).apply({"params": params}, tokens, positions, key_valid)


def predictions(config: ModelConfig, logits: jax.Array) -> jax.Array:
    """Output logits [B, T, V] -> the prediction of every position's token [B, T, V].

    With logit_shift s, position i is predicted by output row i - s; the first s positions
    (never generated: a prompt holds at least one token) repeat row 0, as Dream does.
    """
    s = config.logit_shift
    if s == 0:
        return logits
    return jnp.concatenate([logits[:, :s], logits[:, :-s]], axis=1)
