"""The online-softmax (flash attention) state and its update for one chunk of keys, in pure jnp.

Shared by the bodies that carry the running state as values: the Triton cache-attention
kernel (a [BQ] state per query tile) and the XLA chunked attention (a [S, KVH, G, R] state).
The state is (running max m, denominator l, float32 accumulator acc) over any leading row
shape; the keys are the last axis of the logits. Each caller multiplies P by V itself, the
one step that depends on its layout (a tile's jnp.dot, an einsum over groups and heads). The
TPU kernel keeps its state in [BQ, 1] VMEM scratch refs (Mosaic wants 2-D values) and updates
them in place, so it writes the same arithmetic on those refs.

Rows start at MASKED_LOGIT, a finite stand-in for -inf: a row with no visible key stays finite
(exp(MASKED - MASKED) = 1 over zeroed values gives 0, and l = 0 marks it), never NaN. Where
visibility differs between the rows of a chunk (a per-row first key, an in-query key mask),
a key one row sees and another does not holds real values, so the caller passes ``visible``:
the hidden keys' p is then exactly 0, and a row that has seen no key keeps l = 0 and acc = 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import MASKED_LOGIT

State = tuple[jax.Array, jax.Array, jax.Array]


def initial_state(rows: tuple[int, ...], head_dim: int) -> State:
    """The state before any key: m at MASKED_LOGIT, l = 0 (float32 `rows` each), acc = 0
    (float32 rows + (head_dim,))."""
    return (
        jnp.full(rows, MASKED_LOGIT, jnp.float32),
        jnp.zeros(rows, jnp.float32),
        jnp.zeros(rows + (head_dim,), jnp.float32),
    )


def online_softmax_weights(
    m: jax.Array, l: jax.Array, logits: jax.Array, visible: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The softmax part of one chunk's update; the caller adds the chunk's P.V to its
    accumulator as ``acc * alpha[..., None] + p.astype(v.dtype) @ v`` (its own product over
    its own layout, float32 results; P is rounded to the values' dtype, as the published
    kernels do).

    Args:
      m, l: float32 [*rows], the running max and denominator.
      logits: float32 [*rows, K], hidden keys at MASKED_LOGIT.
      visible: optional bool [*rows, K]; False forces p to 0 (None: hidden keys rely on zeroed
        values and on a later visible key rescaling them away, see the module doc).
    Returns:
      (m_new, l_new float32 [*rows], alpha float32 [*rows], the factor that rescales the old
      accumulator, p float32 [*rows, K], the chunk's probabilities relative to m_new).
    """
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(logits - m_new[..., None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    return m_new, l * alpha + jnp.sum(p, axis=-1), alpha, p
