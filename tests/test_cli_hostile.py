"""dllm-generate (and dllm-serve's option checks) against hostile input: device nodes and links as
--output, modes and owners kept, endless or huge prompts files, FIFOs, impossible JAX_PLATFORMS,
configs too large to load, floats beyond float32, templates that do not end. Every refusal is one
line with exit status 2 (1 for a device that refuses the write) and leaves nothing behind.

Device nodes are made with mknod in the test's own folder (never the real /dev): a node with
/dev/null's numbers discards, /dev/full's refuses with ENOSPC, /dev/zero's never ends.
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dllm_jax.cli.prompts
import dllm_jax.models.loading
from dllm_jax.cli.generate import main
from dllm_jax.cli.output import check_output_path
from dllm_jax.cli.prompts import read_jsonl
from dllm_jax.common.atomic_write import write_text_atomically
from dllm_jax.models.embedded import tiny_model_path

NULL, FULL, ZERO = os.makedev(1, 3), os.makedev(1, 7), os.makedev(1, 5)


def device(folder: Path, name: str, numbers: int) -> Path:
    """A character device node in ``folder`` (skips where the test may not make one)."""
    path = folder / name
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, numbers)
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")
    return path


@pytest.fixture
def no_model_load(monkeypatch):
    """Makes loading the weights fail the test: input errors must come before it."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(dllm_jax.models.loading, "load_model", load_model)


