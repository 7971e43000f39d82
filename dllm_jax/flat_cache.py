"""The flat, preallocated K/V cache: one row per (slot, position), allocated once per run.

Layout: ``k``, ``v``: [n_layers, num_slots * max_len + 1, kv_dim] in the model dtype, RoPE'd
keys. Row ``slot * max_len + p`` holds position p of the request in that slot (columns are
head-major: kv head h, dim d at h * head_dim + d). The last row is a trash row: padding
query rows write there, and no attention ever reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax.config import ModelConfig


@struct.dataclass
class FlatCache:
    k: jax.Array
    v: jax.Array

    @property
    def trash_row(self) -> int:
        return self.k.shape[1] - 1

    @property
    def nbytes(self) -> int:
        return 2 * self.k.size * self.k.dtype.itemsize


def cache_bytes(config: ModelConfig, num_slots: int, max_len: int) -> int:
    """Bytes of the K and V caches for this many slots of max_len positions."""
    rows = num_slots * max_len + 1
    return 2 * config.n_layers * rows * config.kv_dim * config.jnp_dtype.itemsize


def allocate_cache(config: ModelConfig, num_slots: int, max_len: int) -> FlatCache:
    """A zero-filled cache (never jnp.empty: since jax 0.11 it is uninitialised memory)."""
    shape = (config.n_layers, num_slots * max_len + 1, config.kv_dim)
    return FlatCache(k=jnp.zeros(shape, config.jnp_dtype), v=jnp.zeros(shape, config.jnp_dtype))


def flat_rows(slot: jax.Array, positions: jax.Array, valid: jax.Array, max_len: int, trash_row: int) -> jax.Array:
    """Cache row of each query row: slot * max_len + position, or the trash row where invalid.

    slot: int [S] (broadcast over the rows of its group); positions, valid: [S, R].
    """
    rows = slot[:, None] * max_len + positions
    return jnp.where(valid, rows, trash_row).astype(jnp.int32)
