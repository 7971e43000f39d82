"""dllm-generate (dllm_jax/cli/generate.py) end to end on a tiny LLaDA-format checkpoint written by the test."""

import json
import os
import select
import signal
import subprocess
import sys
import time
import tomllib
from importlib import import_module
from pathlib import Path

import jax
import pytest

import dllm_jax.models.loading
from convert.jax_to_hf import save_hf_checkpoint
from dllm_jax.cli.generate import build_parser, main
from dllm_jax.models.transformer import init_params
from tests.conftest import python_module_from_a_terminal, tiny_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    # the tiny tokenizer: ids 0..5 are <|startoftext|>, <|endoftext|>, <|mdm_mask|>, headers, <|eot_id|>
    cfg = tiny_config(vocab_size=300, bos_token_id=0, eos_token_id=1, pad_token_id=1, mask_token_id=2)
    out = tmp_path_factory.mktemp("cli") / "tiny-llada"
    return save_hf_checkpoint(out, cfg, init_params(cfg, jax.random.key(0)), tokenizer_dir=tiny_tokenizer_dir)


@pytest.fixture
def no_model_load(monkeypatch):
    """Makes loading the weights fail the test: input errors must come before it."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(dllm_jax.models.loading, "load_model", load_model)


def run(args, capsys):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.engine
@pytest.mark.parametrize(
    "method_args",
    [
        ["--method", "flash_cache", "--verify"],
        ["--method", "llada", "--steps", "8"],
        # full tier: decodes over device meshes
        pytest.param(["--mesh", "data=2,tensor=2"], marks=pytest.mark.integration),
    ],
)
def test_generates_and_writes_jsonl(model_dir, tmp_path, capsys, method_args):
    out = tmp_path / "answers.jsonl"
    code, stdout, stderr = run(
        [
            "--model",
            model_dir,
            "--prompt",
            "What is 2 + 2?",
            "--prompt",
            "Name a fox.",
            "--gen-length",
            "16",
            "--block-length",
            "8",
            "--batch-size",
            "2",
            "--output",
            out,
            "--no-progress",
            *method_args,
        ],
        capsys,
    )
    assert code == 0
    assert stdout.startswith("### [0] What is 2 + 2?\n") and "### [1] Name a fox.\n" in stdout
    assert "tokens/s" in stderr and "tokens/step" in stderr  # the summary is a diagnostic
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1]
    assert [r["prompt"] for r in records] == ["What is 2 + 2?", "Name a fox."]
    assert all(r["steps"] >= 1 and isinstance(r["text"], str) for r in records)
    assert not {"prompt_ids", "token_ids"} & records[0].keys()


@pytest.mark.engine
def test_prompts_file_keeps_every_input_field(model_dir, tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    lines = [{"id": "a-1", "prompt": "hello", "meta": {"k": [1, 2]}}, {"prompt": "fox", "id": 7}]
    prompts.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    out = tmp_path / "a.jsonl"
    code, stdout, stderr = run(
        # the options of test_generates_and_writes_jsonl's first case: its compiled loop again
        [
            "--model",
            model_dir,
            "--prompts-file",
            prompts,
            "--gen-length",
            "16",
            "--block-length",
            "8",
            "--batch-size",
            "2",
            "--method",
            "flash_cache",
            "--verify",
            "--no-progress",
            "--output",
            out,
        ],
        capsys,
    )
    assert code == 0 and "2 requests" in stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for given, written in zip(lines, records):
        assert {k: written[k] for k in given} == given
        assert isinstance(written["text"], str) and written["steps"] >= 1
        assert written["finish_reason"] in ("stop", "length") and written["error"] is None
        assert written["prompt_tokens"] > 0 and 0 <= written["completion_tokens"] <= 16


@pytest.mark.engine
def test_sampling_flags_reach_the_requests(model_dir, tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    code, stdout, _ = run(
        [
            "--model",
            model_dir,
            "--prompt",
            "hello",
            "--method",
            "llada",
            "--max-new-tokens",
            "8",
            "--gen-length",
            "32",
            "--block-length",
            "8",
            "--stop",
            "zzz",
            "--stop",
            "q",
            "--temperature",
            "0.7",
            "--top-k",
            "5",
            "--top-p",
            "0.9",
            "--remasking",
            "random",
            "--seed",
            "3",
            "--no-progress",
            "--output",
            out,
        ],
        capsys,
    )
    assert code == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["completion_tokens"] <= 8  # max_new_tokens, inside the bucket of 32
    assert "q" not in record["text"] and "zzz" not in record["text"]


@pytest.mark.engine
def test_default_gen_length_fits_the_model(model_dir, capsys):
    # tiny_config holds 512 positions: a prompt of ~320 tokens leaves room for 128, not the 256 cap
    code, _, stderr = run(["--model", model_dir, "--prompt", "fox " * 100, "--no-progress", "--threshold", "0"], capsys)
    assert code == 0
    assert "gen_length=128" in stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "hi", "--method", "llada", "--gen-length", "16", "--block-length", "8", "--steps", "5"], "steps"),
        (["--prompt", "   "], "--prompt 1: empty prompt"),
        (["--prompt", "ok", "--prompt", "bad \udcff"], "--prompt 2: the tokenizer cannot encode this prompt"),
        (["--prompt", "hi " * 300, "--gen-length", "256"], "max_sequence_length"),
        (["--prompt", "hi " * 1000], "max_sequence_length=512"),
        (["--prompts-file", "/nonexistent/q.jsonl"], "not found"),
        (["--prompt", "hi", "--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--prompt", "hi", "--mesh", "pipe=4"], "unknown axis 'pipe'"),
        (["--prompt", "hi", "--mesh", "data=3"], "3 devices, but 4 are available"),
        (["--prompt", "hi", "--mesh", "data=4", "--batch-size", "6"], "batch_size=6 is not divisible by the data axis"),
        (
            ["--prompt", "hi", "--mesh", "expert=4"],
            "the expert axis (4) splits routed experts, and a llada model has none",
        ),
        (["--prompt", "hi", "--output", ""], "--output: empty path"),
        (["--prompt", "hi", "--gamma", "0.5"], "gamma=0.5 applies only with verify=True"),
        (["--prompt", "hi", "--steps", "4"], "steps=4 does not apply to method='flash_cache'"),
        (
            ["--prompt", "hi", "--method", "llada", "--threshold", "0.5"],
            "threshold=0.5 does not apply to method='llada'",
        ),
        (
            ["--prompt", "hi", "--method", "llada", "--cache", "prefix"],
            "cache='prefix' does not apply to method='llada'",
        ),
        (["--prompt", "hi", "--cfg-scale", "1.5"], "--prompt 1: cfg_scale=1.5 is available with method='llada'"),
        (["--prompt", "hi", "--max-new-tokens", "600"], "--prompt 1:"),
        (["--prompt", "hi", "--output", "/"], "is a folder"),
        (["--prompt", "hi", "--output", "{model}/config.json/out.jsonl"], "is not a folder"),
    ],
)
def test_bad_input_exits_2_with_one_line(model_dir, capsys, no_model_load, args, message):
    args = [a.replace("{model}", str(model_dir)) for a in args]
    if "--model" not in args:
        args = ["--model", model_dir, *args]
    code, _, err = run(args + ["--no-progress"], capsys)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"question": "no prompt key"}', 'expected an object with a "prompt" string'),
        ('{"prompt": 12}', '"prompt" is int, expected a string'),
        ('{"prompt": "lone \\ud800 surrogate"}', "the tokenizer cannot encode this prompt: not valid Unicode"),
        ('{"prompt": "ok", "text": "clashes"}', "'text' would be overwritten by the output"),
        ('{"prompt": "  "}', "empty prompt"),
        ("[1, 2", "not valid JSON"),
    ],
)
def test_bad_prompt_lines_name_file_and_line_before_the_model_loads(
    model_dir, tmp_path, capsys, no_model_load, line, message
):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n' + line + "\n")
    out = tmp_path / "out.jsonl"
    code, _, err = run(["--model", model_dir, "--prompts-file", bad, "--output", out, "--no-progress"], capsys)
    assert code == 2 and f"bad.jsonl:2: {message}" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seed", "2147483648"], "argument --seed: 2147483648 is out of range"),
        (["--seed", "x"], "argument --seed: expected an integer, got 'x'"),
        (["--temperature", "nan"], "argument --temperature: expected a finite number"),
        (["--temperature", "-1"], "argument --temperature: -1 is out of range"),
        (["--gamma", "0"], "argument --gamma: 0 is out of range: expected a number in (0, 1]"),
        (["--batch-size", "0"], "argument --batch-size: 0 is out of range"),
        (["--method", "greedy"], "argument --method: invalid choice"),
    ],
)
def test_option_errors_exit_2_before_anything_loads(model_dir, capsys, no_model_load, args, message):
    """argparse's errors (in process: the parser is what this checks; the console script's own
    exit status is test_console_script_runs_as_installed's and the signal tests')."""
    with pytest.raises(SystemExit) as exited:
        main([str(a) for a in ["--model", model_dir, "--prompt", "x", *args]])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and "Traceback" not in err


def test_chat_without_a_template_is_an_error(tmp_path, capsys, tiny_tokenizer_dir, no_model_load):
    from tests.conftest import save_tiny_tokenizer

    cfg = tiny_config(vocab_size=300, bos_token_id=0, eos_token_id=1, pad_token_id=1, mask_token_id=2)
    folder = save_hf_checkpoint(tmp_path / "m", cfg, init_params(cfg, jax.random.key(0)))
    save_tiny_tokenizer(folder, chat_template=None)
    code, _, err = run(["--model", folder, "--prompt", "hi", "--chat"], capsys)
    assert code == 2 and "--chat: the tokenizer of" in err and "has no chat template" in err


def test_help_names_every_default_once_and_every_flag_has_help():
    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings:
            continue
        entry = text.split(action.option_strings[-1], 1)[1].split("\n  -", 1)[0]
        assert entry.count("default") <= 1, entry
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: 8)" in text  # --batch-size: the value, printed by the formatter


def _wait_for(proc, text: str, seconds: float) -> str:
    """Reads proc's stderr until `text` appears (or the process ends, or time runs out)."""
    seen, deadline = "", time.monotonic() + seconds
    while text not in seen and time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            seen += os.read(proc.stderr.fileno(), 65536).decode()
    return seen


