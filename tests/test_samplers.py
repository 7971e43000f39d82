"""The reference samplers' options against plain numpy renderings of the reference code's rules.

top_p / top_k: Dream's top_p_logits and top_k_logits (after dividing by the temperature);
cfg_scale and remasking="random": LLaDA's generate() (un_x = the prompt masked, logits =
un + (cfg + 1) * (cond - un); random remasking = uniform confidences), decoded end to end.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import DecodeConfig, Engine, GenerationError, SamplingParams
from dllm_jax.models.transformer import forward
from dllm_jax.runtime.kernel_routing import Kernels
from dllm_jax.sampling.samplers import filter_min_p, filter_top_p_top_k, guided_logits, sample_tokens
from tests.engine_checks import FLASH, LLADA

pytestmark = pytest.mark.unit  # the tests that decode are marked engine

FLOAT32_MIN = np.finfo(np.float32).min


def dream_filter(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Dream's sampler up to the softmax: logits / T, top_p_logits, top_k_logits (numpy, per row)."""
    x = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    keep = np.ones_like(x, bool)
    if top_p < 1:
        for r in range(x.shape[0]):
            order = np.argsort(-x[r], kind="stable")
            p = np.exp(x[r, order] - x[r, order].max())
            cumulative = np.cumsum(p / p.sum())
            remove = cumulative > top_p
            remove[1:] = remove[:-1].copy()
            remove[0] = False
            keep[r, order[remove]] = False
    x = np.where(keep, x, FLOAT32_MIN)
    if top_k > 0:
        kth = np.sort(x, axis=-1)[:, ::-1][:, min(top_k, x.shape[-1]) - 1 : min(top_k, x.shape[-1])]
        keep &= x >= kth
    return keep


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 0), (0.3, 0), (1.0, 5), (0.8, 3), (1e-6, 0), (1.0, 1000)])
def test_top_p_top_k_keep_dreams_sets(temperature, top_p, top_k):
    rng = np.random.RandomState(int(temperature * 10) + top_k)
    logits = (rng.randn(6, 50) * 3).astype(np.float32)
    out = np.asarray(
        filter_top_p_top_k(jnp.asarray(logits), jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k))
    )
    keep = dream_filter(logits, temperature, top_p, top_k)
    np.testing.assert_array_equal(out > FLOAT32_MIN, keep)
    np.testing.assert_array_equal(out[keep], logits[keep])  # kept logits untouched
    if top_p == 1.0 and top_k in (0, 1000):
        assert keep.all()


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_keeps_transformers_set(temperature, min_p):
    """min_p is transformers' MinPLogitsWarper applied after its TemperatureLogitsWarper (softmax
    of the logits themselves when greedy)."""
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper

    rng = np.random.RandomState(int(temperature * 10) + int(min_p * 100))
    logits = (rng.randn(6, 50) * 3).astype(np.float32)
    out = np.asarray(filter_min_p(jnp.asarray(logits), jnp.float32(temperature), jnp.float32(min_p)))
    scaled = torch.from_numpy(logits.astype(np.float64) / (temperature if temperature > 0 else 1.0))
    if min_p > 0:
        want = MinPLogitsWarper(min_p)(None, scaled).numpy() > -np.inf
    else:
        want = np.ones_like(logits, bool)
    np.testing.assert_array_equal(out > FLOAT32_MIN, want)
    np.testing.assert_array_equal(out[want], logits[want])  # kept logits untouched
    assert want.sum(axis=-1).min() >= 1  # the most likely token always stays


def test_gumbel_sampling_draws_within_the_filtered_set():
    """The sampler's draw is the Gumbel-max of the filtered logits with the same uniforms."""
    rng = np.random.RandomState(3)
    logits = jnp.asarray(rng.randn(8, 40).astype(np.float32) * 2)
    key = jax.random.key(11)
    T, top_p, top_k = jnp.float32(1.3), jnp.float32(0.7), jnp.int32(6)
    filtered = filter_top_p_top_k(logits, T, top_p, top_k)
    tokens, confidence = sample_tokens(filtered, T, key)
    u = np.asarray(jax.random.uniform(key, logits.shape, minval=1e-20, maxval=1.0), np.float64)
    keep = dream_filter(np.asarray(logits), 1.3, 0.7, 6)
    noisy = np.where(keep, np.asarray(logits, np.float64) + 1.3 * -np.log(-np.log(u)), -np.inf)
    np.testing.assert_array_equal(np.asarray(tokens), noisy.argmax(-1))
    probs = np.where(keep, np.exp(np.asarray(logits, np.float64)), 0.0)
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(confidence), probs[np.arange(8), np.asarray(tokens)], rtol=1e-5)


