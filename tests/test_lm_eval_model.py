"""The dllm_jax lm-eval model on the embedded tiny model, over local task files (no Hub).

generate_until through lm_eval.simple_evaluate and through the command line scores what
scripts/eval.py scores on the same problems and settings (flash_cache and Fast-dLLM's dual cache);
loglikelihood (LLaDA's Monte-Carlo estimator) picks the right answer of a multiple-choice task
where the model solves the problem, and equals a plain computation over the same masks.
"""

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from dllm_jax import SamplingParams
from dllm_jax.evaluation import tiny_tasks
from dllm_jax.evaluation.lm_eval_model import DLLMJaxLM, GenerationKwargsError, LoglikelihoodRollingError
from dllm_jax.evaluation.mc_loglikelihood import MonteCarloLoglikelihood
from dllm_jax.evaluation.model_args import ModelArgsError, parse_model_args
from dllm_jax.evaluation.tiny_task_files import GEN_TASK, MC_TASK, write_tiny_tasks
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.models.transformer import forward, predictions
from dllm_jax.policies.entropy_bound import DenoiseSettings

pytestmark = pytest.mark.unit  # the tests that decode or evaluate say so

ROOT = Path(__file__).resolve().parent.parent
PROBLEMS = 16
GEN_LENGTH, BATCH = 64, 8
# scripts/eval.py's settings of the same names, as model_args
SETTINGS = {
    "flash-track4-t0.9": dict(method="flash_cache", mask_num=4, track_num=4, threshold=0.9),
    "fast_dllm-dual-t0.9": dict(method="fast_dllm", cache="dual", block_length=32, threshold=0.9),
}
MODEL = str(tiny_model_path())
# Monte-Carlo samples (LLaDA's default: 128), per forward pass; multiple-choice problems scored (at
# 16 samples the right answers of the 8 win by 7 nats or more: the picks do not hang on the draw)
MC_NUM, MC_BATCH, MC_PROBLEMS = 16, 8, 8

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _eval_script():
    spec = importlib.util.spec_from_file_location("eval_script", ROOT / "scripts" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def make_lm(setting: str) -> DLLMJaxLM:
    return DLLMJaxLM(
        pretrained=MODEL,
        backend="xla",
        gen_length=GEN_LENGTH,
        batch_size=BATCH,
        mc_num=MC_NUM,
        mc_batch_size=MC_BATCH,
        **SETTINGS[setting],
    )


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_tiny_tasks(tmp_path_factory.mktemp("tiny_tasks"), PROBLEMS)


@pytest.fixture(scope="module")
def flash_lm():
    return make_lm("flash-track4-t0.9")


def script_result(lm: DLLMJaxLM, setting: str) -> dict:
    """scripts/eval.py's evaluation of the same problems and setting, on the model's own engine."""
    script = _eval_script()
    same = script.settings(GEN_LENGTH, BATCH)[setting]
    assert same.decode_config == lm.decode_config and same.sampling.threshold == lm.args.threshold
    return script.evaluate(lm.engine, tiny_tasks.held_out_problems(PROBLEMS), same, None)


@pytest.fixture(scope="module")
def flash_script(flash_lm):
    return script_result(flash_lm, "flash-track4-t0.9")


@pytest.fixture(scope="module")
def task_manager(task_dir):
    # only the local tasks: indexing lm-eval's thousands of task files takes a minute on a busy CPU
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def evaluate_tasks(lm, task_manager, tasks, limit=None):
    return simple_evaluate(
        model=lm, tasks=tasks, apply_chat_template=True, log_samples=True, limit=limit, task_manager=task_manager
    )


def check_generation_matches_script(results: dict, script: dict) -> None:
    assert results["results"][GEN_TASK]["exact_match,none"] == pytest.approx(script["accuracy"])
    assert script["accuracy"] >= 0.75  # the model solves most problems: the comparison means something
    finals = {s["doc_id"]: tiny_tasks.extract_final(s["filtered_resps"][0]) for s in results["samples"][GEN_TASK]}
    assert [finals[i] for i in range(PROBLEMS)] == [tiny_tasks.extract_final(t) for t in script["texts"]]
    throughput = results["config"]["dllm_jax"]["throughput"]
    assert throughput["nfe"] == script["steps"] and throughput["num_tokens"] == script["tokens"]
    assert throughput["tokens_per_step"] == pytest.approx(script["tokens_per_step"])
    assert throughput["tokens_per_second"] > 0


@pytest.mark.integration
def test_generate_until_scores_what_eval_script_scores_flash_cache(flash_lm, flash_script, task_manager):
    results = evaluate_tasks(flash_lm, task_manager, [GEN_TASK])
    check_generation_matches_script(results, flash_script)


@pytest.mark.integration
def test_generate_until_scores_what_eval_script_scores_fast_dllm_baseline(task_manager):
    lm = make_lm("fast_dllm-dual-t0.9")
    results = evaluate_tasks(lm, task_manager, [GEN_TASK])
    check_generation_matches_script(results, script_result(lm, "fast_dllm-dual-t0.9"))


@pytest.mark.integration
def test_lm_eval_command_line_scores_what_eval_script_scores(flash_script, task_dir, tmp_path):
    args = ",".join(f"{k}={v}" for k, v in SETTINGS["flash-track4-t0.9"].items())
    stats = tmp_path / "stats.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dllm_jax.evaluation",
            "--model",
            "dllm_jax",
            "--model_args",
            f"pretrained={MODEL},{args},gen_length={GEN_LENGTH},batch_size={BATCH},backend=xla,stats_path={stats}",
            "--tasks",
            GEN_TASK,
            "--include_path",
            str(task_dir),
            "--apply_chat_template",
            "--output_path",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "out").rglob("results*.json")
    report = json.loads(path.read_text())
    assert report["results"][GEN_TASK]["exact_match,none"] == pytest.approx(flash_script["accuracy"])
    sidecar = json.loads(stats.read_text())
    assert sidecar["decode"]["method"] == "flash_cache" and sidecar["throughput"]["nfe"] == flash_script["steps"]
    assert report["config"]["dllm_jax"]["throughput"]["num_tokens"] == flash_script["tokens"]


