"""Cache attention kernel: interpret mode against the jnp reference on the CPU (main and
verify passes, ragged keys, GQA, key splits, tracking scores), plus the CUDA (Triton)
lowering at LLaDA-8B shapes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_lowering import lower_for_cuda
from pallas_kernels.cache_attention import (
    AttentionBlockSizes,
    cache_attention,
    cache_attention_reference,
    default_attention_block_sizes,
)
from tolerances import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

LAYER = 1


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


def make_case(seed, *, dtype, n_heads, n_kv_heads, head_dim, n_rows, max_len, group_slot, key_len,
              n_slots, scores=True, exclude=False, n_extra=0) -> Case:
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


def check_against_reference(case: Case, blocks: AttentionBlockSizes | None):
    out, scores = cache_attention(*case.args, **case.kwargs, interpret=True, block_sizes=blocks)
    out_ref, scores_ref = cache_attention_reference(*case.args, **case.kwargs)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert scores.shape == case.visible.shape and scores.dtype == jnp.float32
    out, out_ref = np.asarray(out, np.float32), np.asarray(out_ref, np.float32)
    assert np.isfinite(out).all(), "an output row is not finite"
    assert case.row_sees_a_key.any()
    assert_close(out[case.row_sees_a_key], out_ref[case.row_sees_a_key], case.q.dtype, "out")
    scores, scores_ref = np.asarray(scores), np.asarray(scores_ref)
    assert (scores[~case.visible] == 0).all(), "a hidden key has a nonzero score"
    if case.score_rows is None:
        assert (scores == 0).all()
    else:
        # raw float32 logits of bf16 inputs: only the summation order differs
        assert_close(scores, scores_ref, jnp.float32, "scores")


MAIN = dict(n_heads=4, n_kv_heads=2, head_dim=64, n_rows=12, max_len=80, n_slots=3)


@pytest.mark.parametrize(
    "dtype, blocks",
    [
        # two query tiles per kv head (12 rows x 2 heads > 16), 16-key steps, one split
        ("float32", AttentionBlockSizes(16, 16, num_splits=1, num_warps=4, num_stages=2)),
        # three key splits of 32 keys (80 is not a multiple): partials + combine
        ("bfloat16", AttentionBlockSizes(32, 16, num_splits=3, num_warps=4, num_stages=2)),
    ],
)
def test_main_pass_ragged_keys_several_slots(dtype, blocks):
    case = make_case(0, dtype=dtype, **MAIN, group_slot=[2, 0, 1], key_len=[80, 37, 1])
    check_against_reference(case, blocks)


def test_groups_sharing_a_slot_with_the_default_tiling():
    case = make_case(1, dtype="bfloat16", **MAIN, group_slot=[1, 1, 0], key_len=[50, 50, 64])
    check_against_reference(case, None)


@pytest.mark.parametrize(
    "dtype, n_kv_heads, scores, blocks",
    [
        ("float32", 1, True, AttentionBlockSizes(16, 16, num_splits=2, num_warps=4, num_stages=2)),
        ("bfloat16", 4, False, AttentionBlockSizes(16, 32, num_splits=1, num_warps=4, num_stages=2)),
    ],
)
def test_verify_pass_excluded_keys_and_extra_keys(dtype, n_kv_heads, scores, blocks):
    """key_exclude hides cached keys; extra keys live only in the query. The third group has no
    cached key at all, so its rows see only their extra keys."""
    case = make_case(2, dtype=dtype, n_heads=4, n_kv_heads=n_kv_heads, head_dim=64, n_rows=8, max_len=64,
                     n_slots=3, group_slot=[1, 0, 2], key_len=[64, 20, 0], scores=scores, exclude=True, n_extra=6)
    check_against_reference(case, blocks)


def test_invalid_arguments_raise_value_error_naming_them():
    case = make_case(3, dtype="float32", **MAIN, group_slot=[0, 1, 2], key_len=[8, 8, 8])
    args, kwargs = case.args, case.kwargs
    with pytest.raises(ValueError, match="block_k"):
        AttentionBlockSizes(block_k=24)
    with pytest.raises(ValueError, match="num_splits"):
        AttentionBlockSizes(num_splits=0)
    with pytest.raises(ValueError, match="k_cache.dtype"):
        cache_attention(args[0], args[1].astype(jnp.bfloat16), *args[2:], **kwargs, interpret=True)
    with pytest.raises(ValueError, match="score_rows"):
        cache_attention(*args[:6], args[6][:, :-1], **kwargs, interpret=True)
    with pytest.raises(ValueError, match="max_len"):
        cache_attention(*args, n_heads=4, n_kv_heads=2, max_len=10**6, interpret=True)
    with pytest.raises(ValueError, match="key_exclude"):
        cache_attention(*args, **kwargs, key_exclude=jnp.zeros((3, 7), bool), interpret=True)
    with pytest.raises(ValueError, match="extra_mask"):
        k_extra = jnp.zeros((3, 4, 128), jnp.float32)
        cache_attention(*args, **kwargs, extra=(k_extra, k_extra, jnp.zeros((3, 12, 5), bool)), interpret=True)


def test_default_tiling_splits_keys_only_when_the_grid_is_small():
    one_slot = default_attention_block_sizes(1, 128, 32, 32, 2048)
    assert one_slot.block_q == 128 and one_slot.num_splits == 8  # 256 programs
    assert default_attention_block_sizes(32, 128, 32, 32, 2048).num_splits == 1


@pytest.mark.parametrize(
    "n_groups, n_rows, verify",
    [(1, 128, False), (32, 128, False), (8, 32, True)],
)
def test_triton_lowering_at_llada_8b_shapes(n_groups, n_rows, verify):
    n_layers, heads, head_dim, max_len = 32, 32, 128, 2048
    bf16, i32 = jnp.bfloat16, jnp.int32
    spec = jax.ShapeDtypeStruct
    cache = spec((n_layers, 32 * max_len + 1, heads * head_dim), bf16)
    kwargs = dict(n_heads=heads, n_kv_heads=heads, max_len=max_len)
    score_rows = spec((n_groups, n_rows), jnp.bool_)
    if verify:
        extra = spec((n_groups, 32, heads * head_dim), bf16)
        kwargs.update(key_exclude=spec((n_groups, max_len), jnp.bool_),
                      extra=(extra, extra, spec((n_groups, n_rows, 32), jnp.bool_)))
        score_rows = None
    text = lower_for_cuda(
        cache_attention,
        spec((n_groups, n_rows, heads * head_dim), bf16), cache, cache, spec((), i32),
        spec((n_groups,), i32), spec((n_groups,), i32), score_rows, **kwargs,
    )
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert 'name = "cache_attention"' in text