def run(args, capsys):
    code = main([str(a) for a in args] + ["--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error(err: str) -> str:
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == lines[-1] and "Traceback" not in err, err
    return errors[0]


# ----- --output: devices, links, modes, owners, folders (35.1, 35.2, 34.6) -----------------------


def test_a_device_node_is_written_through_not_replaced(tmp_path):
    null = device(tmp_path, "null", NULL)
    write_text_atomically(null, "answers\n")
    assert stat.S_ISCHR(null.lstat().st_mode) and null.lstat().st_rdev == NULL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]


def test_a_full_device_is_an_error_and_stays_a_device(tmp_path):
    full = device(tmp_path, "full", FULL)
    with pytest.raises(OSError, match="No space left on device"):
        write_text_atomically(full, "answers\n")
    assert stat.S_ISCHR(full.lstat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_the_process_streams_are_written_through(tmp_path):
    # /dev/stdout is a link to /proc/self/fd/1; here a link of the test's own to a pipe's fd
    read_end, write_end = os.pipe()
    link = tmp_path / "stdout"
    link.symlink_to(f"/proc/self/fd/{write_end}")
    os.set_blocking(read_end, False)  # nothing written is a failure, not a hang
    try:
        write_text_atomically(link, "streamed\n")
        assert os.read(read_end, 100) == b"streamed\n"
    finally:
        os.close(read_end)
        os.close(write_end)
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["stdout"]


def test_a_stream_that_points_at_a_file_is_appended_to_not_truncated(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        f.write("printed first\n")
        f.flush()
        link = tmp_path / "stdout"
        link.symlink_to(f"/proc/self/fd/{f.fileno()}")
        write_text_atomically(link, "then the output\n")
    assert log.read_text() == "printed first\nthen the output\n"


def test_a_link_to_a_file_replaces_the_file_and_keeps_the_link(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "answers.jsonl"
    target.write_text("old\n")
    link = tmp_path / "answers.jsonl"
    link.symlink_to("real/answers.jsonl")
    write_text_atomically(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == "real/answers.jsonl"
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["answers.jsonl"]


def test_a_new_file_takes_the_umask_mode(tmp_path):
    previous = os.umask(0o027)
    try:
        write_text_atomically(tmp_path / "a.jsonl", "x\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.jsonl").stat().st_mode) == 0o640


def test_a_replaced_file_keeps_its_mode_and_owner(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("old\n")
    os.chmod(path, 0o664)
    try:
        os.chown(path, 12345, 23456)
    except PermissionError:
        pytest.skip("giving a file to another user needs root")
    write_text_atomically(path, "new\n")
    info = path.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o664, 12345, 23456)
    assert path.read_text() == "new\n"


def test_output_in_a_missing_folder_is_refused_not_created(tmp_path):
    with pytest.raises(ValueError, match=r"the folder .*/missing/dir does not exist"):
        check_output_path(str(tmp_path / "missing" / "dir" / "a.jsonl"))
    assert list(tmp_path.iterdir()) == []


def test_devices_and_links_are_accepted_as_output(tmp_path):
    null = device(tmp_path, "null", NULL)
    assert check_output_path(str(null)) == null
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(ValueError, match="Too many levels of symbolic links"):
        check_output_path(str(tmp_path / "loop"))


def test_dllm_generate_output_to_a_full_device_is_one_line_and_the_node_stays(tmp_path, capsys):
    full = device(tmp_path, "full", FULL)
    code, out, err = run(["--prompt", "sort: 3 9 1 4", "--output", full], capsys)
    assert code == 1 and "1 3 4 9" in out
    assert one_error(err) == f"error: --output {full}: cannot write it (No space left on device)"
    assert stat.S_ISCHR(full.lstat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_dllm_generate_keeps_the_mode_of_the_file_it_replaces(tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    out.write_text("the previous run\n")
    os.chmod(out, 0o664)
    code, _, err = run(["--prompt", "sort: 3 9 1 4", "--output", out], capsys)
    assert code == 0, err
    assert stat.S_IMODE(out.stat().st_mode) == 0o664 and json.loads(out.read_text())["text"].startswith("1 3 4 9")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl"]


# ----- --prompts-file: endless, huge, FIFOs (35.5, 35.10) ---------------------------------------


def test_an_endless_device_is_refused_after_one_bounded_line(tmp_path, capsys, no_model_load):
    zero = device(tmp_path, "zero", ZERO)
    started = time.monotonic()
    code, _, err = run(["--prompts-file", zero], capsys)
    assert code == 2 and time.monotonic() - started < 30
    assert f"error: {zero}:1: a line longer than 16 MiB" in one_error(err)


def test_a_huge_file_fails_on_its_first_line_within_a_memory_limit(tmp_path):
    huge = tmp_path / "huge.jsonl"
    with open(huge, "wb") as f:  # a sparse 3 GB file: reading it whole needs its 3 GB and more
        f.truncate(3 * 10**9)
    script = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30)); "
        "from dllm_jax.cli.prompts import read_jsonl; read_jsonl(__import__('pathlib').Path(sys.argv[1]))"
    )
    result = subprocess.run([sys.executable, "-c", script, str(huge)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "MemoryError" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"ValueError: {huge}:1: a line longer than 16 MiB; expected one JSON object per line"
    )


def test_the_whole_file_is_bounded_too(tmp_path, monkeypatch):
    monkeypatch.setattr(dllm_jax.cli.prompts, "MAX_FILE_BYTES", 1000)
    many = tmp_path / "many.jsonl"
    many.write_text('{"prompt": "sort: 3 9 1 4"}\n' * 100)
    with pytest.raises(ValueError, match=r"many.jsonl: more than 0 GiB of prompts; split the file"):
        read_jsonl(many)


def test_a_fifo_without_a_writer_says_what_it_waits_for(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dllm_jax.cli.prompts, "FIFO_NOTICE_SECONDS", 0.2)
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)

    def writer():
        time.sleep(1.0)
        with open(fifo, "w") as f:
            f.write('{"id": 1, "prompt": "sort: 3 9 1 4"}\n')

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        records = read_jsonl(fifo)
    finally:
        thread.join()
    assert [r.fields["id"] for r in records] == [1]
    waits = [r.getMessage() for r in caplog.records if "still waiting for" in r.getMessage()]
    assert waits == [
        f"still waiting for {fifo}: it is not a regular file, and nothing has written its prompts and closed it yet (Ctrl-C to stop)"
    ]


def test_a_regular_file_says_nothing_about_waiting(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dllm_jax.cli.prompts, "FIFO_NOTICE_SECONDS", 0.0)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    assert len(read_jsonl(prompts)) == 1 and not caplog.records


def test_a_prompt_too_long_for_the_model_names_its_file_and_line(tmp_path, capsys, no_model_load):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"prompt": "sort: 3 9 1 4"}\n' + json.dumps({"prompt": "sort: " + "9 " * 200}) + "\n")
    code, _, err = run(["--prompts-file", prompts], capsys)
    assert code == 2
    assert one_error(err).startswith(f"error: {prompts}:2: the prompt has ")
    assert "max_sequence_length=128" in err


def test_a_tokenizer_without_tokenizer_json_is_one_line(tmp_path, capsys, no_model_load):
    folder = shutil.copytree(tiny_model_path(), tmp_path / "model")
    (folder / "tokenizer.json").unlink()
    code, _, err = run(["--model", folder, "--prompt", "hi"], capsys)
    assert code == 2
    assert (
        one_error(err)
        == f"error: {folder}: no tokenizer.json, which dllm_jax needs to encode text; the folder has only tokenizer_config.json"
    )


# ----- the model: too large to load, a template that does not end (35.3, 35.8) -----------------


@pytest.mark.parametrize("key,value", [("n_layers", 1_000_000), ("d_model", 2**20)])
def test_a_config_too_large_for_memory_is_refused_before_allocating(tmp_path, capsys, no_model_load, key, value):
    folder = shutil.copytree(tiny_model_path(), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    if key == "d_model":
        config["n_heads"] = config["n_kv_heads"] = 2**10  # keep the head width integral
    (folder / "config.json").write_text(json.dumps(config))
    started = time.monotonic()
    code, _, err = run(["--model", folder, "--prompt", "hi"], capsys)
    assert code == 2 and time.monotonic() - started < 60
    error = one_error(err)
    assert error.startswith(f"error: {folder}: loading the weights in float32 needs about ")
    assert "of host memory" in error and "available: use --dtype bfloat16 or 8-bit weights" in error


def test_memory_available_is_the_memory_the_weights_are_checked_against(capsys, no_model_load, monkeypatch):
    monkeypatch.setenv("DLLM_MEMORY_AVAILABLE", "10MiB")
    code, _, err = run(["--prompt", "hi"], capsys)
    assert code == 2
    assert re.search(
        r"needs about 2\d\.\d MiB of host memory, \$DLLM_MEMORY_AVAILABLE has 10\.0 MiB available", one_error(err)
    )


def _model_with_template(tmp_path: Path, template: str) -> Path:
    folder = shutil.copytree(tiny_model_path(), tmp_path / "model")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "template,reason",
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
            "it ran for more than 0.5 s (a loop that does not end?)",
        ),
        ("{{ 'x' * 10**9 }}", "'*' would build 1000000000 items"),
        ("{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}", "it wrote more than 16777216 characters"),
    ],
    ids=["nested loops", "one huge string", "endless output"],
)
def test_a_chat_template_that_does_not_end_is_stopped_and_named(
    tmp_path, capsys, no_model_load, monkeypatch, template, reason
):
    monkeypatch.setattr("dllm_jax.text.chat_template.RENDER_SECONDS", 0.5)
    folder = _model_with_template(tmp_path, template)
    started = time.monotonic()
    code, _, err = run(["--model", folder, "--prompt", "hi"], capsys)
    assert code == 2 and time.monotonic() - started < 30
    assert one_error(err) == (
        f"error: --prompt 1: the tokenizer cannot encode this prompt: {folder}/tokenizer_config.json: "
        f"the chat template was stopped: {reason}"
    )