def plain_estimate(config, params, prefix, target, masks, batch, cfg_scale=0.0) -> float:
    """LLaDA's get_log_likelihood written out: one unpadded forward per noisy row, float64 softmax
    (a Dream model's prediction of position i read from row i - 1, as Dream's own code does)."""

    # one compiled forward for every row (they have one length): the rows run eagerly took 0.2 s each
    forward_row = jax.jit(lambda weights, tokens: predictions(config, forward(config, weights, tokens)))

    def run(tokens):
        return np.asarray(forward_row(params, jnp.asarray([tokens])), np.float64)[0]

    L, P = len(target), len(prefix)
    losses = []
    for start in range(0, len(masks), batch):
        total = 0.0
        for row in masks[start : start + batch]:
            noisy = prefix + [config.mask_token_id if m else t for m, t in zip(row, target)]
            logits = run(noisy)
            if cfg_scale:
                blind = [config.mask_token_id] * P + noisy[P:]
                un = run(blind)
                logits = un + (cfg_scale + 1) * (logits - un)
            logp = (
                logits
                - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
                - logits.max(-1, keepdims=True)
            )
            share = sum(row) / L
            total += sum(-logp[P + j, target[j]] / share for j in range(L) if row[j])
        losses.append(total / batch)
    return -sum(losses) / len(losses)


def llada_counts(k: int, batch: int, length: int) -> list[int]:
    """LLaDA's stratified mask counts for a draw k, in plain Python (round half to even, as torch)."""
    return [((round(k + i * (length / batch)) - 1) % length) + 1 for i in range(batch)]


