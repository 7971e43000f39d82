"""A debug pass for the tracking question: which stale decoded rows hurt the window most.

For every slot about to run a sparse step, and each of its key positions, one exact forward
pass over the slot's whole canvas (what track_num < 0 runs every step) gives the row's exact
K/V and the window's exact queries; the cache holds the K/V the sparse step would use. Per
layer l, window query row r (the candidates' predictor rows), query head h and key i < key_len:

  p[r, h, i]  = softmax_i(q[r, h] . K*[i] / sqrt(Dh))      the exact attention
  attention   = mean_{r, h} p[r, h, i]
  drift       = || (K[i], V[i]) - (K*[i], V*[i]) ||        over all kv heads
  error       = mean_{r, h} || o'[r, h] - o[r, h] ||

where o is the exact attention output and o' the same output with row i alone stale (its
cached K[i], V[i] in place of the exact ones, every other row exact). With s~ = q . K[i] /
sqrt(Dh) and p~ = exp(s~ - logsumexp_j(s_j)), o' = (o - p V*[i] + p~ V[i]) / (1 - p + p~),
so the error of every row comes out of one pass, without a pass per row. It is the error the
row's staleness injects directly, at that layer, into the window's attention output; the
effect it has through the layers above is not in it.

Not part of the decode loop: a jitted function of a DecodeState, called between steps by a
study (scripts/tracking_study.py). It runs the XLA path (it needs the q, k and v taps) and
materialises [layers, W, H, L, Dh] floats per slot: for small models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax.models.logit_alignment import predictor_positions
from dllm_jax.models.transformer import Weights
from dllm_jax.runtime.cached_forward import PassSpec, cached_forward
from dllm_jax.runtime.decode_loop import DecodeLoop, DecodeState


@struct.dataclass
class RowStaleness:
    """Per layer, slot and position, float32 [NL, B, L] (0 outside `rows`): attention, drift
    and error as the module docstring defines them. rows: bool [B, L], the decoded positions
    below key_len of the slots about to run a sparse step (the rows a tracking rule chooses
    from)."""

    attention: jax.Array
    drift: jax.Array
    error: jax.Array
    rows: jax.Array


def _attention_and_error(q, k_exact, v_exact, k_cached, v_cached, key_valid, row_weight, scale):
    """One slot at one layer: q [W, H, Dh]; K/V [L, H, Dh] (kv heads repeated); key_valid [L];
    row_weight [W]: 1 / (valid window rows) for a valid row, else 0. Returns attention and
    error, each float32 [L]: means over the valid window rows and the heads."""
    f32 = jnp.float32
    q, k_exact, v_exact, k_cached, v_cached = (a.astype(f32) for a in (q, k_exact, v_exact, k_cached, v_cached))
    # [W, H, L]
    logits = jnp.where(key_valid, jnp.einsum("rhd,lhd->rhl", q, k_exact) * scale, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - lse)
    out = jnp.einsum("rhl,lhd->rhd", p, v_exact)
    p_stale = jnp.where(key_valid, jnp.exp(jnp.einsum("rhd,lhd->rhl", q, k_cached) * scale - lse), 0.0)
    # [W, H, L, Dh]: o' - o = (p~ (V - o) - p (V* - o)) / (1 - p + p~)
    heads_first = lambda v: jnp.swapaxes(v, 0, 1)[None]  # noqa: E731  [L, H, Dh] -> [1, H, L, Dh]
    change = (
        p_stale[..., None] * (heads_first(v_cached) - out[:, :, None])
        - p[..., None] * (heads_first(v_exact) - out[:, :, None])
    ) / (1.0 - p + p_stale)[..., None]
    mean = lambda a: jnp.einsum("r,rhl->l", row_weight, a) / a.shape[1]  # noqa: E731
    return mean(p), mean(jnp.linalg.norm(change, axis=-1))


def probe_staleness(loop: DecodeLoop, weights: Weights, state: DecodeState) -> RowStaleness:
    """The RowStaleness of the slots whose next step is sparse (jit it with loop static).
    Query head h reads kv head h // (H / KVH), as in the model."""
    config, slots, L = loop.model, state.slots, loop.max_len
    B = slots.tokens.shape[0]
    H, KVH, Dh, NL = config.n_heads, config.n_kv_heads, config.head_dim, config.n_layers
    probed = slots.active & ~slots.needs_full
    pos = jnp.arange(L, dtype=jnp.int32)
    positions = jnp.broadcast_to(pos, (B, L))
    key_valid = pos[None, :] < slots.key_len[:, None]
    candidates, candidate_valid = jax.vmap(loop.policy.candidates)(slots)
    window, window_valid = predictor_positions(candidates, candidate_valid, config.logit_shift)
    _, _, _, taps = cached_forward(
        config,
        PassSpec(max_len=L),
        weights,
        state.cache,
        slots.tokens,
        positions,
        probed[:, None] & key_valid,
        None,
        slots.key_len,
        window,
        taps=True,
    )
    layers = taps["layers"]
    repeat = lambda a: jnp.repeat(a, H // KVH, axis=-2)  # noqa: E731  [..., KVH, Dh] -> [..., H, Dh]
    # [NL, B, W, H, Dh]: the exact queries of the window rows
    q = jnp.take_along_axis(layers["q"], window[None, :, :, None, None], axis=2)
    row_weight = window_valid / jnp.maximum(jnp.sum(window_valid, axis=1, keepdims=True), 1)
    k_cached = state.cache.k.reshape(NL, B, L, KVH, Dh)
    v_cached = state.cache.v.reshape(NL, B, L, KVH, Dh)
    over_layers = jax.vmap(_attention_and_error, in_axes=(0, 0, 0, 0, 0, None, None, None))

    def one_slot(args):
        q, k, v, kc, vc, valid, weight = args
        return over_layers(q, repeat(k), repeat(v), repeat(kc), repeat(vc), valid, weight, Dh**-0.5)

    moved = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731  [NL, B, ...] -> [B, NL, ...]
    attention, error = jax.lax.map(
        one_slot,
        (moved(q), moved(layers["k"]), moved(layers["v"]), moved(k_cached), moved(v_cached), key_valid, row_weight),
    )
    f32 = jnp.float32
    squares = [jnp.square(c.astype(f32) - e.astype(f32)) for c, e in ((k_cached, layers["k"]), (v_cached, layers["v"]))]
    # [NL, B, L]
    drift = jnp.sqrt(jnp.sum(squares[0] + squares[1], axis=(-2, -1)))
    rows = probed[:, None] & key_valid & slots.decoded
    keep = lambda a: jnp.where(rows[None], a, 0.0)  # noqa: E731
    # [B, NL, L] -> [NL, B, L]
    attention, error = jnp.moveaxis(attention, 0, 1), jnp.moveaxis(error, 0, 1)
    return RowStaleness(attention=keep(attention), drift=keep(drift), error=keep(error), rows=rows)
