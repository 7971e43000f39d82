"""dllm-serve's start-up (issue 33 items 3 and 9, issue 34 item 8): an empty API key is a usage
error, a busy port fails before the model loads, Ctrl-C while loading or compiling is one line
and status 130, the log has no backend-probing or tokenizer noise, and --mesh reaches the
engine. Only the Ctrl-C test loads the model (and is interrupted while it compiles)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.serve import cli
from tests.conftest import python_module_from_a_terminal


def serve(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """dllm-serve with exactly this environment (and JAX on the CPU)."""
    environment = {**env, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "dllm_jax.serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "args, env, words",
    [
        (["--api-key", ""], {}, "--api-key: the API key is empty"),
        (["--api-key", "   "], {}, "--api-key: the API key is empty"),
        ([], {"DLLM_API_KEY": ""}, "$DLLM_API_KEY: the API key is empty"),
        (["--api-key-file", "{empty}"], {}, "the API key is empty"),
        (["--api-key-file", "/nonexistent/key"], {}, "cannot read it"),
        (["--api-key", "a", "--api-key-file", "{empty}"], {}, "give one of them"),
        (["--mesh", "data=3"], {}, "--mesh: mesh spec 'data=3'"),
        (["--max-logprobs", "65"], {}, "--max-logprobs=65: expected -1 (none) to 64"),
        (["--header-timeout", "0"], {}, "--header-timeout=0.0: expected > 0"),
    ],
)
def test_bad_options_exit_2_with_one_line_before_loading(tmp_path, monkeypatch, capsys, args, env, words):
    """dllm-serve's main in this process (the real process: the test below): loading the model
    fails the test, so each refusal comes before it."""
    from dllm_jax.engine.engine import Engine

    def from_pretrained(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    empty = tmp_path / "key"
    empty.write_text("\n")
    args = [a.replace("{empty}", str(empty)) for a in args]
    monkeypatch.delenv("DLLM_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = cli.main(["--port", "0", *args])
    err = capsys.readouterr().err
    assert code == 2 and words in one_line(err), err[-2000:]
    assert one_line(err).startswith("dllm-serve: ") and "compiling" not in err


def test_a_bad_option_in_the_real_process_exits_2_with_one_line_before_loading():
    """The process a user starts: exit status 2, one line on stderr, nothing loaded or compiled."""
    environment = {k: v for k, v in os.environ.items() if k != "DLLM_API_KEY"}
    started = time.monotonic()
    result = serve(["--api-key", ""], environment)
    assert result.returncode == 2, result.stderr[-2000:]
    assert one_line(result.stderr) == (
        "dllm-serve: --api-key: the API key is empty (leave it unset to serve without a key)"
    )
    assert time.monotonic() - started < 45  # no model loaded, nothing compiled
    assert "compiling" not in result.stderr


def test_the_key_file_and_the_variable_give_the_key(tmp_path, monkeypatch):
    keyfile = tmp_path / "key"
    keyfile.write_text("from-file\nignored\n")
    monkeypatch.setenv("DLLM_API_KEY", "from-env")
    assert cli.api_key(cli.parse_args(["--api-key-file", str(keyfile)])) == "from-file"
    assert cli.api_key(cli.parse_args([])) == "from-env"
    monkeypatch.delenv("DLLM_API_KEY")
    assert cli.api_key(cli.parse_args([])) is None


def test_a_busy_port_fails_at_once():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "dllm_jax.serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
    assert result.returncode == 2
    assert f"--port {port}: cannot listen there" in one_line(result.stderr)
    assert time.monotonic() - started < 45 and "compiling" not in result.stderr


def test_ctrl_c_during_the_warm_up_is_one_line_and_status_130(tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*python_module_from_a_terminal("dllm_jax.serve"), "--port", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        try:
            deadline = time.monotonic() + 300
            while "compiling flash_cache" not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(300) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    after = log_path.read_text().split("compiling flash_cache", 1)[1].splitlines()[1:]
    assert [line for line in after if line.strip()] == ["dllm-serve: interrupted during start-up"], after


# An interrupt that lands in a garbage-collection callback (jax registers one: _xla_gc_callback):
# as a KeyboardInterrupt it is swallowed there ("Exception ignored") and the start-up went on.
_INTERRUPT_IN_A_GC_CALLBACK = """
import gc, os, signal, sys
from dllm_jax.serve.cli import interrupt_exits_at_once

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts a process

def callback(phase, info):
    if phase == "start":
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes inside the callback: the signal's handler runs here
            pass

with interrupt_exits_at_once():
    gc.callbacks.append(callback)
    gc.collect()
    gc.callbacks.remove(callback)
    print("the start-up went on")
"""


@pytest.mark.integration
def test_an_interrupt_inside_a_gc_callback_still_ends_the_start_up():
    result = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_IN_A_GC_CALLBACK], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 130, result
    assert result.stderr.strip() == cli.INTERRUPTED_DURING_START_UP and "went on" not in result.stdout


def test_the_log_has_no_backend_probing_noise():
    """Without JAX_PLATFORMS, jax probes for a TPU and logs "Unable to initialize backend
    'tpu'" at INFO; the server's logging keeps third-party records below WARNING out."""
    probe = "import jax; jax.devices(); print('ok')"
    environment = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    plain = subprocess.run(
        [sys.executable, "-c", f"import logging; logging.basicConfig(level='INFO'); {probe}"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    ours = subprocess.run(
        [sys.executable, "-c", f"from dllm_jax.serve.cli import configure_logging; configure_logging('info'); {probe}"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert "Unable to initialize backend" in plain.stderr  # what the old logging let through
    assert ours.stdout.strip() == "ok" and ours.stderr == "", ours.stderr


def test_a_long_prompt_logs_no_tokenizer_warning(capfd):
    from dllm_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from dllm_jax.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_transformers(build_tiny_tokenizer(model_max_length=16))
    assert len(tokenizer.encode("x" * 100)) == 100
    assert len(tokenizer.encode("x" * 100, chat=True)) > 100
    assert "sequence length" not in capfd.readouterr().err


def test_mesh_reaches_the_engine(monkeypatch, capsys):
    from dllm_jax.engine.engine import Engine

    seen = {}

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped before loading")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    assert cli.main(["--port", "0", "--mesh", "data=2,tensor=2", "--log-level", "warning"]) == 2
    assert "stopped before loading" in capsys.readouterr().err
    assert dict(seen["mesh"].shape) == {"data": 2, "tensor": 2, "expert": 1}


@pytest.mark.parametrize(
    "setting, logged", [("auto", "max_new_tokens=64, max_denoising_steps=16"), ("none", "no model")]
)
def test_generation_config_reaches_the_engine_and_its_defaults_are_logged(monkeypatch, caplog, setting, logged):
    from types import SimpleNamespace

    from dllm_jax.engine.engine import Engine
    from dllm_jax.sampling.generation_defaults import GenerationDefaults

    seen = {}

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        # no tokenizer: the start-up stops right after it logged the defaults it took
        defaults = GenerationDefaults.of_folder(path, kwargs["generation_config"])
        return SimpleNamespace(generation_defaults=defaults, tokenizer=None)

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    argv = ["--port", "0", "--model", "tiny-diffusiongemma", "--generation-config", setting]
    with caplog.at_level(logging.INFO, logger="dllm_jax.serve"):
        assert cli.main(argv) == 2
    assert seen["generation_config"] == setting
    assert f"defaults of the values a request leaves unset: {logged}" in caplog.text.replace(
        f"{tiny_model_path('tiny-diffusiongemma')}/generation_config.json: ", ""
    )