@pytest.mark.integration
@pytest.mark.parametrize(
    "signum,status,message", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_signal_mid_run_leaves_the_output_as_it_was(model_dir, tmp_path, signum, status, message):
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"fox {i}"}) + "\n" for i in range(256)))
    out = tmp_path / "answers.jsonl"
    out.write_text("the previous run\n")
    proc = subprocess.Popen(
        [
            *python_module_from_a_terminal("dllm_jax.cli.generate"),
            "--model",
            str(model_dir),
            "--prompts-file",
            str(prompts),
            "--output",
            str(out),
            "--method",
            "llada",
            "--gen-length",
            "32",
            "--batch-size",
            "1",
            "--no-progress",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        seen = _wait_for(proc, "generating", 120)
        assert "generating" in seen, seen
        proc.send_signal(signum)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = seen + rest.decode()
    assert proc.returncode == status, err
    assert err.rstrip().splitlines()[-1].startswith(message) and "Traceback" not in err
    assert out.read_text() == "the previous run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl", "many.jsonl"]


def test_console_scripts_resolve_to_callables():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) >= {"dllm-generate", "dllm-convert"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(import_module(module), attr)), name


def test_the_package_data_ships_the_embedded_model():
    # what a non-editable install copies besides the modules: every file of the embedded model
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["dllm_jax"]
    package = ROOT / "dllm_jax"
    shipped = {p for pattern in patterns for p in package.glob(pattern) if p.is_file()}
    needed = {p for p in (package / "assets" / "tiny-llada").iterdir() if p.is_file()}
    assert {p.name for p in needed} >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert needed <= shipped


@pytest.mark.integration
def test_console_script_runs_as_installed(model_dir):
    # what pip's wrapper does: import the target and sys.exit(main()) with the program's own argv
    script = "import sys; from dllm_jax.cli.generate import main; sys.argv[0] = 'dllm-generate'; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: dllm-generate")
    wrapper = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert wrapper.returncode == 0 and "--prompts-file" in wrapper.stdout


@pytest.mark.integration  # full tier: the batch-invariant mode's decodes
def test_batch_invariant_flag_reaches_the_engine(model_dir, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the test
    code, _, stderr = run(
        [
            "--model",
            model_dir,
            "--prompt",
            "What is 2 + 2?",
            "--gen-length",
            "16",
            "--block-length",
            "8",
            "--batch-size",
            "2",
            "--no-progress",
            "--batch-invariant",
        ],
        capsys,
    )
    assert code == 0 and "+invariant" in stderr
    assert "--xla_gpu_deterministic_ops=true" in os.environ["XLA_FLAGS"]