@pytest.mark.integration
def test_loglikelihood_picks_the_right_answer_where_the_model_solves_it(flash_lm, flash_script, task_manager):
    results = evaluate_tasks(flash_lm, task_manager, [MC_TASK], limit=MC_PROBLEMS)
    problems = tiny_tasks.held_out_problems(MC_PROBLEMS)
    solved = [tiny_tasks.is_correct(p, t) for p, t in zip(problems, flash_script["texts"])]
    samples = sorted(results["samples"][MC_TASK], key=lambda s: s["doc_id"])
    picked = [s["acc"] == 1.0 for s in samples]
    assert len(samples) == MC_PROBLEMS and sum(solved) >= MC_PROBLEMS - 2
    assert all(p for p, ok in zip(picked, solved) if ok), list(zip(picked, solved))

    # the values lm-eval got are LLaDA's estimator over the masks the scorer drew
    sample = samples[0]
    for (context, continuation), resps in list(zip(sample["arguments"], sample["resps"]))[:1]:
        ((value, _),) = resps  # one (loglikelihood, is_greedy) per choice
        prefix, target = flash_lm.encode_pair(context, continuation)
        estimate = flash_lm.scorer.estimate(prefix, target)
        assert estimate.value == value
        masks = estimate.masks
        assert masks.shape == (MC_NUM, len(target))
        for start in range(0, len(masks), MC_BATCH):
            counts = masks[start : start + MC_BATCH].sum(axis=1).tolist()
            assert any(counts == llada_counts(k, MC_BATCH, len(target)) for k in range(1, len(target) + 1)), counts
        plain = plain_estimate(flash_lm.config, flash_lm.engine.weights, prefix, target, masks.tolist(), MC_BATCH)
        assert value == pytest.approx(plain, rel=1e-4)


@pytest.mark.engine
def test_guided_estimate_equals_the_plain_computation(flash_lm):
    guided = MonteCarloLoglikelihood(
        flash_lm.config, flash_lm.engine.weights, mc_num=8, mc_batch_size=4, cfg_scale=0.5, seed=3
    )
    prefix, target = flash_lm.encode_pair(
        flash_lm.apply_chat_template([{"role": "user", "content": "sort: 3 1 2"}]), "1 2 3\n#### 123"
    )
    estimate = guided.estimate(prefix, target)
    plain = plain_estimate(
        flash_lm.config, flash_lm.engine.weights, prefix, target, estimate.masks.tolist(), 4, cfg_scale=0.5
    )
    assert estimate.value == pytest.approx(plain, rel=1e-4)
    assert guided.estimate(prefix, target).value == estimate.value  # same request, same masks


@pytest.mark.integration  # full tier: a front end on another family than the default LLaDA
def test_a_dream_folder_is_scored_like_a_llada_one():
    """pretrained=tiny-dream (the embedded Dream model, by name): the estimator reads Dream's
    shifted predictions, so it equals the plain computation and prefers the right answer."""
    lm = DLLMJaxLM(
        pretrained="tiny-dream",
        backend="xla",
        gen_length=GEN_LENGTH,
        batch_size=4,
        mc_num=8,
        mc_batch_size=4,
        **SETTINGS["flash-track4-t0.9"],
    )
    assert lm.config.family == "dream"
    context = lm.apply_chat_template([{"role": "user", "content": "sort: 3 1 2"}])
    prefix, target = lm.encode_pair(context, "1 2 3\n#### 123")
    estimate = lm.scorer.estimate(prefix, target)
    plain = plain_estimate(lm.config, lm.engine.weights, prefix, target, estimate.masks.tolist(), 4)
    assert estimate.value == pytest.approx(plain, rel=1e-4)
    wrong = lm.scorer.estimate(*lm.encode_pair(context, "1 3 2\n#### 132"))
    assert estimate.value > wrong.value
    (answer,) = lm.generate_until([request(context, until=[])])
    ids = (
        lm.engine.generate(
            [lm.encode(context)], SamplingParams(threshold=lm.args.threshold), decode_config=lm.decode_config
        )
        .results[0]
        .token_ids
    )
    assert answer == lm.tokenizer.decode(ids, skip_special_tokens=True) and "####" in answer