def test_guided_logits_is_llada_cfg():
    rng = np.random.RandomState(0)
    cond, un = rng.randn(2, 4, 9).astype(np.float32)
    out = guided_logits(jnp.asarray(cond), jnp.asarray(un), jnp.float32(1.5))
    np.testing.assert_allclose(np.asarray(out), un + 2.5 * (cond - un), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(guided_logits(jnp.asarray(cond), jnp.asarray(un), jnp.float32(0.0))), cond)


# ----- LLaDA's generate(), end to end -------------------------------------------------------------


def llada_generate(cfg, params, prompt, gen_length, block_length, steps, cfg_scale=0.0, uniforms=None):
    """LLaDA's generate() at temperature 0 (numpy): low-confidence remasking, or random
    remasking when `uniforms(step, block_positions)` gives the confidences."""
    mask_id = cfg.mask_token_id
    P = len(prompt)
    x = np.full(P + gen_length, mask_id, np.int64)
    x[:P] = prompt
    prompt_index = x != mask_id
    full = jax.jit(lambda t: forward(cfg, params, t))
    steps_per_block = steps // (gen_length // block_length)
    step = 0
    for b in range(gen_length // block_length):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        n_masked = int(np.sum(x[lo:hi] == mask_id))
        transfer = np.full(steps_per_block, n_masked // steps_per_block)
        transfer[: n_masked % steps_per_block] += 1
        for i in range(steps_per_block):
            mask_index = x == mask_id
            logits = np.asarray(full(jnp.asarray(x)[None])[0], np.float64)
            if cfg_scale > 0:
                un_x = x.copy()
                un_x[prompt_index] = mask_id
                un = np.asarray(full(jnp.asarray(un_x)[None])[0], np.float64)
                logits = un + (cfg_scale + 1) * (logits - un)
            x0 = logits.argmax(-1)
            if uniforms is None:
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                x0_p = p[np.arange(len(x0)), x0]
            else:
                x0_p = np.full(len(x0), -np.inf)
                x0_p[lo:hi] = uniforms(step, hi - lo)
            x0_p[hi:] = -np.inf
            x0 = np.where(mask_index, x0, x)
            confidence = np.where(mask_index, x0_p, -np.inf)
            chosen = np.argsort(-confidence, kind="stable")[: transfer[i]]
            x[chosen] = x0[chosen]
            step += 1
    return x[P:]


@pytest.fixture(scope="module")
def engine(lively_engine):
    return lively_engine


PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 2, 11, 8]]


def _answer(tokens, eos):
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


@pytest.mark.engine
def test_cfg_scale_matches_llada_generate(engine):
    cfg = engine.config
    decode = LLADA
    params = [SamplingParams(cfg_scale=1.5), SamplingParams(cfg_scale=0.0)]
    out = engine.generate(PROMPTS, params, decode_config=decode)
    for prompt, p, result in zip(PROMPTS, params, out.results):
        ref = llada_generate(cfg, engine.weights, prompt, 32, 16, 16, cfg_scale=p.cfg_scale)
        assert result.token_ids == _answer(ref, cfg.eos_token_id)
    guided_alone = engine.generate(PROMPTS[:1], SamplingParams(cfg_scale=1.5), decode_config=decode).results[0]
    plain = engine.generate(PROMPTS[:1], decode_config=decode).results[0]
    assert guided_alone.token_ids == out.results[0].token_ids
    assert plain.token_ids != guided_alone.token_ids, "cfg should change the answer on this model"


