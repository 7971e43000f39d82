"""The memory check before a decode loop is compiled, on every surface: the library (Engine),
dllm-generate and dllm-serve's start-up. $DLLM_MEMORY_AVAILABLE forces a small device so that
the refusal runs on the CPU; a batch far beyond any machine is refused without it."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from dllm_jax import DecodeConfig, Engine, InsufficientMemoryError
from dllm_jax.cli.generate import main as generate_main
from dllm_jax.common.errors import GenerationError
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.runtime.memory_estimate import MEMORY_ENV, device_memory, parse_bytes
from dllm_jax.serve.cli import main as serve_main

pytestmark = pytest.mark.unit

ENOUGH_FOR_4_NOT_16 = "20MiB"  # the tiny model's loop needs ~5 MiB a slot beyond the weights (x1.1 margin)
HUGE_BATCH = 2**20  # ~4.5 TiB of cache and activations for the tiny model


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(str(tiny_model_path()), dtype="float32")


def prompts(n: int) -> list[list[int]]:
    return [[3, 4, 5, 6 + i % 50] for i in range(n)]


@pytest.mark.engine
@pytest.mark.parametrize(
    "available,requests,batch_size,message",
    [
        (
            "1MiB",
            1,
            16,
            rf"^batch size 1 with \d+ positions per slot needs about .* \${MEMORY_ENV} has 1\.0 MiB free: "
            r"even one slot does not fit: lower the generation length",
        ),
        (
            ENOUGH_FOR_4_NOT_16,
            16,
            16,
            r"^batch size 16 .* has 20\.0 MiB free: lower the batch size to 4 or less, "
            r"or the generation length or the longest prompt",
        ),
        ("0", 2, 2, r"^batch size 2 .* has 0\.0 MiB free"),
        (
            None,
            1,
            HUGE_BATCH,
            rf"^batch size {HUGE_BATCH} .* (host RAM|cpu:0)[^:]* has .* free: lower the batch size to \d+",
        ),
    ],
)
def test_the_engine_refuses_a_loop_that_does_not_fit_before_compiling_it(
    engine, monkeypatch, available, requests, batch_size, message
):
    if available is None:
        monkeypatch.delenv(MEMORY_ENV, raising=False)
    else:
        monkeypatch.setenv(MEMORY_ENV, available)
    before = engine.num_compilations
    decode = DecodeConfig(gen_length=32, batch_size=batch_size)
    with pytest.raises(InsufficientMemoryError, match=message) as raised:
        if batch_size == HUGE_BATCH:  # a session takes every configured slot
            engine.session(decode, max_prompt_len=8)
        else:
            engine.generate(prompts(requests), decode_config=decode)
    assert isinstance(raised.value, GenerationError) and "\n" not in str(raised.value)
    assert engine.num_compilations == before  # nothing compiled, so nothing of the loop allocated


@pytest.mark.engine
def test_what_fits_runs_and_carries_its_estimate(engine, monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, ENOUGH_FOR_4_NOT_16)
    out = engine.generate(prompts(4), decode_config=DecodeConfig(gen_length=32, batch_size=4))
    assert len(out.results) == 4 and all(r.error is None for r in out.results)
    monkeypatch.delenv(MEMORY_ENV)
    compiled = engine.compile(DecodeConfig(gen_length=32, batch_size=4), 4)
    assert 0 < compiled.memory.total - compiled.memory.weights < parse_bytes(ENOUGH_FOR_4_NOT_16, "x")


@pytest.mark.parametrize(
    "text,expected",
    [("1073741824", 2**30), ("1.5GiB", 3 * 2**29), ("512 MB", 512 * 10**6), ("64kib", 2**16), ("7b", 7)],
)
def test_the_override_takes_bytes_with_units(monkeypatch, text, expected):
    monkeypatch.setenv(MEMORY_ENV, text)
    assert device_memory().available == expected


@pytest.mark.parametrize("text", ["abc", "-1", "1.5 parsecs", ""])
def test_a_bad_override_names_the_variable(monkeypatch, text):
    monkeypatch.setenv(MEMORY_ENV, text)
    with pytest.raises(GenerationError, match=rf"^{MEMORY_ENV}='{re.escape(text)}': expected a number of bytes"):
        device_memory()


def run_cli(main, args: list[str], available: str | None, cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """The command line's main(args) in this process (it exits before compiling anything) with
    $DLLM_MEMORY_AVAILABLE set to `available` (None: unset): (status, stdout, stderr)."""
    if available is None:
        monkeypatch.delenv(MEMORY_ENV, raising=False)
    else:
        monkeypatch.setenv(MEMORY_ENV, available)
    monkeypatch.chdir(cwd)
    # dllm-serve's logging.basicConfig binds a handler to this test's captured stderr, which is
    # closed after it: the root logger starts without handlers and gets its own back afterwards
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    status = main(args)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def error_lines(stderr: str, prefix: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize(
    "available,args,message",
    [
        # the weights are checked first, before they load (~24 MiB to read the tiny model in float32)
        ("1MiB", [], f"loading the weights in float32 needs about 24.3 MiB of host memory, ${MEMORY_ENV} has 1.0 MiB"),
        ("30MiB", ["--batch-size", "16"], "has 30.0 MiB free: lower the batch size to 6 or less"),
        ("lots", [], f"{MEMORY_ENV}='lots': expected a number of bytes"),
    ],
)
def test_dllm_generate_exits_2_with_one_line_and_writes_nothing(
    tmp_path, monkeypatch, capsys, available, args, message
):
    work = tmp_path / "work"
    work.mkdir()
    questions = work / "prompts.jsonl"
    questions.write_text("".join(f'{{"prompt": "sort: {i} 3 1"}}\n' for i in range(16)))
    status, stdout, stderr = run_cli(
        generate_main,
        [
            "--prompts-file",
            str(questions),
            "--output",
            str(work / "out.jsonl"),
            "--gen-length",
            "32",
            "--no-progress",
            *args,
        ],
        available,
        work,
        monkeypatch,
        capsys,
    )
    errors = error_lines(stderr, "error:")
    assert status == 2 and len(errors) == 1 and message in errors[0], stderr
    assert errors[0] == stderr.rstrip().splitlines()[-1]
    assert stdout == "" and sorted(p.name for p in work.iterdir()) == ["prompts.jsonl"]


@pytest.mark.parametrize(
    "available,args,message",
    [
        (ENOUGH_FOR_4_NOT_16, ["--batch-size", "16"], "has 20.0 MiB free: lower the batch size to"),
        (None, ["--batch-size", str(HUGE_BATCH)], f"batch size {HUGE_BATCH} with"),
        ("x", [], f"{MEMORY_ENV}='x': expected a number of bytes"),
    ],
)
def test_dllm_serve_exits_2_before_listening(tmp_path, monkeypatch, capsys, available, args, message):
    port_file = tmp_path / "port"
    status, _, stderr = run_cli(
        serve_main, ["--port", "0", "--port-file", str(port_file), *args], available, tmp_path, monkeypatch, capsys
    )
    errors = error_lines(stderr, "dllm-serve:")
    assert status == 2 and len(errors) == 1 and message in errors[0], stderr
    assert errors[0] == stderr.rstrip().splitlines()[-1]
    assert not port_file.exists() and "Uvicorn running" not in stderr
