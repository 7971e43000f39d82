"""Flash-Verify: acceptance rules, the verify query's exactness, and the loop against the reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.models.transformer import forward, init_params
from dllm_jax.policies.flash_verify import WindowDraft, accepted_count, plan_verify
from dllm_jax.runtime.cached_forward import PassSpec, VerifyKeys, cached_forward
from dllm_jax.runtime.flat_cache import allocate_cache
from dllm_jax.runtime.slots import commit_tokens, empty_slots, install, zero_sampling
from dllm_jax.sampling.params import SamplingParams
from tests.conftest import tiny_config
from tests.engine_checks import FLASH, FLASH_VERIFY, answer, one_slot, random_prompts, reference_for

pytestmark = pytest.mark.engine


@pytest.mark.unit
def test_acceptance_rules_on_the_explainers_toy():
    # drafts in verify order: five likely ones, then one the mask view doubts
    probs = jnp.array([0.97, 0.95, 0.93, 0.9, 0.9, 0.72, 0.99, 0.99], jnp.float32)
    top = jnp.ones(8, bool)
    gamma = jnp.float32(0.8)
    assert int(accepted_count(probs, top, jnp.int32(8), gamma, "paper")) == 5
    # running product: .97, .9215, .857, .771 < .8 -> stops at the fourth
    assert int(accepted_count(probs, top, jnp.int32(8), gamma, "cumprod")) == 3
    # the paper rule also needs the mask view's top token to be the draft
    assert int(accepted_count(probs, top.at[2].set(False), jnp.int32(8), gamma, "paper")) == 2
    # only the search set counts; an empty one accepts nothing
    assert int(accepted_count(probs, top, jnp.int32(2), gamma, "paper")) == 2
    assert int(accepted_count(probs, top, jnp.int32(0), gamma, "cumprod")) == 0
    with pytest.raises(ValueError, match="accept"):
        accepted_count(probs, top, jnp.int32(8), gamma, "majority")


def _one_slot_after_stage1(cfg, W, L, key_len, num_committed, seed):
    """A slot with a prompt and masks, and a stage-1 outcome on its window (hand-built)."""
    rng = np.random.RandomState(seed)
    P, G = 9, 40
    prompt = jnp.asarray(rng.randint(0, 100, P), jnp.int32)
    sampling = zero_sampling(()).replace(gen_length=jnp.int32(G), max_new_tokens=jnp.int32(G))
    slot = install(
        jax.tree_util.tree_map(lambda x: x[0], empty_slots(1, L)),
        prompt,
        jnp.int32(P),
        jnp.int32(0),
        sampling,
        jnp.int32(key_len),
        cfg.mask_token_id,
        cfg.eos_token_id,
        jnp.int32(0),
    )
    slot = slot.replace(scores=jnp.asarray(rng.randn(L), jnp.float32), pinned=jnp.arange(L) == 3)
    window = jnp.arange(P, P + W, dtype=jnp.int32)
    drafts = jnp.asarray(rng.randint(0, 100, W), jnp.int32)
    confidence = jnp.asarray(np.sort(rng.rand(W))[::-1].copy(), jnp.float32)
    committed = jnp.arange(W) < num_committed
    draft = WindowDraft(window, drafts, confidence, jnp.ones(W, bool), committed)
    new = commit_tokens(slot, window, drafts, committed, cfg.eos_token_id, stop_at_eos=True)
    return slot, new, draft


# The passes below jitted (eagerly, each of their ops would be a program compiled on its own)
_refresh = jax.jit(cached_forward, static_argnums=(0, 1))
_forward = jax.jit(forward, static_argnums=0)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _verify(cfg, spec, params, cache, plan, key_len):
    """The read-only verify pass of a batched plan_verify output."""
    rows = (plan.tokens, plan.positions, plan.row_valid, None, key_len, plan.mask_rows, None)
    return cached_forward(cfg, spec, params, cache, *rows, VerifyKeys(plan.key_exclude, plan.extra_mask))


@pytest.mark.unit
@pytest.mark.parametrize("num_committed", [1, 5, 12])
def test_mask_view_equals_an_exact_forward_of_the_drafted_sequence(num_committed):
    """With one layer, cached K/V depend only on their own token, so a freshly refreshed cache
    is exact and the mask view must equal the full model on drafts-before / masks-from-i."""
    cfg = tiny_config(n_layers=1)
    params = init_params(cfg, jax.random.key(1))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 20
    W, L, key_len = 16, 128, 64
    old, new, draft = _one_slot_after_stage1(cfg, W, L, key_len, num_committed, seed=num_committed)
    spec = PassSpec(max_len=L)
    positions = jnp.arange(L, dtype=jnp.int32)[None]
    _, _, cache = _refresh(
        cfg,
        spec,
        params,
        allocate_cache(cfg, 1, L),
        old.tokens[None],
        positions,
        positions < key_len,
        None,
        jnp.array([key_len]),
        jnp.zeros((1, 1), jnp.int32),
    )
    plan = plan_verify(old, new, draft, cfg.mask_token_id)
    S = int(plan.num_search)
    assert S == min(W - num_committed, W // 2)
    batched = jax.tree_util.tree_map(lambda x: x[None], plan)
    logits, _, cache_after = _verify(cfg, spec, params, cache, batched, jnp.array([key_len]))
    for i in range(S):
        sequence = new.tokens
        for k in range(S):
            value = plan.search_drafts[k] if k < i else cfg.mask_token_id
            sequence = sequence.at[plan.search_positions[k]].set(value)
        exact = _forward(cfg, params, sequence[None, :key_len])[0, plan.search_positions[i]]
        np.testing.assert_allclose(logits[0, i], exact, rtol=2e-4, atol=2e-4)
    # the verify pass reads the cache and never writes it
    assert all(
        jnp.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(cache_after))
    )


@pytest.mark.parametrize("accept,pin", [("cumprod", "all_commits"), ("paper", "all_commits"), ("paper", "reference")])
def test_verify_matches_the_python_reference(lively_engine, accept, pin):
    engine = lively_engine
    prompts = random_prompts()
    decode = dataclasses.replace(FLASH_VERIFY, accept=accept, pin=pin)
    sampling = SamplingParams(threshold=0.7, gamma=0.3)
    out = engine.generate(prompts, sampling, decode_config=decode)
    ref = reference_for(engine, decode, prompts, sampling)
    for prompt, result in zip(prompts, out.results):
        tokens, steps, committed = ref.flash_cache(prompt)
        assert result.token_ids == answer(tokens, engine.config.eos_token_id)
        assert (result.steps, result.reference_num_tokens, result.accepted_drafts) == (steps, committed, ref.accepted)
        assert result.reference_num_tokens >= result.steps, "at least one token per step"
        assert result.verify_passes == result.steps
        assert result.forward_passes == 2 * result.steps
    without = engine.generate(prompts, dataclasses.replace(sampling, gamma=None), decode_config=FLASH)
    assert out.stats.tokens_per_step > without.stats.tokens_per_step
    assert sum(r.accepted_drafts for r in out.results) > 0


def test_verify_keeps_batch_invariance_and_continuous_batching(lively_engine):
    engine = lively_engine
    rng = np.random.RandomState(1)
    many = [list(rng.randint(0, 100, n)) for n in (5, 14, 8, 11, 3, 16, 9)]
    decode = dataclasses.replace(FLASH_VERIFY, accept="paper")
    sampling = SamplingParams(threshold=0.7, gamma=0.5)
    together = engine.generate(many, sampling, decode_config=decode)
    fewer_slots = engine.generate(many, sampling, decode_config=one_slot(decode))
    assert [r.token_ids for r in together.results] == [r.token_ids for r in fewer_slots.results]
    for i in (0, 4):
        alone = engine.generate([many[i]], sampling, decode_config=decode).results[0]
        assert alone.token_ids == together.results[i].token_ids
