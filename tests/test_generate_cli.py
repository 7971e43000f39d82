"""scripts/generate.py end to end on a tiny LLaDA-format checkpoint written by the test."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from convert.jax_to_hf import save_hf_checkpoint
from dllm_jax.models import init_params
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
generate_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate_script)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    # the tiny tokenizer: ids 0..5 are <|startoftext|>, <|endoftext|>, <|mdm_mask|>, headers, <|eot_id|>
    cfg = tiny_config(vocab_size=300, bos_token_id=0, eos_token_id=1, pad_token_id=1, mask_token_id=2)
    out = tmp_path_factory.mktemp("cli") / "tiny-llada"
    return save_hf_checkpoint(out, cfg, init_params(cfg, jax.random.key(0)), tokenizer_dir=tiny_tokenizer_dir)


def run(args, capsys):
    code = generate_script.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "method_args",
    [["--method", "flash_cache", "--verify"], ["--method", "llada", "--steps", "8"], ["--mesh", "data=2,tensor=2"]],
)
def test_generates_and_writes_jsonl(model_dir, tmp_path, capsys, method_args):
    out = tmp_path / "answers.jsonl"
    code, stdout, _ = run(
        ["--model", model_dir, "--prompt", "What is 2 + 2?", "--prompt", "Name a fox.", "--gen-length", "16",
         "--block-length", "8", "--batch-size", "2", "--output", out, "--no-progress", *method_args],
        capsys,
    )
    assert code == 0
    assert "tokens/s" in stdout and "tokens/step" in stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1]
    assert all(r["steps"] >= 1 and isinstance(r["text"], str) for r in records)


def test_prompts_file(model_dir, tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n\n" + json.dumps({"prompt": "fox"}) + "\n")
    code, stdout, _ = run(["--model", model_dir, "--prompts-file", prompts, "--gen-length", "16", "--no-progress"], capsys)
    assert code == 0 and "2 requests" in stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "hi", "--gen-length", "0"], "gen_length"),
        (["--prompt", "hi", "--method", "llada", "--gen-length", "16", "--block-length", "8", "--steps", "5"], "steps"),
        (["--prompt", "   "], "empty"),
        (["--prompt", "hi " * 300], "max_sequence_length"),
        (["--prompts-file", "/nonexistent/q.jsonl"], "not found"),
        (["--prompt", "hi", "--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--prompt", "hi", "--mesh", "pipe=4"], "unknown axis 'pipe'"),
        (["--prompt", "hi", "--mesh", "data=3"], "3 devices, but 4 are available"),
        (["--prompt", "hi", "--mesh", "data=4", "--batch-size", "6"], "batch_size=6 is not divisible by the data axis"),
    ],
)
def test_bad_input_exits_2_with_a_message(model_dir, capsys, args, message):
    if "--model" not in args:
        args = ["--model", model_dir, *args]
    code, _, err = run(args + ["--no-progress"], capsys)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_bad_prompts_file_lines(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt key"}\n')
    code, _, err = run(["--model", model_dir, "--prompts-file", bad, "--no-progress"], capsys)
    assert code == 2 and "bad.jsonl:2" in err


def test_argparse_errors_exit_2(model_dir):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", str(model_dir), "--prompt", "x", "--method", "greedy"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2 and "--method" in result.stderr
