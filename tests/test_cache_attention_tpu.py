"""The Pallas TPU (Mosaic) cache attention: interpret mode against the jnp reference on the
CPU (ragged keys, NaN-poisoned cache rows, GQA, verify's excluded and extra keys, tracking
scores), and the TPU lowering at LLaDA-8B shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cache_attention import cache_attention_reference
from pallas_kernels.cache_attention_tpu import TpuBlockSizes, cache_attention_tpu
from test_cache_attention import MAIN, make_case
from tolerances import assert_close
from tpu_lowering import lower_for_tpu


def check(case, blocks):
    out, scores = cache_attention_tpu(*case.args, **case.kwargs, interpret=True, block_sizes=blocks)
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
        assert_close(scores, scores_ref, jnp.float32, "scores")


@pytest.mark.parametrize(
    "dtype, blocks",
    [
        ("float32", TpuBlockSizes(block_k=16, block_q=16)),  # 2 query tiles of 16 rows, 5 key blocks
        ("bfloat16", None),  # default: one block of all 80 keys, one query tile
    ],
)
def test_main_pass_ragged_keys_several_slots(dtype, blocks):
    case = make_case(20, dtype=dtype, **MAIN, group_slot=[2, 0, 1], key_len=[80, 37, 1])
    check(case, blocks)


@pytest.mark.parametrize("dtype, n_kv_heads, scores", [("float32", 1, True), ("bfloat16", 4, False)])
def test_verify_pass_excluded_keys_and_extra_keys(dtype, n_kv_heads, scores):
    """The third group has no cached key and sees only its extra keys."""
    case = make_case(21, dtype=dtype, n_heads=4, n_kv_heads=n_kv_heads, head_dim=64, n_rows=8, max_len=64,
                     n_slots=3, group_slot=[1, 0, 2], key_len=[64, 20, 0], scores=scores, exclude=True, n_extra=6)
    check(case, TpuBlockSizes(block_k=32))


def test_bad_tiling_is_named():
    with pytest.raises(ValueError, match="block_k"):
        TpuBlockSizes(block_k=12)
    case = make_case(22, dtype="float32", **MAIN, group_slot=[0, 1, 2], key_len=[8, 8, 8])
    with pytest.raises(ValueError, match="does not divide max_len"):
        cache_attention_tpu(*case.args, **case.kwargs, interpret=True, block_sizes=TpuBlockSizes(block_k=32))


@pytest.mark.parametrize("n_groups, n_rows, verify", [(1, 128, False), (32, 128, False), (8, 32, True), (2, 640, False)])
def test_tpu_lowering_at_llada_8b_shapes(n_groups, n_rows, verify):
    n_layers, heads, head_dim, max_len = 32, 32, 128, 640
    bf16, i32 = jnp.bfloat16, jnp.int32
    spec = jax.ShapeDtypeStruct
    cache = spec((n_layers, 32 * max_len, heads * head_dim), bf16)
    kwargs = dict(n_heads=heads, n_kv_heads=heads, max_len=max_len)
    score_rows = spec((n_groups, n_rows), jnp.bool_)
    if verify:
        extra = spec((n_groups, 32, heads * head_dim), bf16)
        kwargs.update(key_exclude=spec((n_groups, max_len), jnp.bool_),
                      extra=(extra, extra, spec((n_groups, n_rows, 32), jnp.bool_)))
        score_rows = None
    text = lower_for_tpu(
        cache_attention_tpu,
        spec((n_groups, n_rows, heads * head_dim), bf16), cache, cache, spec((), i32),
        spec((n_groups,), i32), spec((n_groups,), i32), score_rows, **kwargs,
    )
    assert text.count("tpu_custom_call") == 1
    assert "cache_attention_tpu" in text


def test_auto_picks_the_tpu_kernel_on_a_tpu_and_xla_on_a_cpu(monkeypatch):
    from dllm_jax import kernel_backend

    assert kernel_backend.resolve_kernels("auto") == kernel_backend.Kernels()
    monkeypatch.setattr(kernel_backend, "on_tpu", lambda: True)
    tpu = kernel_backend.resolve_kernels("auto")
    assert tpu.attention and tpu.mosaic and not tpu.qkv and not tpu.scatter
    assert tpu.name == "xla+pallas-attention-tpu"


def test_engine_with_the_tpu_kernel_decodes_the_xla_tokens(lively):
    """Flash-Cache with Flash-Verify (sparse, full and verify passes) through the interpreted
    Mosaic kernel gives the xla backend's tokens."""
    from dllm_jax.decode_config import DecodeConfig
    from dllm_jax.engine import Engine
    from dllm_jax.kernel_backend import Kernels

    cfg, params = lively
    prompts = [[5, 9, 17, 3], [40, 2, 8, 8, 11, 60, 7]]
    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, mask_num=2, track_num=1,
                          threshold=0.3, verify=True)
    xla = Engine(cfg, params, backend="xla").generate(prompts, decode)
    tpu = Engine(cfg, params, backend=Kernels(attention=True, mosaic=True, interpret=True)).generate(prompts, decode)
    assert [r.token_ids for r in tpu.results] == [r.token_ids for r in xla.results]
    assert xla.stats.tokens_per_step > 1.1
