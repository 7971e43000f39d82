"""Dream's sampler (method "dream"): each rule against a plain numpy reference of Dream's
``diffusion_generate`` step, and the decode loop against a one-request Python loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dream_engine import lively_dream

from dllm_jax.common.errors import GenerationError, SamplingParamsError
from dllm_jax.engine.engine import Engine
from dllm_jax.models.transformer import forward, predictions
from dllm_jax.policies.dream_unmasking import sample_and_confidence, timestep_ratio, transfer_mask
from dllm_jax.runtime.decode_config import DecodeConfig, DecodeConfigError
from dllm_jax.sampling.params import SamplingParams
from dllm_jax.sampling.samplers import filter_top_p_top_k

pytestmark = pytest.mark.unit  # the tests that decode are marked engine

# every alg at one schedule: each alg is a compiled loop, the one-slot variants serve the
# batching checks
STEPS = 12

# ----- the rules, one at a time ------------------------------------------------------------------


def reference_filter(logits, temperature, top_p, top_k):
    """Dream's temperature / top_p_logits / top_k_logits, row by row in float64."""
    logits = np.asarray(logits, np.float64).copy()
    low = np.finfo(np.float32).min
    if temperature > 0:
        logits = logits / temperature
    for row in logits:
        if top_p < 1:
            order = np.argsort(-row, kind="stable")
            probs = np.exp(row[order] - row[order].max())
            cumulative = np.cumsum(probs / probs.sum())
            remove = np.concatenate([[False], cumulative[:-1] > top_p])
            row[order[remove]] = low
        if top_k > 0:
            kth = np.sort(row)[::-1][min(top_k, len(row)) - 1]
            row[row < kth] = low
    return logits


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_confidence(logits, alg, temperature, top_p, top_k):
    """Greedy tokens and Dream's confidence of each alg (no sampling: temperature only scales)."""
    probs = softmax(reference_filter(logits, temperature, top_p, top_k))
    tokens = probs.argmax(-1)
    if alg == "topk_margin":
        top = np.sort(probs, -1)[:, ::-1]
        return tokens, top[:, 0] - top[:, 1]
    if alg == "entropy":
        return tokens, np.sum(probs * np.log(probs + 1e-10), -1)
    return tokens, probs[np.arange(len(tokens)), tokens]


def reference_count(num_masked, step, steps, eps):
    """Dream's number_transfer_tokens in float32 arithmetic."""
    if step == steps - 1:
        return num_masked
    t = np.linspace(1, eps, steps + 1).astype(np.float32)
    return int(np.float32(num_masked) * (np.float32(1) - t[step + 1] / t[step]))


def filtered(logits, temperature, top_p, top_k):
    """The decode loop's filter (dllm_jax.sampling.samplers), as it runs before the Dream policy."""
    return filter_top_p_top_k(jnp.asarray(logits), jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k))


@pytest.mark.parametrize("top_p, top_k, temperature", [(0.9, 0, 0.0), (1.0, 5, 0.7), (0.5, 3, 1.3), (1.0, 0, 0.0)])
def test_filters_match_dreams_top_p_and_top_k(top_p, top_k, temperature):
    logits = np.random.default_rng(0).standard_normal((6, 40)).astype(np.float32) * 3
    got = np.asarray(filtered(logits, temperature, top_p, top_k))
    want = reference_filter(logits, temperature, top_p, top_k)
    kept = want > np.finfo(np.float32).min
    np.testing.assert_array_equal(got > np.finfo(np.float32).min, kept)
    # the loop's filter keeps the logits unscaled; the policy divides by the temperature
    np.testing.assert_allclose(got[kept] / (temperature if temperature > 0 else 1.0), want[kept], rtol=1e-6)
    if top_p < 1 or top_k:
        assert not kept.all(), "the case should remove tokens"


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_confidences_match_dreams(alg):
    logits = np.random.default_rng(1).standard_normal((8, 50)).astype(np.float32) * 2
    tokens, confidence = sample_and_confidence(
        filtered(logits, 0.0, 0.95, 10), alg, jnp.float32(0.0), jax.random.key(0)
    )
    want_tokens, want_confidence = reference_confidence(logits, alg, 0.0, 0.95, 10)
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
    np.testing.assert_allclose(np.asarray(confidence), want_confidence, rtol=1e-5, atol=1e-6)


