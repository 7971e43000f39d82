"""The XLA path's chunked cache attention against the jnp reference (fresh random inputs,
ragged key lengths, NaN in every cache row no group may read, GQA, verify's extra keys)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_inputs import MAIN, assert_matches_reference, make_case, ragged_main_case, verify_case

from dllm_jax.runtime.chunked_attention import chunked_cache_attention, default_block_k

pytestmark = pytest.mark.kernels


def check(case, block_k):
    fn = jax.jit(chunked_cache_attention, static_argnames=("n_heads", "n_kv_heads", "max_len", "block_sizes"))
    assert_matches_reference(fn, case, block_sizes=block_k)


@pytest.mark.parametrize(
    "dtype, block_k, seed",
    [("float32", 16, 10), ("bfloat16", 32, 11), ("float32", None, 12)],  # None: one chunk of 128 keys
)
def test_main_pass_ragged_keys_several_slots(dtype, block_k, seed):
    """Key lengths 80, 37 and 1 over 16-key chunks: full, partial and nearly empty chunks."""
    check(ragged_main_case(seed, dtype), block_k)


def test_groups_sharing_a_slot_and_an_out_of_range_slot():
    case = make_case(13, dtype="float32", **MAIN, group_slot=[1, 1, 0], key_len=[50, 50, 64])
    check(case, 16)
    # slot 7 is outside the cache: it reads no key, its row output stays finite
    args = list(case.args)
    args[4] = jnp.asarray([1, 7, 0], jnp.int32)
    out, scores = chunked_cache_attention(*args, **case.kwargs, block_sizes=16)
    assert np.isfinite(np.asarray(out)).all() and (np.asarray(scores)[1] == 0).all()


@pytest.mark.parametrize(
    "dtype, n_kv_heads, scores", [("float32", 1, True), ("bfloat16", 4, False), ("float32", 2, True)]
)
def test_verify_pass_excluded_keys_and_extra_keys(dtype, n_kv_heads, scores):
    check(verify_case(14, dtype, n_kv_heads, scores), 16)


def test_default_block_keeps_the_chunk_logits_under_the_budget():
    # LLaDA-8B, 32 slots: sparse pass (128 rows) and a full pass over 32 lanes of 640 rows
    assert default_block_k(32, 128, 32, 640) == 320  # 512 would fit, two even chunks do too
    assert default_block_k(32, 128, 32, 2048) == 512
    assert default_block_k(32, 640, 32, 640) == 96  # a full pass: 7 chunks, 240 MiB of logits each
    assert default_block_k(2, 16, 4, 160) == 160  # a small cache: one chunk
    assert default_block_k(2, 16, 4, 80) == 80
