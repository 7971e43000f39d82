"""Inputs of the cache attention implementations (Pallas Triton, Pallas Mosaic, XLA chunked)
and the one check each of them passes against ``cache_attention_reference``.

``make_case`` builds fresh random inputs over a NaN-poisoned cache; ``assert_matches_reference``
runs an implementation on them and compares it with the reference; ``lowering_args`` gives the
abstract arguments at a real model's shapes, for the lowering tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tolerances import assert_close

from dllm_jax.models.config import ModelConfig
from pallas_kernels.attention.cache_attention import cache_attention_reference

LAYER = 1

# The main pass's usual shape: 3 groups of 12 rows, 4 query heads over 2 kv heads, 80 keys a slot.
MAIN = dict(n_heads=4, n_kv_heads=2, head_dim=64, n_rows=12, max_len=80, n_slots=3)


@dataclasses.dataclass
class Case:
    q: jax.Array
    k_cache: jax.Array
    v_cache: jax.Array
    group_slot: jax.Array
    key_len: jax.Array
    score_rows: jax.Array | None
    kwargs: dict
    visible: np.ndarray  # bool [S, max_len]: cached keys a group may read
    row_sees_a_key: np.ndarray  # bool [S, R]

    @property
    def args(self):
        return (self.q, self.k_cache, self.v_cache, jnp.int32(LAYER), self.group_slot, self.key_len, self.score_rows)


def make_case(
    seed,
    *,
    dtype,
    n_heads,
    n_kv_heads,
    head_dim,
    n_rows,
    max_len,
    group_slot,
    key_len,
    n_slots,
    scores=True,
    exclude=False,
    n_extra=0,
) -> Case:
    """A flat cache [2 layers, n_slots * max_len + 1, KVH*Dh] that is NaN everywhere except the
    keys some group may read in layer LAYER: keys past key_len, excluded keys, the other layer,
    unused slots and the trash row are all NaN, so reading any of them shows."""
    rng = np.random.default_rng(seed)
    n_groups = len(group_slot)
    kv_width = n_kv_heads * head_dim
    n_cache_rows = n_slots * max_len + 1
    key_len = np.asarray(key_len, np.int32)
    visible = np.arange(max_len)[None, :] < key_len[:, None]
    key_exclude = None
    if exclude:
        key_exclude = rng.random((n_groups, max_len)) < 0.25
        visible &= ~key_exclude
    k_cache = np.full((2, n_cache_rows, kv_width), np.nan, np.float32)
    v_cache = k_cache.copy()
    for group, slot in enumerate(group_slot):
        rows = slot * max_len + np.flatnonzero(visible[group])
        k_cache[LAYER, rows] = rng.standard_normal((len(rows), kv_width))
        v_cache[LAYER, rows] = rng.standard_normal((len(rows), kv_width))

    kwargs = dict(n_heads=n_heads, n_kv_heads=n_kv_heads, max_len=max_len)
    row_sees_a_key = np.repeat(visible.any(axis=1, keepdims=True), n_rows, axis=1)
    if exclude:
        kwargs["key_exclude"] = jnp.asarray(key_exclude)
    if n_extra:
        extra_mask = rng.random((n_groups, n_rows, n_extra)) < 0.5
        kwargs["extra"] = (
            jnp.asarray(rng.standard_normal((n_groups, n_extra, kv_width)), dtype),
            jnp.asarray(rng.standard_normal((n_groups, n_extra, kv_width)), dtype),
            jnp.asarray(extra_mask),
        )
        row_sees_a_key |= extra_mask.any(axis=2)
    return Case(
        q=jnp.asarray(rng.standard_normal((n_groups, n_rows, n_heads * head_dim)), dtype),
        k_cache=jnp.asarray(k_cache, dtype),
        v_cache=jnp.asarray(v_cache, dtype),
        group_slot=jnp.asarray(group_slot, jnp.int32),
        key_len=jnp.asarray(key_len),
        score_rows=jnp.asarray(rng.random((n_groups, n_rows)) < 0.5) if scores else None,
        kwargs=kwargs,
        visible=visible,
        row_sees_a_key=row_sees_a_key,
    )


def ragged_main_case(seed, dtype) -> Case:
    """The main pass over three slots with key lengths 80, 37 and 1: full, partial and nearly empty."""
    return make_case(seed, dtype=dtype, **MAIN, group_slot=[2, 0, 1], key_len=[80, 37, 1])


def verify_case(seed, dtype, n_kv_heads, scores) -> Case:
    """The verify pass: key_exclude hides cached keys, 6 extra keys live only in the query, and
    the third group has no cached key at all, so its rows see only their extra keys."""
    return make_case(
        seed,
        dtype=dtype,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        head_dim=64,
        n_rows=8,
        max_len=64,
        n_slots=3,
        group_slot=[1, 0, 2],
        key_len=[64, 20, 0],
        scores=scores,
        exclude=True,
        n_extra=6,
    )


def assert_matches_reference(attention: Callable, case: Case, **options) -> None:
    """Runs ``attention(*case.args, **case.kwargs, **options)`` and compares its (out, scores)
    with the reference's: out on every row that sees a key, scores everywhere (zero on hidden
    keys, all zero without score_rows), both finite."""
    out, scores = attention(*case.args, **case.kwargs, **options)
    out_ref, scores_ref = cache_attention_reference(*case.args, **case.kwargs)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert scores.shape == case.visible.shape and scores.dtype == jnp.float32
    out, out_ref = np.asarray(out, np.float32), np.asarray(out_ref, np.float32)
    assert np.isfinite(out).all(), "an output row is not finite"
    assert case.row_sees_a_key.any()
    assert_close(out[case.row_sees_a_key], out_ref[case.row_sees_a_key], case.q.dtype, "out")
    scores, scores_ref = np.asarray(scores), np.asarray(scores_ref)
    assert np.isfinite(scores).all() and (scores[~case.visible] == 0).all(), "a hidden key has a nonzero score"
    if case.score_rows is None:
        assert (scores == 0).all()
    else:
        # raw float32 logits of bf16 inputs: only the summation order differs
        assert_close(scores, scores_ref, jnp.float32, "scores")


def lowering_args(
    config: ModelConfig, *, n_groups, n_rows, verify, max_len, n_cache_rows, n_extra=32
) -> tuple[tuple, dict]:
    """Abstract (jax.ShapeDtypeStruct, bfloat16 data) positional and keyword arguments of a cache
    attention at config's real shapes (layers, heads, head_dim): the main pass with tracking
    scores, or (verify) the verify pass with excluded keys, n_extra extra keys and no scores."""
    bf16, i32 = jnp.bfloat16, jnp.int32
    spec = jax.ShapeDtypeStruct
    kv_width = config.n_kv_heads * config.head_dim
    cache = spec((config.n_layers, n_cache_rows, kv_width), bf16)
    kwargs = dict(n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, max_len=max_len)
    score_rows = spec((n_groups, n_rows), jnp.bool_)
    if verify:
        extra = spec((n_groups, n_extra, kv_width), bf16)
        kwargs.update(
            key_exclude=spec((n_groups, max_len), jnp.bool_),
            extra=(extra, extra, spec((n_groups, n_rows, n_extra), jnp.bool_)),
        )
        score_rows = None
    args = (
        spec((n_groups, n_rows, config.n_heads * config.head_dim), bf16),
        cache,
        cache,
        spec((), i32),
        spec((n_groups,), i32),
        spec((n_groups,), i32),
        score_rows,
    )
    return args, kwargs
