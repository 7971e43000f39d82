"""Every decoding method on a Dream-shaped model (q/k/v biases, GQA, logits shifted by one),
against the plain-Python reference decoder and against no-cache decoding.

The reference takes each prediction from the output row before its position; the exactness
tests compare with a full forward pass per step (dllm_jax.models.forward, read at p - 1), so an
engine that read the candidates' own rows, or reused a stale predictor row, fails them.
"""

import dataclasses

import jax
import pytest
from conftest import tiny_dream_config

from dllm_jax.engine.engine import Engine
from dllm_jax.models.transformer import init_params
from dllm_jax.runtime.decode_config import DecodeConfig
from tests.engine_checks import (
    EXACT_REFRESH,
    answer,
    assert_batching_invariance,
    assert_block_method_matches_reference,
    assert_decodes_like_the_no_cache_model,
    assert_flash_cache_matches_reference,
    random_prompts,
)
from tests.reference_decoder import ReferenceDecoder


def lively_dream(**overrides):
    """A random tiny Dream whose predictions vary by position and are often confident (as
    conftest's lively LLaDA): scaled-up layers and head, EOS takes over a frequent token."""
    cfg = tiny_dream_config(**overrides)
    params = init_params(cfg, jax.random.key(1))
    params["layers"] = jax.tree_util.tree_map(lambda w: w * 8 if w.ndim == 3 else w * 3, params["layers"])
    head = params["lm_head"]["kernel"] * 20
    params["lm_head"]["kernel"] = head.at[:, cfg.eos_token_id].set(head[:, 125] * 1.02)
    return cfg, params


@pytest.fixture(scope="module")
def engine():
    cfg, params = lively_dream()
    return Engine(cfg, params, backend="xla")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts()


@pytest.mark.parametrize(
    "setting",
    [
        dict(mask_num=2, track_num=1, threshold=0.3),
        dict(mask_num=1, track_num=2, threshold=0.2),
        dict(mask_num=2, track_num=1, threshold=0.7, verify=True, gamma=0.3),
        dict(mask_num=2, track_num=1, threshold=0.7, verify=True, gamma=0.5, accept="paper", pin="reference"),
    ],
    ids=["flash", "flash-track2", "flash-verify", "flash-verify-paper"],
)
def test_flash_cache_matches_the_python_reference(engine, prompts, setting):
    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, **setting)
    assert_flash_cache_matches_reference(engine, prompts, decode)


@pytest.mark.parametrize("method", list(EXACT_REFRESH))
def test_exact_refresh_reproduces_the_no_cache_model(engine, prompts, method):
    assert_decodes_like_the_no_cache_model(engine, prompts, EXACT_REFRESH[method])


def test_the_shift_is_what_the_exactness_test_checks(engine, prompts):
    """Reading the candidates' own rows (LLaDA's alignment) decodes something else."""
    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, threshold=0.5, track_num=-1)
    unshifted = dataclasses.replace(engine.config, family="llada")
    ref = ReferenceDecoder(unshifted, engine.weights, decode, engine.decode_loop(decode, 15).max_len)
    out = engine.generate(prompts, decode)
    differs = [
        r.token_ids != answer(ref.flash_cache(p, no_cache=True)[0], unshifted.eos_token_id)
        for p, r in zip(prompts, out.results)
    ]
    assert any(differs)


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(method="llada", gen_length=32, block_length=16, steps=16, batch_size=2),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, cache="prefix", threshold=0.5, batch_size=2),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, cache="dual", threshold=0.5, batch_size=2),
    ],
    ids=["llada", "fast-prefix", "fast-dual"],
)
def test_block_methods_match_the_python_reference(engine, prompts, decode):
    assert_block_method_matches_reference(engine, prompts, decode)


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(method="flash_cache", gen_length=32, batch_size=3, threshold=0.5, mask_num=2, track_num=1),
        DecodeConfig(method="flash_cache", gen_length=32, batch_size=3, threshold=0.7, verify=True, gamma=0.5),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, threshold=0.5, batch_size=3),
    ],
    ids=["flash", "flash-verify", "fast_dllm"],
)
def test_continuous_batching_and_batch_invariance(engine, decode):
    """More requests than slots, mixed lengths: the same tokens however the requests are batched."""
    assert_batching_invariance(engine, decode, alone=(0, 4))


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(
            method="flash_cache",
            gen_length=32,
            batch_size=2,
            threshold=0.7,
            mask_num=2,
            track_num=1,
            verify=True,
            gamma=0.3,
        ),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, threshold=0.5, batch_size=2),
    ],
    ids=["flash_verify", "fast_dllm_dual"],
)
def test_pallas_kernels_decode_like_xla(decode):
    """The fused projection (with biases) and the GQA cache attention, in interpret mode."""
    cfg, params = lively_dream(d_model=128, mlp_hidden_size=128)
    prompts = random_prompts((12, 7, 3))
    xla = Engine(cfg, params, backend="xla").generate(prompts, decode)
    pallas = Engine(cfg, params, backend="pallas", interpret=True).generate(prompts, decode)
    assert [r.token_ids for r in pallas.results] == [r.token_ids for r in xla.results]
    assert [r.steps for r in pallas.results] == [r.steps for r in xla.results]


def test_a_tensor_split_decodes_the_single_device_tokens(engine, prompts):
    """Biases split by heads like their projections' columns (sharding.param_specs)."""
    from dllm_jax.runtime.sharding import parse_mesh

    decode = DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, threshold=0.5, mask_num=2, track_num=1)
    mesh = parse_mesh("data=2,tensor=2", jax.devices()[:4])
    cfg, params = lively_dream(n_kv_heads=2)
    single = Engine(cfg, params, backend="xla").generate(prompts, decode)
    split = Engine(cfg, params, backend="xla", mesh=mesh).generate(prompts, decode)
    assert [r.token_ids for r in split.results] == [r.token_ids for r in single.results]
