"""The Pallas TPU (Mosaic) cache attention: interpret mode against the jnp reference on the
CPU (ragged keys, NaN-poisoned cache rows, GQA, verify's excluded and extra keys, tracking
scores), and the TPU lowering at LLaDA-8B shapes."""

from __future__ import annotations

import pytest
from attention_inputs import MAIN, assert_matches_reference, lowering_args, make_case, ragged_main_case, verify_case
from tpu_lowering import lower_for_tpu

from dllm_jax.models.config import llada_8b_config
from pallas_kernels.attention.cache_attention_tpu import TpuBlockSizes, cache_attention_tpu

pytestmark = pytest.mark.kernels


def check(case, blocks):
    assert_matches_reference(cache_attention_tpu, case, interpret=True, block_sizes=blocks)


@pytest.mark.parametrize(
    "dtype, blocks",
    [
        ("float32", TpuBlockSizes(block_k=16, block_q=16)),  # 2 query tiles of 16 rows, 5 key blocks
        ("bfloat16", None),  # default: one block of all 80 keys, one query tile
    ],
)
def test_main_pass_ragged_keys_several_slots(dtype, blocks):
    check(ragged_main_case(20, dtype), blocks)


@pytest.mark.parametrize("dtype, n_kv_heads, scores", [("float32", 1, True), ("bfloat16", 4, False)])
def test_verify_pass_excluded_keys_and_extra_keys(dtype, n_kv_heads, scores):
    check(verify_case(21, dtype, n_kv_heads, scores), TpuBlockSizes(block_k=32))


def test_bad_tiling_is_named():
    with pytest.raises(ValueError, match="block_k"):
        TpuBlockSizes(block_k=12)
    case = make_case(22, dtype="float32", **MAIN, group_slot=[0, 1, 2], key_len=[8, 8, 8])
    with pytest.raises(ValueError, match="does not divide max_len"):
        cache_attention_tpu(*case.args, **case.kwargs, interpret=True, block_sizes=TpuBlockSizes(block_k=32))


@pytest.mark.parametrize(
    "n_groups, n_rows, verify", [(1, 128, False), (32, 128, False), (8, 32, True), (2, 640, False)]
)
def test_tpu_lowering_at_llada_8b_shapes(n_groups, n_rows, verify):
    args, kwargs = lowering_args(
        llada_8b_config(), n_groups=n_groups, n_rows=n_rows, verify=verify, max_len=640, n_cache_rows=32 * 640
    )
    text = lower_for_tpu(cache_attention_tpu, *args, **kwargs)
    assert text.count("tpu_custom_call") == 1
    assert "cache_attention_tpu" in text


def test_auto_picks_the_tpu_kernel_on_a_tpu_and_xla_on_a_cpu(monkeypatch):
    from dllm_jax.common import platform
    from dllm_jax.runtime import kernel_routing as kernel_backend

    assert kernel_backend.resolve_kernels("auto") == kernel_backend.Kernels()
    monkeypatch.setattr(platform, "on_tpu", lambda: True)
    tpu = kernel_backend.resolve_kernels("auto")
    assert tpu.attention and tpu.mosaic and not tpu.qkv and not tpu.scatter
    assert tpu.name == "xla+pallas-attention-tpu"


@pytest.mark.engine
@pytest.mark.integration  # full tier: the interpreted kernels inside the decode loop
def test_engine_with_the_tpu_kernel_decodes_the_xla_tokens(lively, lively_engine):
    """Flash-Cache with Flash-Verify (sparse, full and verify passes) through the interpreted
    Mosaic kernel gives the xla backend's tokens."""
    from dllm_jax.engine.engine import Engine
    from dllm_jax.runtime.kernel_routing import Kernels
    from dllm_jax.sampling.params import SamplingParams
    from tests.engine_checks import FLASH_VERIFY

    cfg, params = lively
    prompts = [[5, 9, 17, 3], [40, 2, 8, 8, 11, 60, 7]]
    sampling = SamplingParams(threshold=0.3)
    xla = lively_engine.generate(prompts, sampling, decode_config=FLASH_VERIFY)
    tpu = Engine(cfg, params, backend=Kernels(attention=True, mosaic=True, interpret=True)).generate(
        prompts, sampling, decode_config=FLASH_VERIFY
    )
    assert [r.token_ids for r in tpu.results] == [r.token_ids for r in xla.results]
    assert xla.stats.tokens_per_step > 1.1
