"""How much a row's K/V changed when a sparse pass refreshed it: the signal of the "drift"
tracking rule (dllm_jax.policies.tracking_rules).

Measured at one layer, the last (where a change of the row's context anywhere below shows),
as the largest absolute change of any of the row's keys and values over all kv heads, in
float32: a maximum, whose value does not depend on the order of the reduction, so the drift
(and the rows it picks) stays batch invariant where XLA reduces rows differently at another
batch size (a sum of squares would not; tests/test_batch_invariance checks the loop). The
cost of a sparse step is two gathers of the query rows' K and V at that layer, one before the
pass and one after it: [B, R, KVH * Dh] each, against a pass that reads every key of every
layer (LLaDA-8B at 32 slots of 128 rows: 4 x 32 MiB in bf16, against about 8.6 GB of cache
reads at 1024 keys).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.models.config import ModelConfig
from dllm_jax.runtime.flat_cache import FlatCache


def drift_layer(config: ModelConfig) -> int:
    """The layer whose K/V change is the row's drift."""
    return config.n_layers - 1


def layer_rows(cache: FlatCache, layer: int, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K and V of the cache rows int32 [S, R] at one layer: [S, R, KVH * Dh] each (cache dtype)."""
    return cache.k[layer][rows], cache.v[layer][rows]


def kv_change(before: tuple[jax.Array, jax.Array], after: tuple[jax.Array, jax.Array]) -> jax.Array:
    """float32 [S, R]: max |(k, v) after - (k, v) before| of each row (layer_rows' pairs)."""
    changes = [jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)), axis=-1) for a, b in zip(after, before)]
    return jnp.maximum(changes[0], changes[1])


def record_drift(drift: jax.Array, positions: jax.Array, valid: jax.Array, change: jax.Array) -> jax.Array:
    """drift float32 [B, L] with each valid query row's change [B, R] stored at its position
    [B, R]; the other positions keep theirs."""
    L = drift.shape[1]
    target = jnp.where(valid, positions, L)  # L is out of range: dropped
    return jax.vmap(lambda d, t, c: d.at[t].set(c, mode="drop"))(drift, target, change)