def test_sampled_tokens_follow_the_filtered_distribution():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0, -3.0]] * 4000)
    tokens, confidence = sample_and_confidence(
        filtered(logits, 1.0, 1.0, 3), "maskgit_plus", jnp.float32(1.0), jax.random.key(2)
    )
    counts = np.bincount(np.asarray(tokens), minlength=5) / 4000
    want = softmax(reference_filter(np.asarray(logits[:1]), 1.0, 1.0, 3))[0]
    np.testing.assert_allclose(counts, want, atol=0.03)
    assert counts[3] == counts[4] == 0
    np.testing.assert_allclose(np.asarray(confidence), want[np.asarray(tokens)], rtol=1e-5)


@pytest.mark.parametrize("steps, eps", [(16, 1e-3), (7, 0.05), (1, 1e-3)])
def test_unmask_counts_follow_the_timestep_schedule(steps, eps):
    rng = np.random.default_rng(3)
    for step in range(steps):
        masked = rng.random(48) < 0.8
        confidence = rng.standard_normal(48)
        got = transfer_mask(
            "entropy",
            jnp.asarray(confidence),
            jnp.asarray(masked),
            jnp.int32(step),
            steps,
            eps,
            jnp.float32(0.0),
            jax.random.key(step),
        )
        got = np.asarray(got)
        count = reference_count(int(masked.sum()), step, steps, eps)
        assert got.sum() == count and not (got & ~masked).any()
        # alg_temp 0: the most confident masked positions
        order = [i for i in np.argsort(-np.where(masked, confidence, -np.inf), kind="stable") if masked[i]]
        assert set(np.flatnonzero(got)) == set(order[:count])
    assert float(timestep_ratio(jnp.int32(steps - 1), steps, eps)) == 1.0


def test_origin_unmasks_each_position_with_probability_one_minus_s_over_t():
    masked = jnp.ones((20000,), bool)
    steps, eps, step = 8, 1e-3, 2
    got = transfer_mask(
        "origin", jnp.zeros(20000), masked, jnp.int32(step), steps, eps, jnp.float32(0), jax.random.key(4)
    )
    t = np.linspace(1, eps, steps + 1)
    assert abs(float(np.mean(np.asarray(got))) - (1 - t[step + 1] / t[step])) < 0.01


def test_alg_temp_draws_positions_in_proportion_to_softmax_confidence():
    confidence = jnp.asarray([0.0, np.log(3.0), -50.0, -50.0])  # softmax ~ [0.25, 0.75, 0, 0]
    masked = jnp.ones((4,), bool)
    picks = np.array(
        [
            np.flatnonzero(
                np.asarray(
                    transfer_mask(
                        "maskgit_plus", confidence, masked, jnp.int32(0), 2, 1e-3, jnp.float32(1.0), jax.random.key(i)
                    )
                )
            )
            for i in range(600)
        ]
    )
    assert picks.shape == (600, 1)  # int(4 * (1 - s/t)) = int(1.998) = 1 position per draw
    assert abs(np.mean(picks == 1) - 0.75) < 0.06 and not np.isin(picks, [2, 3]).any()


# ----- the loop against a one-request Python loop ----------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    cfg, params = lively_dream()
    return Engine(cfg, params, backend="xla")


def reference_decode(engine, prompt, decode: DecodeConfig, sampling: SamplingParams):
    """Dream's _sample with temperature 0 and alg_temp 0, written out (one request, numpy).

    Masked positions are tracked as not yet unmasked (not as x == [MASK]): a predicted [MASK]
    token, which the random test model produces, is committed as the engine commits it.
    """
    cfg = engine.config
    G, steps = decode.gen_length, decode.total_steps
    P = len(prompt)
    x = np.array(list(prompt) + [cfg.mask_token_id] * G)
    undecoded = np.arange(P + G) >= P
    run = jax.jit(lambda t: predictions(cfg, forward(cfg, engine.weights, t)))
    for step in range(steps):
        mask_index = undecoded.copy()
        if not mask_index.any():
            break
        logits = np.asarray(run(jnp.asarray(x)[None]))[0][mask_index]
        tokens, confidence = reference_confidence(logits, decode.alg, 0.0, sampling.top_p, sampling.top_k)
        count = reference_count(int(mask_index.sum()), step, steps, decode.eps)
        where = np.flatnonzero(mask_index)
        chosen = np.argsort(-confidence, kind="stable")[:count]
        x[where[chosen]] = tokens[chosen]
        undecoded[where[chosen]] = False
    return x[P:], step + 1


def dream(alg: str, batch_size: int = 2) -> DecodeConfig:
    return DecodeConfig(method="dream", gen_length=32, steps=STEPS, alg=alg, batch_size=batch_size)


@pytest.mark.engine
@pytest.mark.parametrize("alg, top_p, top_k", [("maskgit_plus", 1.0, 0), ("topk_margin", 0.9, 0), ("entropy", 1.0, 8)])
def test_the_loop_matches_dreams_sampler(engine, alg, top_p, top_k):
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, 100, n)) for n in (12, 7, 3)]
    decode = dream(alg)
    sampling = SamplingParams(top_p=top_p, top_k=top_k)
    out = engine.generate(prompts, sampling, decode_config=decode)
    eos = engine.config.eos_token_id
    for prompt, result in zip(prompts, out.results):
        tokens, steps = reference_decode(engine, prompt, decode, sampling)
        tokens = [int(t) for t in tokens]
        assert result.token_ids == (tokens[: tokens.index(eos)] if eos in tokens else tokens)
        assert result.steps == steps == STEPS


@pytest.mark.engine
@pytest.mark.parametrize(
    "alg, sampling, seed",
    [
        ("origin", SamplingParams(temperature=0.8, top_p=0.95), 1),
        ("entropy", SamplingParams(temperature=0.3, alg_temp=0.5), 0),
    ],
    ids=["origin-sampled", "entropy-alg_temp"],
)
def test_sampled_decodes_are_seeded_and_batch_invariant(engine, alg, sampling, seed):
    rng = np.random.RandomState(1)
    many = [list(rng.randint(0, 100, n)) for n in (5, 14, 8, 11, 3)]
    together = engine.generate(many, sampling, decode_config=dream(alg), seed=seed)
    # origin unmasks each [MASK] with probability 1 - s/t: a request may finish before its last step
    assert max(r.steps for r in together.results) == STEPS and all(r.steps <= STEPS for r in together.results)
    fewer = engine.generate(many, sampling, decode_config=dream(alg, batch_size=1), seed=seed)
    assert [r.token_ids for r in fewer.results] == [r.token_ids for r in together.results]
    other_seed = engine.generate(many, sampling, decode_config=dream(alg), seed=seed + 1)
    assert [r.token_ids for r in other_seed.results] != [r.token_ids for r in together.results]


@pytest.mark.engine
def test_per_request_sampler_values_share_one_loop(engine):
    """Requests with different top_k / alg_temp decode in one compiled loop, each as it would alone."""
    rng = np.random.RandomState(2)
    prompts = [list(rng.randint(0, 100, n)) for n in (6, 9, 4)]
    decode = dream("entropy")
    per_request = [
        SamplingParams(),
        SamplingParams(top_k=4, temperature=0.5, seed=3),
        SamplingParams(alg_temp=0.7, seed=4),
    ]
    together = engine.generate(prompts, per_request, decode_config=decode)
    alone = [engine.generate([prompts[0]], per_request[0], decode_config=decode)]
    compiled = len(engine._executables)  # what the first two calls needed
    alone += [engine.generate([p], params, decode_config=decode) for p, params in zip(prompts[1:], per_request[1:])]
    assert len(engine._executables) == compiled  # no loop per value
    assert [a.results[0].token_ids for a in alone] == [r.token_ids for r in together.results]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alg="greedy"), "alg='greedy'"),
        (dict(steps=64), "steps=64"),
        (dict(block_length=8), "block_length"),
        (dict(threshold=0.9), "threshold"),
        (dict(eps=1.5), "eps"),
        (dict(eps=1.0), "eps"),
    ],
)
def test_bad_dream_options_are_named(kwargs, match):
    with pytest.raises(DecodeConfigError, match=match):
        DecodeConfig(method="dream", gen_length=32, **kwargs)


@pytest.mark.engine
def test_bad_dream_request_values_are_named(engine):
    with pytest.raises(SamplingParamsError, match="alg_temp"):
        SamplingParams(alg_temp=-0.5)
    with pytest.raises(DecodeConfigError, match="alg='entropy' does not apply to method='flash_cache'"):
        DecodeConfig(method="flash_cache", alg="entropy")
    with pytest.raises(GenerationError, match="alg_temp=0.5 applies only to method='dream'"):
        engine.generate(
            [[1, 2, 3]], SamplingParams(alg_temp=0.5), decode_config=DecodeConfig(method="flash_cache", gen_length=32)
        )
