"""The flat, preallocated K/V cache: one row per (slot, position), allocated once per run.

Layout: ``k``, ``v``: [n_layers, num_slots * max_len, kv_dim] in the model dtype, RoPE'd
keys. Row ``slot * max_len + p`` holds position p of the request in that slot (columns are
head-major: kv head h, dim d at h * head_dim + d). The last position of every slot is its
trash row: padding query rows of that slot write there, and no attention reads it (every
policy keeps key_len <= max_len - 1). Keeping the trash inside the slot keeps a slot's rows
contiguous, so the cache splits evenly across devices by slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax.models.config import ModelConfig


@struct.dataclass
class FlatCache:
    k: jax.Array
    v: jax.Array

    @property
    def nbytes(self) -> int:
        return 2 * self.k.size * self.k.dtype.itemsize


def cache_bytes(config: ModelConfig, num_slots: int, max_len: int) -> int:
    """Bytes of the K and V caches for this many slots of max_len positions."""
    return 2 * config.n_layers * num_slots * max_len * config.kv_dim * config.jnp_dtype.itemsize


def allocate_cache(config: ModelConfig, num_slots: int, max_len: int) -> FlatCache:
    """A zero-filled cache (never jnp.empty: since jax 0.11 it is uninitialised memory)."""
    shape = (config.n_layers, num_slots * max_len, config.kv_dim)
    return FlatCache(k=jnp.zeros(shape, config.jnp_dtype), v=jnp.zeros(shape, config.jnp_dtype))


def flat_rows(slot: jax.Array, positions: jax.Array, valid: jax.Array, max_len: int) -> jax.Array:
    """Cache row of each query row: slot * max_len + position, or the slot's trash row.

    slot: int [S] (broadcast over the rows of its group); positions, valid: [S, R].
    """
    base = slot[:, None] * max_len
    return jnp.where(valid, base + positions, base + max_len - 1).astype(jnp.int32)