def request(context: str, **gen_kwargs) -> Instance:
    return Instance("generate_until", {}, (context, gen_kwargs), 0, ("t", 0, 1))


@pytest.mark.engine
def test_generation_kwargs_are_honoured_or_refused_by_name(flash_lm):
    context = flash_lm.apply_chat_template([{"role": "user", "content": "sort: 5 3 9 1"}])
    full, short, stopped, sampled = flash_lm.generate_until(
        [
            request(context, until=[]),
            request(context, until=[], max_gen_toks=3),
            request(context, until="#"),
            request(context, until=[], do_sample=True, temperature=0.5, top_k=2),
        ]
    )
    assert full.startswith("1 3 5 9") and len(flash_lm.encode(short)) <= 3 and stopped == full.split("#")[0]
    assert tiny_tasks.extract_final(sampled) is not None
    with pytest.raises(GenerationKwargsError, match="repetition_penalty=1.2"):
        flash_lm.generate_until([request(context, until=[], repetition_penalty=1.2)])
    with pytest.raises(GenerationKwargsError, match="top_p"):
        flash_lm.generate_until([request(context, do_sample=True, temperature=1.0, top_p=1.5)])
    with pytest.raises(GenerationKwargsError, match="do_sample=True needs temperature"):
        flash_lm.generate_until([request(context, do_sample=True)])
    with pytest.raises(LoglikelihoodRollingError, match="no left-to-right factorisation"):
        flash_lm.loglikelihood_rolling([request("text")])


def test_stop_strings_are_cut_on_the_text_with_special_tokens(flash_lm):
    ids = flash_lm.encode("12\n#### 3<|eot_id|>more")
    assert flash_lm.cut_at_stop_strings(ids, ("<|eot_id|>",)) == "12\n#### 3"
    assert flash_lm.cut_at_stop_strings(ids, ("\n", "<|eot_id|>")) == "12"
    assert flash_lm.cut_at_stop_strings(ids, ()) == "12\n#### 3more"


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(pretrained="p", windw=16), "unknown key 'windw'"),
        (dict(pretrained="p", gen_length="long"), "gen_length='long' (str): expected int"),
        (dict(pretrained="p", verify=1), "verify=1 (int): expected bool"),
        (dict(pretrained="p", temperature=0.5), "temperature is a generation kwarg"),
        (dict(pretrained="p", method="beam"), "method='beam'"),
        (dict(pretrained="p", mc_num=100, batch_size=32), "mc_num=100 is not a multiple of mc_batch_size=32"),
        (dict(method="llada"), "pretrained=PATH is required"),
        (dict(pretrained="p", generation_config="vllm"), "generation_config='vllm': expected one of auto, none"),
    ],
)
def test_bad_model_args_name_the_key(args, message):
    with pytest.raises(ModelArgsError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        parse_model_args(args)
    assert "\n" not in str(e.value)


def test_model_args_types_and_the_harness_batch_size():
    parsed = parse_model_args(dict(pretrained="p", threshold=1, batch_size=4, device="cuda:0"), harness_batch_size=1)
    assert parsed.adapter.threshold == 1.0 and isinstance(parsed.adapter.threshold, float)
    assert parsed.decode_config.batch_size == 4  # model_args win over lm-eval's --batch_size
    assert parse_model_args(dict(pretrained="p"), harness_batch_size="16").decode_config.batch_size == 16
    with pytest.raises(ModelArgsError, match="batch_size='auto'"):
        parse_model_args(dict(pretrained="p"), harness_batch_size="auto")


def test_local_tasks_are_run_without_indexing_lm_evals_built_in_ones(task_dir):
    import argparse

    import lm_eval.tasks

    from dllm_jax.evaluation.__main__ import index_only_the_include_path, tasks_all_local

    local = str(task_dir)
    assert tasks_all_local(local, [GEN_TASK, MC_TASK]) and tasks_all_local(local, [f"{GEN_TASK},{MC_TASK}"])
    assert not tasks_all_local(local, [GEN_TASK, "gsm8k"])  # a built-in task: lm-eval indexes them all
    assert not tasks_all_local(local, ["tiny_*"]) and not tasks_all_local(local, [str(task_dir / "x.yaml")])
    assert not tasks_all_local(None, [GEN_TASK]) and not tasks_all_local(local, None)
    built_in = lm_eval.tasks.TaskManager
    with index_only_the_include_path(argparse.Namespace(include_path=local, tasks=[GEN_TASK])):
        # as lm-eval's run command makes it (lm_eval.config.evaluate_config.process_tasks)
        manager = lm_eval.tasks.TaskManager(include_path=local, metadata={})
        assert set(manager.all_subtasks) == {GEN_TASK, MC_TASK}
    assert lm_eval.tasks.TaskManager is built_in
    with index_only_the_include_path(argparse.Namespace(include_path=local, tasks=["gsm8k"])):
        assert lm_eval.tasks.TaskManager is built_in


def test_command_line_names_a_bad_model_arg_in_one_line(task_dir, monkeypatch, capsys):
    from dllm_jax.evaluation.__main__ import main

    monkeypatch.setattr(
        sys,
        "argv",
        [
            "dllm_jax.evaluation",
            "--model",
            "dllm_jax",
            "--model_args",
            f"pretrained={MODEL},trak_num=2",
            "--tasks",
            GEN_TASK,
            "--include_path",
            str(task_dir),
        ],
    )
    assert main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: model_args: unknown key 'trak_num'") and not any(
        "Traceback" in line for line in err
    )


