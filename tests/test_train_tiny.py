import itertools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.evaluation import tiny_tasks
from dllm_jax.evaluation.tiny_tasks import Problem
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.models.transformer import init_params
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.text.tiny_tokenizer import EOT, build_tiny_tokenizer
from scripts import train_tiny as tr
from tests.conftest import RUN_HEAVY_COMPILER_OPTIONS

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_training_rows_are_prompt_answer_eot_then_eos(tok):
    problem = Problem("arith", "1+2*3", "1+2=3\n3*3=9\n#### 9", "9")
    tokens, prompt_len = tr.encode_training_batch(tok, [problem], seq_len=64)
    prompt = tr.prompt_ids(tok, problem.prompt)
    assert prompt_len.tolist() == [len(prompt)] and tokens.shape == (1, 64)
    assert tokens[0, : len(prompt)].tolist() == prompt
    n = len(problem.answer)
    assert tok.decode(tokens[0, len(prompt) : len(prompt) + n].tolist()) == problem.answer
    assert tokens[0, len(prompt) + n] == tok.convert_tokens_to_ids(EOT)
    assert (tokens[0, len(prompt) + n + 1 :] == tok.eos_token_id).all()
    with pytest.raises(ValueError, match="do not fit"):
        tr.encode_training_batch(tok, [problem], seq_len=40)


def small_config(tok):
    return tr.tiny_model_config(tok, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64)


def test_loss_falls_after_a_few_training_steps(tok):
    config = small_config(tok)
    batch = tr.encode_training_batch(tok, list(itertools.islice(tiny_tasks.problems("train", 0), 8)))
    probe_key = jax.random.key(99)
    optimizer = tr.make_optimizer(lr=1e-2, warmup=2, total_steps=30, weight_decay=0.0)
    params = init_params(config, jax.random.key(0))
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    before = float(tr.masked_diffusion_loss(config, params, *batch, probe_key))
    step = tr.make_train_step(config, optimizer)
    for i in range(30):
        state, _ = step(state, *batch, jax.random.key(i))
    after = float(tr.masked_diffusion_loss(config, state["params"], *batch, probe_key))
    assert int(state["step"]) == 30
    assert after < 0.6 * before, (before, after)


def test_masking_spares_the_prompt_and_follows_the_ratio(tok):
    tokens, prompt_len = tr.encode_training_batch(tok, list(itertools.islice(tiny_tasks.problems("train", 1), 64)))
    noisy, masked, p_mask = jax.jit(tr.corrupt, static_argnums=2)(
        tokens, prompt_len, tok.mask_token_id, jax.random.key(5)
    )
    noisy, masked, p_mask = map(np.asarray, (noisy, masked, p_mask))
    answer = np.arange(tokens.shape[1])[None] >= prompt_len[:, None]
    assert not masked[~answer].any()
    np.testing.assert_array_equal(noisy[~answer], tokens[~answer])
    np.testing.assert_array_equal(noisy[masked], tok.mask_token_id)
    np.testing.assert_array_equal(noisy[answer & ~masked], tokens[answer & ~masked])
    assert ((p_mask > 0) & (p_mask <= 1)).all() and p_mask.std() > 0.1  # one ratio per sequence
    # the masked share of each answer follows that sequence's ratio
    share = masked.sum(1) / answer.sum(1)
    assert np.corrcoef(share, p_mask[:, 0])[0, 1] > 0.95


