"""The Pallas kernels at Dream's shapes: q/k/v biases in the fused projection, seven query heads
per kv head (Dream-7B: 28 over 4) in the cache attention and its tracking scores; interpret
mode against the references on fresh random inputs, and the CUDA lowering at Dream-7B shapes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_qkv_rope_cache as qkv_tests
from attention_inputs import assert_matches_reference, lowering_args, make_case
from cuda_lowering import lower_decode_loop_for_cuda, lower_for_cuda
from tolerances import assert_close

from dllm_jax.models.config import dream_7b_config
from pallas_kernels.attention.cache_attention import AttentionBlockSizes, cache_attention
from pallas_kernels.projection.qkv_rope_cache import QKVBlockSizes, qkv_rope_cache, qkv_rope_cache_reference

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

THETA = 1000000.0


def biases(case, seed: int):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal((w.shape[0], w.shape[2])), case.dtype) for w in (case.wq, case.wk, case.wv)
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_projection_adds_the_biases_before_rope(dtype):
    """7 query heads over 1 kv head, biases of size 1: kernel == reference, and the biases change q/k/v."""
    case = qkv_tests.make_case(4, n_rows=40, d_model=64, n_heads=7, n_kv_heads=1, head_dim=32, dtype=dtype)
    b = biases(case, 5)
    kwargs = dict(n_heads=7, n_kv_heads=1, rope_theta=THETA)
    blocks = QKVBlockSizes(16, 16, 32, num_warps=4, num_stages=2)
    q, k_cache, v_cache = qkv_rope_cache(*case.args(1), b, **kwargs, interpret=True, block_sizes=blocks)
    q_ref, k_ref, v_ref = qkv_rope_cache_reference(*case.args(1), b, **kwargs)
    named = case.cache_rows[case.cache_rows != case.cache.shape[1] - 1]
    f32 = qkv_tests.f32
    assert_close(f32(q), f32(q_ref), case.dtype, "q")
    for name, got, want in (("k", k_cache, k_ref), ("v", v_cache, v_ref)):
        got, want = f32(got)[1, named], f32(want)[1, named]
        assert np.isfinite(got).all(), f"{name}: a named row was not written"
        assert_close(got, want, case.dtype, name)
    q_plain, k_plain, v_plain = qkv_rope_cache_reference(*case.args(1), **kwargs)
    assert not np.allclose(f32(q_plain), f32(q_ref), atol=0.1)
    assert not np.allclose(f32(v_plain)[1, named], f32(v_ref)[1, named], atol=0.1)


def test_fused_projection_rejects_biases_of_the_wrong_shape():
    case = qkv_tests.make_case(6, n_rows=16, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, dtype="float32")
    bq, bk, bv = biases(case, 7)
    with pytest.raises(ValueError, match="bk"):
        qkv_rope_cache(*case.args(0), (bq, bk[:, :8], bv), n_heads=2, n_kv_heads=1, rope_theta=THETA, interpret=True)


@pytest.mark.parametrize(
    "dtype, blocks",
    [
        ("float32", AttentionBlockSizes(16, 16, num_splits=1, num_warps=4, num_stages=2)),
        ("bfloat16", AttentionBlockSizes(32, 16, num_splits=2, num_warps=4, num_stages=2)),
    ],
)
def test_cache_attention_with_seven_query_heads_per_kv_head(dtype, blocks):
    case = make_case(
        8,
        dtype=dtype,
        n_heads=14,
        n_kv_heads=2,
        head_dim=32,
        n_rows=5,
        max_len=48,
        n_slots=3,
        group_slot=[2, 0],
        key_len=[48, 19],
    )
    assert_matches_reference(cache_attention, case, interpret=True, block_sizes=blocks)


def test_verify_pass_with_seven_query_heads_per_kv_head():
    case = make_case(
        9,
        dtype="float32",
        n_heads=7,
        n_kv_heads=1,
        head_dim=32,
        n_rows=6,
        max_len=40,
        n_slots=2,
        group_slot=[1, 0],
        key_len=[40, 23],
        scores=False,
        exclude=True,
        n_extra=6,
    )
    blocks = AttentionBlockSizes(16, 16, num_splits=1, num_warps=4, num_stages=2)
    assert_matches_reference(cache_attention, case, interpret=True, block_sizes=blocks)


@pytest.mark.parametrize("n_rows", [144, 4608])
def test_fused_projection_lowers_for_cuda_at_dream_7b_shapes(n_rows):
    n_layers, d_model, heads, kv_heads, head_dim = 28, 3584, 28, 4, 128
    bf16, i32 = jnp.bfloat16, jnp.int32
    spec = jax.ShapeDtypeStruct
    wq = spec((n_layers, d_model, heads * head_dim), bf16)
    wkv = spec((n_layers, d_model, kv_heads * head_dim), bf16)
    cache = spec((n_layers, 32 * 2048 + 1, kv_heads * head_dim), bf16)
    bias = (
        spec((n_layers, heads * head_dim), bf16),
        spec((n_layers, kv_heads * head_dim), bf16),
        spec((n_layers, kv_heads * head_dim), bf16),
    )
    text = lower_for_cuda(
        qkv_rope_cache,
        spec((n_rows, d_model), bf16),
        wq,
        wkv,
        wkv,
        spec((n_rows,), i32),
        spec((n_rows,), i32),
        cache,
        cache,
        spec((), i32),
        bias,
        n_heads=heads,
        n_kv_heads=kv_heads,
        rope_theta=THETA,
    )
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert sorted(re.findall(r"tf.aliasing_output = (\d+)", text)) == ["1", "2"]


@pytest.mark.parametrize("n_groups, n_rows, verify", [(1, 144, False), (32, 144, False), (8, 40, True)])
def test_cache_attention_lowers_for_cuda_at_dream_7b_shapes(n_groups, n_rows, verify):
    args, kwargs = lowering_args(
        dream_7b_config(),
        n_groups=n_groups,
        n_rows=n_rows,
        verify=verify,
        max_len=2048,
        n_cache_rows=32 * 2048 + 1,
        n_extra=n_rows,
    )
    text = lower_for_cuda(cache_attention, *args, **kwargs)
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("backend", ["pallas", "gpu-auto"])
def test_decode_loop_lowers_for_cuda_at_dream_7b_shapes(backend):
    """The whole jitted loop (flash_cache + verify, predictor rows, biases) at Dream-7B shapes,
    lowered for CUDA on the CPU."""
    text = lower_decode_loop_for_cuda(dream_7b_config(), backend)
    assert text.count("__gpu$xla.gpu.triton") == 6  # 5 of the passes + the top-p/top-k cutoff