@pytest.mark.engine
def test_greedy_check_is_llada_suffix_greedy_prediction(flash_lm):
    """is_check_greedy: True exactly for the continuation that one-most-confident-commit-per-step
    decoding (written out here over unpadded forwards) produces."""
    config, params = flash_lm.config, flash_lm.engine.weights
    prefix = flash_lm.encode(flash_lm.apply_chat_template([{"role": "user", "content": "sort: 3 1 2"}]))
    L = 12
    seq = prefix + [config.mask_token_id] * L
    for _ in range(L):
        logits = np.asarray(forward(config, params, jnp.asarray([seq])), np.float64)[0, len(prefix) :]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        confidence = np.where(
            np.asarray(seq[len(prefix) :]) == config.mask_token_id, (probs / probs.sum(-1, keepdims=True)).max(-1), -1
        )
        j = int(np.argmax(confidence))
        seq[len(prefix) + j] = int(np.argmax(logits[j]))
    greedy = seq[len(prefix) :]
    other = greedy[:-1] + [(greedy[-1] + 1) % config.vocab_size]
    assert flash_lm.scorer.greedy_reproduces(prefix, greedy) and not flash_lm.scorer.greedy_reproduces(prefix, other)


# ----- DiffusionGemma --------------------------------------------------------------------------

# the embedded tiny DiffusionGemma's generation_config.json values
DG_SAMPLER = dict(
    max_denoising_steps=16, t_min=0.1, t_max=0.5, entropy_bound=1.0, stability_threshold=1, confidence_threshold=0.01
)
DG_PROBLEMS = 16


@pytest.fixture(scope="module")
def gemma_lm():
    """pretrained=tiny-diffusiongemma without a method: the family's own (one compiled canvas loop),
    its sampler's values its generation_config.json's."""
    return DLLMJaxLM(pretrained="tiny-diffusiongemma", backend="xla", gen_length=GEN_LENGTH, batch_size=BATCH)


@pytest.fixture(scope="module")
def gemma_task_manager(tmp_path_factory):
    folder = write_tiny_tasks(tmp_path_factory.mktemp("gemma_tasks"), DG_PROBLEMS, end_of_turn="<end_of_turn>")
    return TaskManager(include_path=str(folder), include_defaults=False)


