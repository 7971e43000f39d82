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
from dllm_jax.sampling.params import SamplingParams
from tests.engine_checks import (
    EXACT_REFRESH,
    FAST_DUAL,
    FAST_PREFIX,
    FLASH,
    FLASH_VERIFY,
    LLADA,
    answer,
    assert_batching_invariance,
    assert_block_method_matches_reference,
    assert_decodes_like_the_no_cache_model,
    assert_flash_cache_matches_reference,
    random_prompts,
)
from tests.reference_decoder import ReferenceDecoder

pytestmark = pytest.mark.engine


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
    "decode, sampling",
    [
        (FLASH, SamplingParams(threshold=0.3)),
        (FLASH, SamplingParams(threshold=0.2)),
        (FLASH_VERIFY, SamplingParams(threshold=0.7, gamma=0.3)),
        (
            dataclasses.replace(FLASH_VERIFY, accept="paper", pin="reference"),
            SamplingParams(threshold=0.7, gamma=0.5),
        ),
    ],
    ids=["flash", "flash-t0.2", "flash-verify", "flash-verify-paper"],
)
def test_flash_cache_matches_the_python_reference(engine, prompts, decode, sampling):
    assert_flash_cache_matches_reference(engine, prompts, decode, sampling)


@pytest.mark.parametrize("method", list(EXACT_REFRESH))
def test_exact_refresh_reproduces_the_no_cache_model(engine, prompts, method):
    assert_decodes_like_the_no_cache_model(engine, prompts, EXACT_REFRESH[method], SamplingParams(threshold=0.5))


def test_the_shift_is_what_the_exactness_test_checks(engine, prompts):
    """Reading the candidates' own rows (LLaDA's alignment) decodes something else."""
    decode = EXACT_REFRESH["flash_full_refresh"]
    unshifted = dataclasses.replace(engine.config, family="llada")
    ref = ReferenceDecoder(unshifted, engine.weights, decode, engine.decode_loop(decode, 15).max_len, threshold=0.5)
    out = engine.generate(prompts, SamplingParams(threshold=0.5), decode_config=decode)
    differs = [
        r.token_ids != answer(ref.flash_cache(p, no_cache=True)[0], unshifted.eos_token_id)
        for p, r in zip(prompts, out.results)
    ]
    assert any(differs)


@pytest.mark.parametrize("decode", [LLADA, FAST_PREFIX, FAST_DUAL], ids=["llada", "fast-prefix", "fast-dual"])
def test_block_methods_match_the_python_reference(engine, prompts, decode):
    sampling = SamplingParams() if decode.fixed_schedule else SamplingParams(threshold=0.5)
    assert_block_method_matches_reference(engine, prompts, decode, sampling)


def test_continuous_batching_and_batch_invariance(engine):
    """More requests than slots, mixed lengths: the same tokens however the requests are
    batched (Flash-Verify, the method with the most per-slot state; the others' batching is
    checked on LLaDA, tests/test_engine.py)."""
    assert_batching_invariance(engine, FLASH_VERIFY, SamplingParams(threshold=0.7, gamma=0.5), alone=(0, 4))


@pytest.mark.parametrize(
    "decode, sampling",
    [(FLASH_VERIFY, SamplingParams(threshold=0.7, gamma=0.3)), (FAST_DUAL, SamplingParams(threshold=0.5))],
    ids=["flash_verify", "fast_dllm_dual"],
)
@pytest.mark.integration  # full tier: the interpreted kernels inside the decode loop
def test_pallas_kernels_decode_like_the_reference(decode, sampling):
    """The fused projection (with biases) and the GQA cache attention, in interpret mode, on a
    model of head_dim 32 (the kernels' smallest tile is 16 rotary pairs)."""
    cfg, params = lively_dream(d_model=128, mlp_hidden_size=128)
    pallas = Engine(cfg, params, backend="pallas", interpret=True)
    check = (
        assert_flash_cache_matches_reference
        if decode.method == "flash_cache"
        else assert_block_method_matches_reference
    )
    check(pallas, random_prompts((12, 7, 3)), decode, sampling)


@pytest.mark.integration  # full tier: decodes over device meshes
def test_a_tensor_split_decodes_the_reference_tokens(prompts):
    """Biases split by heads like their projections' columns (sharding.param_specs)."""
    from dllm_jax.runtime.sharding import parse_mesh

    mesh = parse_mesh("data=2,tensor=2", jax.devices()[:4])
    cfg, params = lively_dream(n_kv_heads=2)
    split = Engine(cfg, params, backend="xla", mesh=mesh)
    assert_flash_cache_matches_reference(split, prompts, FLASH, SamplingParams(threshold=0.5))
