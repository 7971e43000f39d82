"""Dense bidirectional attention with a boolean mask (the XLA path; runs on every backend)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: a fully masked row yields a uniform (ignored) distribution, not NaN.
MASKED_LOGIT = -1e30


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float | None = None) -> jax.Array:
    """Softmax attention of every query row over the keys its mask allows.

    Grouped-query attention: query head h reads key/value head h // (H // KVH).
    Logits, softmax and the P.V accumulation are float32; P is rounded to v's dtype
    before the P.V product (as the published kernels do).

    Args:
      q: [B, T, H, Dh] RoPE'd queries.
      k, v: [B, S, KVH, Dh] RoPE'd keys and values.
      mask: bool, broadcastable to [B, T, S]; True = the query may attend to the key.
      scale: the logits' factor; default 1 / sqrt(Dh) (1.0 for models that norm q and k).
    Returns:
      [B, T, H * Dh] in q's dtype.
    """
    B, T, H, Dh = q.shape
    kv_heads = k.shape[2]
    groups = H // kv_heads
    # [B, T, KVH, G, Dh]
    qg = q.reshape(B, T, kv_heads, groups, Dh)
    # [B, KVH, G, T, S]
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / Dh**0.5 if scale is None else scale)
    mask = jnp.broadcast_to(mask, (B, T, k.shape[1]))
    logits = jnp.where(mask[:, None, None], logits, MASKED_LOGIT)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H * Dh).astype(q.dtype)