def test_a_chat_template_that_is_not_jinja_is_named_when_the_folder_loads(tmp_path, capsys, no_model_load):
    folder = _model_with_template(tmp_path, "{% for m in messages %}{{ m['content'] }")
    code, _, err = run(["--model", folder, "--prompt", "hi"], capsys)
    assert code == 2
    assert one_error(err).startswith(
        f"error: {folder}/tokenizer_config.json: the chat template is not valid Jinja (line 1:"
    )


# ----- numbers beyond float32 (35.7) ---------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--temperature", "--threshold", "--cfg-scale", "--alg-temp"])
def test_floats_beyond_float32_are_refused_by_the_flags(flag, capsys, no_model_load):
    with pytest.raises(SystemExit) as exit_info:
        main(["--prompt", "hi", flag, "1e39"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: 1e+39 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--threshold", "1e39", "--threshold: threshold=1e+39: expected a number in [0.0, 3.4028234663852886e+38]"),
        ("--threshold", "nan", "--threshold: threshold=nan: expected a finite number"),
        ("--gamma", "1e39", "--gamma: gamma=1e+39: expected a number in (0.0, 1.0]"),
    ],
)
def test_dllm_serve_checks_its_request_defaults_in_the_requests_range(flag, value, message):
    from dllm_jax.serve.cli import UsageError, _check, parse_args

    args = parse_args([flag, value, "--method", "flash_cache+verify"])
    with pytest.raises(UsageError) as error:
        _check(args)
    assert str(error.value) == message


def test_lm_eval_cfg_scale_is_checked_in_the_range_of_float32():
    from dllm_jax.evaluation.model_args import ModelArgsError, parse_model_args

    with pytest.raises(ModelArgsError, match=r"model_args: cfg_scale=1e\+39: expected a number in \[0.0, 3.40"):
        parse_model_args({"pretrained": "x", "cfg_scale": 1e39})
    with pytest.raises(ModelArgsError, match="model_args: cfg_scale=nan: expected a finite number"):
        parse_model_args({"pretrained": "x", "cfg_scale": float("nan")})


# ----- JAX_PLATFORMS that cannot start (35.4) -----------------------------------------------------


def _env(**changes: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(changes)
    return env


@pytest.mark.parametrize("platforms", ["tpu", "garbage", "cuda", "cpu,tpu"])
def test_dllm_generate_names_an_impossible_jax_platforms(tmp_path, platforms):
    out = tmp_path / "a.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "dllm_jax.cli.generate", "--prompt", "hi", "--output", str(out)],
        capture_output=True,
        text=True,
        env=_env(JAX_PLATFORMS=platforms),
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: JAX_PLATFORMS={platforms!r}: "), result.stderr
    assert lines[0].endswith("; this machine has cpu (unset JAX_PLATFORMS to use the best of them)")
    assert list(tmp_path.iterdir()) == []


def test_dllm_serve_names_an_impossible_jax_platforms(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dllm_jax.serve", "--port", "0", "--port-file", str(tmp_path / "port")],
        capture_output=True,
        text=True,
        env=_env(JAX_PLATFORMS="garbage"),
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("dllm-serve: JAX_PLATFORMS='garbage': ") and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []
