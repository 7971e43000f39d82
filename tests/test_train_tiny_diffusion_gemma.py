"""The tiny DiffusionGemma's trainer (scripts/train_tiny_diffusion_gemma.py): its training layout,
the uniform noise, that its objective scores exactly what generation computes, that the loss
falls, and that its export reads back in dllm_jax and in transformers; and the GPU benchmark's
expert variants (scripts/gpu/diffusion_gemma_network.py) against the dense reference."""

import itertools
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion, DiffusionGemmaGenerationConfig
from transformers_parity import relative_error

from dllm_jax.evaluation import tiny_tasks
from dllm_jax.evaluation.tiny_tasks import Problem
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.checkpoint.hf_reader import read_checkpoint
from dllm_jax.models.experts import dense_expert_mlp
from dllm_jax.text.tiny_tokenizer import GEMMA_END_OF_TURN, build_tiny_tokenizer
from scripts import train_tiny_diffusion_gemma as tr
from scripts.gpu import diffusion_gemma_network as bench

LONG = Problem("arith", "1+2+3+4+5", "1+2=3\n3+3=6\n6+4=10\n10+5=15\n#### 15", "15")  # 35 + 1 tokens: two canvases
# the model's passes jitted, one compile per shape, shared by the tests of this module (op by op,
# one pass takes about 5 s on the CPU and the objective test's about 100 s)
ENCODE, DECODE = (jax.jit(f, static_argnums=0) for f in (dg.encode, dg.decode))


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(tr.MAX_POSITIONS, tr.FAMILY)


@pytest.fixture(scope="module")
def config(tok):
    """Every feature at the smallest size: two sliding layers and a full one, 4 experts top-2."""
    return tr.tiny_model_config(
        tok,
        d_model=32,
        n_layers=3,
        n_heads=2,
        head_dim=8,
        mlp_hidden=32,
        n_experts=4,
        top_k=2,
        expert_hidden=16,
        sliding_window=8,
    )


@pytest.fixture(scope="module")
def params(config):
    return dg.init_params(config, jax.random.key(0))


def test_a_training_example_is_one_canvas_after_its_left_padded_prefix(tok):
    eot = tok.convert_tokens_to_ids(GEMMA_END_OF_TURN)
    canvases = tr.response_canvases(tok, LONG.answer)
    response = tok(LONG.answer, add_special_tokens=False)["input_ids"] + [eot]
    assert canvases.shape == (2, tr.CANVAS_LENGTH)
    assert canvases.ravel()[: len(response)].tolist() == response
    assert (canvases.ravel()[len(response) :] == tok.eos_token_id).all()
    prompt = tr.prompt_ids(tok, LONG.prompt)
    drawn = set()
    for seed in range(12):
        tokens, valid, scored = tr.encode_training_batch(tok, [LONG], random.Random(seed))
        c = next(c for c in range(2) if tokens[0, tr.PREFIX_LEN :].tolist() == canvases[c].tolist())
        drawn.add(c)
        prefix = prompt + canvases[:c].ravel().tolist()
        pad = tr.PREFIX_LEN - len(prefix)
        assert tokens[0, pad : tr.PREFIX_LEN].tolist() == prefix and (tokens[0, :pad] == tok.pad_token_id).all()
        assert valid[0].tolist() == [False] * pad + [True] * len(prefix)
        assert scored[0].tolist() == [False] * (pad + len(prompt)) + [True] * (tokens.shape[1] - pad - len(prompt))
    assert drawn == {0, 1}
    short = tr.response_canvases(tok, "1 2\n#### 12")
    assert short.shape == (1, tr.CANVAS_LENGTH) and short[0, 11] == eot and (short[0, 12:] == tok.eos_token_id).all()
    with pytest.raises(ValueError, match="canvases"):
        tr.response_canvases(tok, "9" * (tr.MAX_CANVASES * tr.CANVAS_LENGTH))


def test_the_noise_replaces_tokens_uniformly_at_each_canvas_level():
    clean = jnp.full((256, 32), 7, jnp.int32)
    noisy, t = jax.jit(tr.corrupt_canvas, static_argnums=1)(clean, 128, jax.random.key(0))
    noisy, t = np.asarray(noisy), np.asarray(t)[:, 0]
    replaced = noisy != 7
    assert noisy.min() >= 0 and noisy.max() < 128 and t.std() > 0.2
    # replaced share per canvas follows its level (a replacing draw of 7 itself is invisible)
    assert np.corrcoef(replaced.mean(1), t)[0, 1] > 0.9
    assert len(np.unique(noisy[replaced])) > 100


def test_the_objective_scores_what_generation_computes(tok, config, params):
    """One causal encoder pass over a left-padded prefix (prompt + first canvas) and the
    decoder over the second canvas give generation's logits: the prompt encoded alone, then the
    first canvas encoded into the same cache, then the decoder."""
    second = tr.response_canvases(tok, LONG.answer)[1]
    for seed in range(20):  # an example of the second canvas
        tokens, valid, _ = tr.encode_training_batch(tok, [LONG], random.Random(seed))
        if tokens[0, tr.PREFIX_LEN :].tolist() == second.tolist():
            break
    canvas = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, tr.CANVAS_LENGTH)))
    encode, decode = ENCODE, DECODE
    cache = dg.init_cache(config, 1, tr.PREFIX_LEN)
    cache, _ = encode(config, params, jnp.asarray(tokens[:, : tr.PREFIX_LEN]), cache, jnp.asarray(valid))
    trained = decode(config, params, canvas, cache)

    prompt = np.asarray(tr.prompt_ids(tok, LONG.prompt))[None]
    first = tr.response_canvases(tok, LONG.answer)[:1]
    stepwise = dg.init_cache(config, 1, prompt.shape[1] + tr.CANVAS_LENGTH)
    stepwise, _ = encode(config, params, jnp.asarray(prompt), stepwise)
    stepwise, _ = encode(config, params, jnp.asarray(first), stepwise)
    generated = decode(config, params, canvas, stepwise)
    assert relative_error(np.asarray(trained), np.asarray(generated)) < 1e-5


def test_loss_falls_after_a_few_training_steps(tok, config, params):
    problems = list(itertools.islice(tiny_tasks.problems("train", 0), 8))
    batch = tr.encode_training_batch(tok, problems, random.Random(0))
    probe = jax.random.key(99)
    optimizer = tr.make_optimizer(lr=1e-2, warmup=2, total_steps=25, weight_decay=0.0)
    with tr.dense_experts():
        loss = jax.jit(lambda p: tr.block_diffusion_loss(config, p, batch, probe, 0.5, 1.0))
        before, parts = loss(params)
        # the step donates its state: a copy of the module's shared weights
        fresh = jax.tree.map(jnp.copy, params)
        state = {"params": fresh, "opt_state": optimizer.init(fresh), "step": jnp.zeros((), jnp.int32)}
        # a pool of the 8 examples: each step draws 8 of them
        step = tr.make_train_step(config, optimizer, 0.5, 1.0, batch_size=8)
        for i in range(25):
            state, _ = step(state, batch, jax.random.key(i))
        after, _ = loss(state["params"])
    assert set(parts) == {"diffusion", "encoder"} and int(state["step"]) == 25
    assert float(after) < 0.6 * float(before), (before, after)


def test_the_export_reads_back_in_dllm_jax_and_transformers(tok, config, params, tmp_path):
    tokenizer_dir = tr.save_tiny_tokenizer(tmp_path / "tokenizer", tr.MAX_POSITIONS, tr.FAMILY)
    folder = tr.export(tmp_path / "model", config, params, tokenizer_dir, tr.GENERATION)
    assert json.loads((folder / "config.json").read_text())["canvas_length"] == tr.CANVAS_LENGTH
    info, read = read_checkpoint(folder, dtype="float32")
    assert info.config == config and not info.skipped
    jax.tree.map(np.testing.assert_array_equal, read, jax.device_get(params))

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, attn_implementation="sdpa").eval()
    generation = DiffusionGemmaGenerationConfig.from_pretrained(folder)
    assert generation.max_denoising_steps == tr.GENERATION.max_denoising_steps
    assert generation.eos_token_id == list(config.eos_token_ids) and generation.pad_token_id == tok.pad_token_id
    prompt = np.asarray(tr.prompt_ids(tok, LONG.prompt))[None]
    canvas = np.random.default_rng(1).integers(0, config.vocab_size, (1, tr.CANVAS_LENGTH))
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(prompt), decoder_input_ids=torch.from_numpy(canvas)).logits
    # a cache with room for a canvas after the prompt: the shapes of the objective test's
    # step-by-step passes, whose compiled programs this reuses
    cache = dg.init_cache(config, 1, prompt.shape[1] + tr.CANVAS_LENGTH)
    cache, _ = ENCODE(config, params, jnp.asarray(prompt), cache)
    ours = DECODE(config, params, jnp.asarray(canvas), cache)
    assert relative_error(np.asarray(ours), theirs.numpy()) < 1e-5


@pytest.mark.parametrize("variant", [bench.looped_expert_mlp, bench.batched_expert_mlp])
def test_the_benchmarks_expert_variants_match_the_dense_reference(variant):
    rng = np.random.default_rng(3)
    T, D, E, F, K = 40, 16, 6, 12, 2
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    # expert 5 gets no row, expert 0 the most
    experts = jnp.asarray(
        np.stack([rng.choice(5, 2, replace=False, p=[0.4, 0.15, 0.15, 0.15, 0.15]) for _ in range(T)])
    )
    weights = jnp.asarray(rng.uniform(size=(T, K)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(E, 2 * F, D)) / D**0.5, jnp.float32)
    down = jnp.asarray(rng.normal(size=(E, D, F)) / F**0.5, jnp.float32)
    capacity = int(np.bincount(np.asarray(experts).ravel()).max())
    got = jax.jit(variant, static_argnums=5)(x, weights, experts.astype(jnp.int32), gate_up, down, capacity)
    want = dense_expert_mlp(x, weights, experts.astype(jnp.int32), gate_up, down)
    assert relative_error(np.asarray(got), np.asarray(want)) < 1e-5


def test_the_benchmarks_weight_floor_counts_the_experts_the_rows_reach():
    config = bench.model_config(tiny=True)
    per_expert = bench.expert_bytes(config) * config.n_layers
    assert bench.pass_weight_bytes(config, 10_000) == pytest.approx(bench.weight_bytes(config))
    # one row reaches top_k experts of each layer
    assert bench.pass_weight_bytes(config, 1) == pytest.approx(
        bench.weight_bytes(config) - (config.n_experts - config.top_k_experts) * per_expert
    )
