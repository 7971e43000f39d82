"""The flat encoder cache of DiffusionGemma: one K and one V array per attention kind.

Sliding and full layers have their own head width and kv heads, so each kind has its own
flat cache, laid out as the LLaDA/Dream one (dllm_jax.runtime.flat_cache): ``keys[kind]``,
``values[kind]``: [N_kind, num_slots * max_len, KVH_kind * Dh_kind] in the model dtype, layer j
of the kind's stack at [j], row ``slot * max_len + p`` for position p of the request in that
slot (kv head h, dim d at column h * Dh + d). Keys are RoPE'd; values are the normed raw
projections (full layers: of the key projection, DiffusionGemma's k = v).

Only the encoder writes it (the prompt, then each finished canvas); the decoder's canvas rows
read it and are never stored. A slot's rows are contiguous, so the cache splits across devices
by slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax.models.diffusion_gemma_config import AttentionKind, DiffusionGemmaConfig


@struct.dataclass
class CanvasCache:
    """keys, values: {AttentionKind value: [N_kind, num_slots * max_len, KVH_kind * Dh_kind]}."""

    keys: dict[str, jax.Array]
    values: dict[str, jax.Array]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self))


def _shapes(config: DiffusionGemmaConfig, num_slots: int, max_len: int) -> dict[str, tuple[int, int, int]]:
    return {
        kind.value: (config.layers_of(kind), num_slots * max_len, config.kv_heads(kind) * config.head_dim(kind))
        for kind in AttentionKind
        if config.layers_of(kind)
    }


def canvas_cache_bytes(config: DiffusionGemmaConfig, num_slots: int, max_len: int) -> int:
    """Bytes of the K and V caches of both kinds for this many slots of max_len positions."""
    itemsize = config.jnp_dtype.itemsize
    return sum(2 * n * rows * width * itemsize for n, rows, width in _shapes(config, num_slots, max_len).values())


def allocate_canvas_cache(config: DiffusionGemmaConfig, num_slots: int, max_len: int) -> CanvasCache:
    """A zero-filled cache (never jnp.empty: since jax 0.11 it is uninitialised memory)."""
    shapes = _shapes(config, num_slots, max_len)
    zeros = lambda: {name: jnp.zeros(shape, config.jnp_dtype) for name, shape in shapes.items()}  # noqa: E731
    return CanvasCache(keys=zeros(), values=zeros())