@pytest.mark.integration  # whole evaluations: 20 held-out decodes of 32 full passes each
def test_the_held_out_metric_is_the_engine_on_swapped_weights():
    """The trainer scores with the engine (the trainer's own tokenizer, weights swapped in
    between evaluations without recompiling), as scripts/eval.py scores. A canvas of 32: the
    trained model's right answers to these problems are at most 31 tokens long (it solves the
    same 11 of 12 as with the trainer's 64), and each evaluation's gen_len full passes over
    the slots cost 2.5 times less. The loop runs far longer than it compiles (32 steps per
    four problems), so the untrained model is scored on one batch of four problems and the
    fresh engine cross-checks the answers of that batch token for token."""
    from dllm_jax.engine.engine import Engine, GenerationError
    from dllm_jax.models.loading import load_model
    from dllm_jax.text.tokenizer import Tokenizer

    tiny = load_model(tiny_model_path(), dtype="float32")
    tok = build_tiny_tokenizer(tr.SEQ_LEN)
    problems = tiny_tasks.held_out_problems(12)
    gen = 32
    engine = Engine(
        tiny.config,
        init_params(tiny.config, jax.random.key(3)),
        Tokenizer.from_transformers(tok),
        compiler_options=RUN_HEAVY_COMPILER_OPTIONS,
    )
    untrained = tr.held_out_accuracy(engine, problems[:4], gen_len=gen, batch_size=4)
    engine.swap_weights(tiny.weights)
    seen = []  # what held_out_accuracy's generate returned, to score and cross-check its texts
    generate = engine.generate
    engine.generate = lambda *args, **kwargs: seen.append(generate(*args, **kwargs)) or seen[-1]
    trained = tr.held_out_accuracy(engine, problems, gen_len=gen, batch_size=4)
    assert engine.num_compilations == 1
    assert untrained["all"] == 0.0 and trained["all"] >= 0.75, (untrained, trained)
    # scored alike: exact match of each answer, overall and per task
    texts = [r.text for r in seen[0].results]
    correct = [tiny_tasks.is_correct(p, t) for p, t in zip(problems, texts)]
    by_task = {task: [ok for p, ok in zip(problems, correct) if p.task == task] for task in tiny_tasks.TASKS}
    assert trained == {"all": sum(correct) / 12, **{t: sum(oks) / len(oks) for t, oks in by_task.items()}}
    # the same answers as the engine's exact one-per-step decode over one block, on a fresh
    # engine with the model's own tokenizer and weights (the trainer's tokenizer encodes alike,
    # swapped weights decode as loaded ones)
    decode = DecodeConfig(method="llada", gen_length=gen, block_length=gen, steps=gen, batch_size=4)
    fresh = Engine(tiny.config, tiny.weights, tiny.tokenizer, compiler_options=RUN_HEAVY_COMPILER_OPTIONS)
    reference = fresh.generate([p.prompt for p in problems[:4]], decode_config=decode, chat=True).results
    assert [(r.token_ids, r.steps) for r in seen[0].results[:4]] == [(r.token_ids, r.steps) for r in reference]
    assert texts[:4] == [r.text for r in reference]
    bad = dict(tiny.weights, lm_head={"kernel": tiny.weights["lm_head"]["kernel"][:, :-1]})
    with pytest.raises(GenerationError, match=r"swap_weights: \['lm_head'\]\['kernel'\] is"):
        engine.swap_weights(bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--steps", "3", "--mix", "poetry=1"],
        ["--steps", "3", "--mix", "arith"],
        ["--steps", "3", "--lr", "-1"],
        ["--steps", "3", "--d-model", "30", "--n-heads", "4"],
        ["--steps", "3", "--resume"],
    ],
)
def test_bad_command_lines_exit_with_code_2(tmp_path, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        tr.main(argv + ["--out", str(tmp_path / "run")])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.integration  # full tier: training runs
def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    common = [
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--d-model",
        "16",
        "--n-layers",
        "1",
        "--n-heads",
        "2",
        "--mlp-hidden",
        "32",
        "--ckpt-every",
        "1",
        "--eval-every",
        "1000",
        "--eval-problems",
        "2",  # as many as the final evaluation: one compiled loop (its slots) for both
        "--final-eval-problems",
        "2",
        "--gen-length",
        "40",
        "--out",
        str(tmp_path / "run"),
    ]
    assert tr.main(common + ["--export", str(tmp_path / "straight")]) == 0
    # forget the last step, as if the run had been killed after step 2
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "3")
    assert tr.main(common + ["--resume", "--export", str(tmp_path / "resumed")]) == 0
    straight = (tmp_path / "straight" / "model.safetensors").read_bytes()
    assert straight == (tmp_path / "resumed" / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as exc:  # a finished run folder is not silently overwritten
        tr.main(common)
    assert exc.value.code == 2


# ----- --family dream ------------------------------------------------------------------------


def test_dream_rows_use_chatml_and_im_end():
    tok = build_tiny_tokenizer(family="dream")
    problem = Problem("sort", "sort: 3 1 2", "1 2 3\n#### 123", "123")
    tokens, prompt_len = tr.encode_training_batch(tok, [problem], seq_len=64)
    assert (
        tok.decode(tokens[0, : prompt_len[0]].tolist())
        == "<|im_start|>user\nsort: 3 1 2<|im_end|>\n<|im_start|>assistant\n"
    )
    n = len(problem.answer)
    assert tokens[0, prompt_len[0] + n] == tok.convert_tokens_to_ids("<|im_end|>")
    assert (tokens[0, prompt_len[0] + n + 1 :] == tok.eos_token_id).all()


def test_dream_loss_falls_after_a_few_training_steps():
    """A Dream config (biases, GQA) trains: the loss, scored on the shifted rows, falls."""
    tok = build_tiny_tokenizer(family="dream")
    config = tr.tiny_model_config(tok, d_model=32, n_layers=1, n_heads=4, mlp_hidden=64, family="dream", n_kv_heads=2)
    assert (config.family, config.qkv_bias, config.n_kv_heads, config.logit_shift) == ("dream", True, 2, 1)
    batch = tr.encode_training_batch(tok, list(itertools.islice(tiny_tasks.problems("train", 0), 8)))
    optimizer = tr.make_optimizer(lr=1e-2, warmup=2, total_steps=30, weight_decay=0.0)
    params = init_params(config, jax.random.key(0))
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    probe = jax.random.key(99)
    before = float(tr.masked_diffusion_loss(config, params, *batch, probe))
    step = tr.make_train_step(config, optimizer)
    for i in range(30):
        state, _ = step(state, *batch, jax.random.key(i))
    assert float(tr.masked_diffusion_loss(config, state["params"], *batch, probe)) < 0.6 * before


@pytest.mark.engine
@pytest.mark.integration  # full tier: training runs
def test_dream_run_exports_a_dream_folder_the_engine_loads(tmp_path):
    from dllm_jax import DecodeConfig, Engine

    argv = [
        "--family",
        "dream",
        "--n-kv-heads",
        "1",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--d-model",
        "32",
        "--n-layers",
        "1",
        "--n-heads",
        "2",
        "--mlp-hidden",
        "32",
        "--eval-every",
        "1000",
        "--eval-problems",
        "2",  # as many as the final evaluation: one compiled loop (its slots) for both
        "--final-eval-problems",
        "2",
        "--gen-length",
        "40",
        "--out",
        str(tmp_path / "run"),
        "--export",
        str(tmp_path / "tiny-dream"),
    ]
    assert tr.main(argv) == 0
    engine = Engine.from_pretrained(str(tmp_path / "tiny-dream"), dtype="float32", backend="xla")
    assert engine.config.family == "dream" and engine.config.n_kv_heads == 1
    out = engine.generate(["sort: 2 1"], DecodeConfig(method="flash_cache", gen_length=16, batch_size=1))
    assert out.results[0].reference_num_tokens >= 1
