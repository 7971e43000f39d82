"""The embedded tiny model through the real loading path, and scripts/eval.py end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_jax import DecodeConfig, Engine, SamplingParams
from dllm_jax.evaluation import tiny_tasks
from tests.conftest import RUN_HEAVY_COMPILER_OPTIONS

pytestmark = pytest.mark.unit  # the tests that decode or start a process say so

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_engine(embedded):
    # its one loop decodes 12 requests for 48 full steps: run-heavy
    return Engine(
        embedded.config,
        embedded.weights,
        embedded.tokenizer,
        backend="xla",
        compiler_options=RUN_HEAVY_COMPILER_OPTIONS,
    )


@pytest.mark.integration  # a whole evaluation: 12 held-out problems, 48 full passes each
def test_shipped_model_solves_held_out_problems_with_exact_decoding(tiny_engine):
    problems = tiny_tasks.held_out_problems(12, seed=tiny_tasks.HELD_OUT_SEED + 1)
    # two blocks of 24 (its answers to these problems are at most 36 tokens long): 48 full
    # passes over rows of 128 instead of 64 over 160 with a canvas of 64
    exact = DecodeConfig(method="llada", gen_length=48, block_length=24, steps=48, batch_size=12)
    out = tiny_engine.generate([p.prompt for p in problems], exact, chat=True)
    solved = sum(tiny_tasks.is_correct(p, r.text) for p, r in zip(problems, out.results))
    assert solved >= 10, [(p.prompt, r.text) for p, r in zip(problems, out.results)]
    assert all(r.steps == 48 for r in out.results)


@pytest.mark.integration
def test_eval_script_reports_every_requested_setting(tmp_path):
    settings = ["exact-one-per-step", "flash-track4-t0.9", "verify-paper-all_commits-t0.9"]
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "eval.py"),
            "--problems",
            "4",
            "--batch-size",
            "4",
            "--backend",
            "xla",
            "--out",
            str(tmp_path),
            "--settings",
            *settings,
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert list(report["results"]) == settings
    for r in report["results"].values():
        assert 0 <= r["accuracy"] <= 1 and r["tokens_per_step"] > 0 and r["forward_passes"] > 0
        assert set(r["accuracy_by_task"]) <= {"arith", "sort"}
        assert len(r["texts"]) == 4
    assert report["results"]["exact-one-per-step"]["agreement_with_exact"] == 1.0
    verify = report["results"]["verify-paper-all_commits-t0.9"]
    assert verify["verify_passes"] == verify["steps"]
    table = (tmp_path / "eval.md").read_text()
    assert "| setting | accuracy |" in table and "verify-paper-all_commits-t0.9" in table


def _eval_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_script", ROOT / "scripts" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_resume_keeps_only_settings_of_the_same_run(tmp_path):
    eval_script = _eval_module()
    run = {
        "model": "m",
        "problems": 4,
        "seed": 1,
        "gen_length": 64,
        "batch_size": 4,
        "backend": "xla",
        "dtype": "float32",
        "device": "cpu",
    }
    exact = eval_script.EXACT
    old = dict(
        run,
        settings={n: {"knob": n} for n in (exact, "a", "b")},
        results={exact: {"accuracy": 0.9}, "a": {"accuracy": 0.5}, "b": {"accuracy": 1.0}},
    )
    path = tmp_path / "eval.json"
    assert eval_script.finished_results(path, dict(run, settings={})) == {}
    path.write_text(json.dumps(old))
    # "b" was run with other options: it is decoded again, "a" is kept.
    now = dict(run, settings={exact: {"knob": exact}, "a": {"knob": "a"}, "b": {"knob": "changed"}})
    assert eval_script.finished_results(path, now) == {exact: {"accuracy": 0.9}, "a": {"accuracy": 0.5}}
    # a changed exact decode invalidates every agreement figure: nothing is kept
    assert (
        eval_script.finished_results(path, dict(now, settings=dict(now["settings"], **{exact: {"knob": "new"}}))) == {}
    )
    with pytest.raises(ValueError, match="problems=4, this run has 8"):
        eval_script.finished_results(path, dict(now, problems=8))
    # a report from before quantization existed ran unquantized
    assert eval_script.finished_results(path, dict(now, quantization="none")) == {
        exact: {"accuracy": 0.9},
        "a": {"accuracy": 0.5},
    }
    with pytest.raises(ValueError, match="quantization='none', this run has 'fp8'"):
        eval_script.finished_results(path, dict(now, quantization="fp8"))
    # and with the model's generation_config defaults (those before it read them were the tiny model's own)
    with pytest.raises(ValueError, match="generation_config='auto', this run has 'none'"):
        eval_script.finished_results(path, dict(now, generation_config="none"))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        eval_script.finished_results(path, now)


def test_a_diffusion_gemma_model_is_evaluated_on_its_own_settings(tmp_path, capsys):
    eval_script = _eval_module()
    full = eval_script.DIFFUSION_GEMMA_FULL
    grid = eval_script.settings(64, 8, "diffusion_gemma")
    assert list(grid) == [full, "diffusion_gemma-canvas_rows16"] and eval_script.reference("diffusion_gemma") == full
    assert {s.decode_config.method for s in grid.values()} == {"diffusion_gemma"}
    # the sampler's values are the model's (its generation_config.json: Engine.generation_defaults)
    assert all(s.sampling == SamplingParams() for s in grid.values())
    # a resumed DiffusionGemma run is kept only with its own reference
    run = dict(model="m", problems=4, seed=1, gen_length=64, batch_size=4, backend="xla", dtype="float32")
    old = dict(run, family="diffusion_gemma", settings={full: {}, "x": {}}, results={full: {"a": 1}, "x": {"a": 2}})
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(old))
    assert eval_script.finished_results(path, dict(old, results={})) == old["results"]
    # another family's setting is refused by name, before anything compiles
    argv = [
        "--model",
        "tiny-diffusiongemma",
        "--settings",
        "flash-track4-t0.9",
        "--problems",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert eval_script.main(argv) == 2
    assert "--settings flash-track4-t0.9: not settings of a diffusion_gemma model" in capsys.readouterr().err
