"""Cache attention kernel: interpret mode against the jnp reference on the CPU (main and
verify passes, ragged keys, GQA, key splits, tracking scores), plus the CUDA (Triton)
lowering at LLaDA-8B shapes."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from attention_inputs import MAIN, assert_matches_reference, lowering_args, make_case, ragged_main_case, verify_case
from cuda_lowering import lower_for_cuda

from dllm_jax.models.config import llada_8b_config
from pallas_kernels.attention.cache_attention import AttentionBlockSizes, cache_attention, default_attention_block_sizes

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]


def check_against_reference(case, blocks: AttentionBlockSizes | None):
    assert_matches_reference(cache_attention, case, interpret=True, block_sizes=blocks)


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
    check_against_reference(ragged_main_case(0, dtype), blocks)


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
    check_against_reference(verify_case(2, dtype, n_kv_heads, scores), blocks)


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
    "slots, head_dim, warps",
    [(1, 128, 8), (8, 128, 4), (32, 128, 4), (1, 256, 4), (32, 256, 4)],
    ids=["1-slot-split", "8-slots", "32-slots", "wide-1-slot", "wide-32-slots"],
)
def test_default_tiling_takes_eight_warps_only_for_split_128_row_tiles(slots, head_dim, warps):
    # the H100's decode-step A/B (BENCHMARKS.md, 2026-12-07): 8 warps won at 1 slot, 4 at 8 and 32
    assert default_attention_block_sizes(slots, 128, 32, 32, 2048, head_dim).num_warps == warps


@pytest.mark.parametrize(
    "n_groups, n_rows, verify",
    [(1, 128, False), (32, 128, False), (8, 32, True)],
)
def test_triton_lowering_at_llada_8b_shapes(n_groups, n_rows, verify):
    args, kwargs = lowering_args(
        llada_8b_config(), n_groups=n_groups, n_rows=n_rows, verify=verify, max_len=2048, n_cache_rows=32 * 2048 + 1
    )
    text = lower_for_cuda(cache_attention, *args, **kwargs)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert 'name = "cache_attention"' in text