@functools.cache
def _encoder_logits(config, length: int):
    """The encoder's logits over an unpadded sequence (no bucket, no padding): float32 [1, T, V]."""

    def run(weights, tokens):
        _, _, hidden = dg.encode(config, weights, tokens, dg.init_cache(config, 1, length), return_hidden=True)
        return dg.final_logits(config, weights, hidden[-1])

    return jax.jit(run)


def plain_encoder_loglikelihood(lm, prefix, target) -> float:
    """log p(target | prefix) written out: one unpadded causal pass, float64 log-softmax of row
    P - 1 + j for target token j."""
    sequence = prefix + target
    logits = _encoder_logits(lm.config, len(sequence))(lm.engine.weights, jnp.asarray([sequence], jnp.int32))
    logits = np.asarray(logits, np.float64)[0]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(sum(logp[len(prefix) - 1 + j, t] for j, t in enumerate(target)))


@pytest.mark.integration
def test_a_diffusion_gemma_model_generates_and_scores_through_lm_eval(gemma_lm, gemma_task_manager):
    """generate_until: the family's method, every request with its own seed; it scores what the
    engine's own answers to the same prompts score. loglikelihood: the encoder's exact causal
    likelihood (no Monte-Carlo), which picks the right answer of most problems."""
    lm = gemma_lm
    assert lm.decode_config.method == "diffusion_gemma" and lm.decode_config.block_length == 32
    results = simple_evaluate(
        model=lm, tasks=[GEN_TASK, MC_TASK], apply_chat_template=True, log_samples=True, task_manager=gemma_task_manager
    )
    samples = sorted(results["samples"][GEN_TASK], key=lambda s: s["doc_id"])
    problems = tiny_tasks.held_out_problems(DG_PROBLEMS)
    prompts = [lm.encode(s["arguments"][0][0]) for s in samples]
    sampling = [SamplingParams(seed=i) for i in range(DG_PROBLEMS)]
    own = lm.engine.generate(prompts, sampling, decode_config=lm.decode_config)  # the same compiled loop
    assert lm.engine.num_compilations == 1
    finals = [tiny_tasks.extract_final(r.text) for r in own.results]
    assert [tiny_tasks.extract_final(s["filtered_resps"][0]) for s in samples] == finals
    accuracy = sum(tiny_tasks.is_correct(p, r.text) for p, r in zip(problems, own.results)) / DG_PROBLEMS
    assert results["results"][GEN_TASK]["exact_match,none"] == pytest.approx(accuracy) and accuracy >= 0.25

    assert results["results"][MC_TASK]["acc,none"] >= 0.75  # 0.875 measured (14 of 16)
    sample = min(results["samples"][MC_TASK], key=lambda s: s["doc_id"])
    for (context, continuation), ((value, greedy),) in list(zip(sample["arguments"], sample["resps"]))[:2]:
        prefix, target = lm.encode_pair(context, continuation)
        assert value == pytest.approx(plain_encoder_loglikelihood(lm, prefix, target), rel=1e-5, abs=1e-4)
        assert isinstance(greedy, bool)


def test_what_neither_model_args_nor_the_task_set_is_left_to_the_models_generation_config(flash_lm, gemma_lm):
    def sampling(lm, **gen_kwargs):
        context = lm.apply_chat_template([{"role": "user", "content": "sort: 3 1 2"}])
        return lm._generation_request(0, request(context, until=[], **gen_kwargs))[1]

    # a task that names neither temperature nor do_sample: the model's; one that does: its own
    assert sampling(flash_lm).temperature is None
    assert sampling(flash_lm, do_sample=False).temperature == sampling(flash_lm, temperature=0.0).temperature == 0.0
    sampled = sampling(flash_lm, do_sample=True, temperature=0.5)
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.5, None, None)
    unset = sampling(gemma_lm)
    assert [getattr(unset, name) for name in DG_SAMPLER] == [None] * len(DG_SAMPLER)
    off = DLLMJaxLM(pretrained="tiny-diffusiongemma", generation_config="none")
    assert dict(off.engine.generation_defaults.values) == {} and gemma_lm.engine.generation_defaults.values