@pytest.mark.engine
def test_random_remasking_matches_llada_generate(engine):
    """Same uniforms as the engine's stream (key(seed), folded with the stream, the step, then 1)."""
    cfg = engine.config
    decode = LLADA
    seed = 21
    out = engine.generate(PROMPTS, SamplingParams(remasking="random", seed=seed), decode_config=decode)

    def uniforms(step, count):
        rng = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), step), 1)
        return np.asarray(jax.random.uniform(rng, (count,), jnp.float32), np.float64)

    low = engine.generate(PROMPTS, decode_config=decode)
    for prompt, result in zip(PROMPTS, out.results):
        ref = llada_generate(cfg, engine.weights, prompt, 32, 16, 16, uniforms=uniforms)
        assert result.token_ids == _answer(ref, cfg.eos_token_id)
    assert [r.token_ids for r in out.results] != [r.token_ids for r in low.results]


def test_cfg_is_llada_only(engine):
    with pytest.raises(GenerationError, match="cfg_scale=1.0 is available with method='llada'"):
        engine.generate([[1, 2, 3]], SamplingParams(cfg_scale=1.0), decode_config=DecodeConfig(gen_length=16))
    with pytest.raises(GenerationError, match="not 'fast_dllm'"):
        engine.generate(
            [[1, 2, 3]], SamplingParams(cfg_scale=1.0), decode_config=DecodeConfig(method="fast_dllm", gen_length=32)
        )


@pytest.mark.engine
def test_top_k_one_draws_the_argmax_at_any_temperature(engine):
    """With one token kept, the Gumbel draw is the argmax (and its confidence 1, as Dream's
    filtered probabilities give): temperature no longer matters; top_p tiny and min_p 1 keep the
    same set (one compiled loop: all are per-request values)."""
    decode = FLASH
    window = dict(threshold=0.5, max_new_tokens=16)  # one window of answer
    cold = engine.generate(PROMPTS, SamplingParams(top_k=1, **window), decode_config=decode)
    hot = engine.generate(PROMPTS, SamplingParams(temperature=5.0, top_k=1, seed=1, **window), decode_config=decode)
    nucleus = engine.generate(
        PROMPTS, SamplingParams(temperature=5.0, top_p=1e-6, seed=1, **window), decode_config=decode
    )
    only_the_likeliest = engine.generate(
        PROMPTS, SamplingParams(temperature=5.0, min_p=1.0, seed=1, **window), decode_config=decode
    )
    assert [r.token_ids for r in only_the_likeliest.results] == [r.token_ids for r in cold.results]
    unfiltered = engine.generate(PROMPTS, SamplingParams(temperature=5.0, seed=1, **window), decode_config=decode)
    assert [r.token_ids for r in hot.results] == [r.token_ids for r in cold.results]
    assert [r.token_ids for r in nucleus.results] == [r.token_ids for r in cold.results]
    assert [r.token_ids for r in unfiltered.results] != [r.token_ids for r in cold.results]
    assert all(r.steps == 1 for r in cold.results), "confidence 1 everywhere: the whole window at once"


@pytest.mark.engine
def test_the_cutoff_kernel_filters_as_the_sort_in_the_loop(lively, engine):
    """The decode loop with the top-p/top-k kernel (what auto runs on NVIDIA GPUs, here in
    interpret mode) draws the same tokens as with the sort under a cond, for a mix of slots
    that ask and do not ask."""
    cfg, params = lively
    with_kernel = Engine(cfg, params, backend=Kernels(top_p_top_k=True), interpret=True)
    prompts = PROMPTS + [[7, 7, 3], [1, 2, 3, 4, 5]]
    mix = [
        SamplingParams(temperature=1.0, top_p=0.6, seed=3, threshold=0.5),
        SamplingParams(temperature=0.8, seed=4, threshold=0.5),
        SamplingParams(temperature=2.0, top_k=3, seed=5, threshold=0.5),
        SamplingParams(top_p=0.2, top_k=4, threshold=0.5),
    ]
    decode = FLASH
    got = with_kernel.generate(prompts, mix, decode_config=decode)
    want = engine.generate(prompts, mix, decode_config=decode)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    unfiltered = engine.generate(
        prompts, [dataclasses.replace(p, top_p=1.0, top_k=0) for p in mix], decode_config=decode
    )
    assert [r.token_ids for r in unfiltered.results] != [r.token_ids for r in want.results]