@pytest.mark.integration  # full tier: a front end on another family than the default LLaDA
def test_the_embedded_model_decodes_with_its_generation_config_values(gemma_lm):
    """Unset, the sampler's values are the model's generation_config.json's: the answer (and its
    steps) of a request that sets none is that of one setting the file's values, not that of one
    setting transformers' class defaults (what the engine used before it read the file)."""
    engine = gemma_lm.engine
    assert dict(engine.generation_defaults.values) == dict(DG_SAMPLER, max_new_tokens=GEN_LENGTH)
    class_defaults = dataclasses.asdict(DenoiseSettings())
    sampling = [SamplingParams(seed=0), SamplingParams(seed=0, **DG_SAMPLER), SamplingParams(seed=0, **class_defaults)]
    prompt = engine.encode(["(3+2)*4-7"], chat=True)[0]
    unset, from_file, from_class = engine.generate([prompt] * 3, sampling, decode_config=gemma_lm.decode_config).results
    assert (unset.token_ids, unset.steps) == (from_file.token_ids, from_file.steps)
    assert from_class.token_ids != from_file.token_ids  # the values matter: the comparison means something


@pytest.mark.integration  # full tier: a front end on another family than the default LLaDA
def test_diffusion_gemma_rolling_loglikelihood_is_the_encoders_over_rolling_windows(gemma_lm):
    lm = gemma_lm
    bos = [lm.config.bos_token_id]
    short = "sort: 3 1 2"
    (value,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0, ("t", 0, 1))])
    assert value == pytest.approx(plain_encoder_loglikelihood(lm, bos, lm.encode(short)), rel=1e-5)
    # past max_sequence_length (128): the first window after BOS, the rest each after the
    # max_sequence_length tokens before it
    long = " ".join(f"{i % 20}+{i % 7}" for i in range(40))
    ids = lm.encode(long)
    assert len(ids) > lm.config.max_sequence_length
    (value,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long,), 0, ("t", 0, 1))])
    n = lm.config.max_sequence_length
    expected = plain_encoder_loglikelihood(lm, bos, ids[:n]) + plain_encoder_loglikelihood(
        lm, ids[len(ids) - n - 1 : n], ids[n:]
    )
    assert value == pytest.approx(expected, rel=1e-5)


def test_diffusion_gemma_refuses_by_name_what_its_sampler_and_likelihood_do_not_take(gemma_lm):
    context = gemma_lm.apply_chat_template([{"role": "user", "content": "sort: 3 1 2"}])
    with pytest.raises(GenerationKwargsError, match="do_sample=True, temperature=0.5: DiffusionGemma's sampler"):
        gemma_lm.generate_until([request(context, until=[], do_sample=True, temperature=0.5)])
    with pytest.raises(ModelArgsError, match="cfg_scale=1.0: LLaDA's guidance"):
        DLLMJaxLM(pretrained="tiny-diffusiongemma", cfg_scale=1.0)
    with pytest.raises(ModelArgsError, match="method='flash_cache' does not run a diffusion_gemma model"):
        DLLMJaxLM(pretrained="tiny-diffusiongemma", method="flash_cache")
    # DiffusionGemma's sampler values are refused for another method when it is named
    with pytest.raises(ModelArgsError, match="t_max=0.5 applies only to method='diffusion_gemma'"):
        parse_model_args(dict(pretrained="p", method="flash_cache", t_max=0.5))


def test_the_registered_model_is_the_entry_point_of_the_package():
    import importlib
    import tomllib

    from lm_eval.api.registry import get_model

    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["lm_eval.models"][
        "dllm_jax"
    ]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is DLLMJaxLM is get_model("dllm_jax")
