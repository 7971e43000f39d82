"""The loaders and dllm-convert against hostile model folders: an index nested without end, a
garbage or missing tokenizer.json, special ids outside the vocabulary, a memory limit set by
$DLLM_MEMORY_AVAILABLE, an impossible JAX_PLATFORMS. Every refusal is one line, before anything is
written; a conversion that succeeds says what it wrote."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dllm_jax.models.checkpoint.hf_reader
from convert.conversion import convert_checkpoint
from convert.hf_to_jax import main as convert_main
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.models.loading import load_model
from dllm_jax.text.tokenizer import TokenizerError


@pytest.fixture
def model(tmp_path) -> Path:
    """A private copy of the embedded tiny-llada (a Hugging Face folder) a test may damage."""
    return shutil.copytree(tiny_model_path(), tmp_path / "model")


@pytest.fixture
def no_shard_read(monkeypatch):
    opened = []
    monkeypatch.setattr(dllm_jax.models.checkpoint.hf_reader, "safe_open", lambda *a, **k: opened.append(a))
    yield
    assert opened == [], "a shard was read before the input was checked"


def run_convert(args, capsys):
    code = convert_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ----- model.safetensors.index.json (35.6) ---------------------------------------------------------


@pytest.mark.parametrize("depth", [100_000, 2_000_000])
def test_a_deeply_nested_index_is_one_error(model, no_shard_read, depth):
    (model / "model.safetensors.index.json").write_text("[" * depth + "]" * depth)
    with pytest.raises(ConversionError, match=r"model.safetensors.index.json: not valid JSON \(nested too deeply\)$"):
        load_model(model)


def test_an_index_larger_than_any_real_one_is_refused_unread(model, no_shard_read):
    index = model / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.truncate(65 * 2**20)
    with pytest.raises(ConversionError, match=r"index.json: larger than 64 MiB, too large for this file$"):
        load_model(model)


# ----- the tokenizer a converted folder would hold (35.9, 35.10) ----------------------------------


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda m: (m / "tokenizer.json").write_text("{ not a tokenizer"),
            "tokenizer.json: cannot load the tokenizer (",
        ),
        (lambda m: (m / "tokenizer.json").write_bytes(b"\xff\xfe garbage"), "tokenizer.json: not UTF-8 text"),
        (lambda m: (m / "tokenizer.json").unlink(), "no tokenizer.json, which dllm_jax needs to encode text"),
        (
            lambda m: (m / "tokenizer_config.json").write_text('{"chat_template": "{% if %}"}'),
            "tokenizer_config.json: the chat template is not valid Jinja",
        ),
        (
            lambda m: (m / "tokenizer_config.json").write_text('{"eos_token": 7}'),
            "tokenizer_config.json: eos_token: expected a token string",
        ),
    ],
    ids=["garbage", "not utf-8", "missing", "template", "special token"],
)
def test_dllm_convert_refuses_a_tokenizer_that_would_not_load(model, tmp_path, capsys, damage, message):
    damage(model)
    out = tmp_path / "out"
    code, stdout, err = run_convert(["--hf-dir", model, "--out", out], capsys)
    assert code == 2 and stdout == ""
    assert message in one_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_special_ids_outside_the_model_vocabulary_are_refused(model, tmp_path, no_shard_read):
    config = json.loads((model / "config.json").read_text())
    config.update(vocab_size=90, embedding_size=90, mask_token_id=1, eos_token_id=2, pad_token_id=2, bos_token_id=3)
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConversionError, match=r"the tokenizer's end token has id 96, outside the model's vocab_size=90"
    ):
        convert_checkpoint(model, tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out").exists()


def test_tokenizer_errors_are_one_line(model):
    from dllm_jax.text.tokenizer import Tokenizer

    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": [1, 2]}}')
    with pytest.raises(TokenizerError) as error:
        Tokenizer.from_dir(model)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"{model}/tokenizer.json: cannot load")


# ----- memory and platforms (35.3, 35.4) -----------------------------------------------------------


def test_dllm_convert_checks_memory_against_memory_available(model, tmp_path, monkeypatch, no_shard_read):
    monkeypatch.setenv("DLLM_MEMORY_AVAILABLE", "1MiB")
    with pytest.raises(
        ConversionError,
        match=rf"^{re.escape(str(model))}: converting to float32 needs about 0.0\d GB of memory, "
        r"\$DLLM_MEMORY_AVAILABLE has 0.00 GB available$",
    ):
        convert_checkpoint(model, tmp_path / "out", dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_dllm_convert_names_an_impossible_jax_platforms(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "convert.hf_to_jax", "--hf-dir", str(tiny_model_path()), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "tpu"},
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert one_error(result.stderr).startswith("error: JAX_PLATFORMS='tpu': Unable to initialize backend 'tpu'")
    assert list(tmp_path.iterdir()) == []


# ----- what dllm-convert says (34.11) --------------------------------------------------------------


def test_dllm_convert_is_named_so_in_its_help(capsys):
    with pytest.raises(SystemExit):
        convert_main(["--help"])
    assert capsys.readouterr().out.startswith("usage: dllm-convert ")


def test_dllm_convert_says_what_it_wrote(tmp_path, capsys):
    out = tmp_path / "converted"
    code, stdout, err = run_convert(["--hf-dir", tiny_model_path(), "--out", out, "--dtype", "float32"], capsys)
    assert code == 0, err
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert re.fullmatch(
        rf"wrote {re.escape(str(out))}: 57 tensors, float32, {size / 1e6:.1f} MB, with the tokenizer in \d+\.\d s\n",
        stdout,
    ), stdout


# ----- the chat template's bounds, directly (35.8) -------------------------------------------------


def test_a_template_is_rendered_as_transformers_renders_it():
    from dllm_jax.text.chat_template import ChatTemplate

    template = ChatTemplate(
        "{% for m in messages %}{{ bos_token }}{{ m['role'] | upper }}: {{ m['content'] | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}{% generation %}A:{% endgeneration %}{% endif %}",
        source="test",
        special_tokens={"bos_token": "<s>"},
    )
    assert template.render([{"role": "user", "content": "<b>hi</b>"}]) == '<s>USER: "<b>hi</b>"\nA:'


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "{{ raise_exception('only user turns') }}",
            "test: the chat template rejects these messages (only user turns)",
        ),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "test: the chat template recursed too deeply"),
        (
            "{{ messages.__class__.__mro__ }}",
            "test: the chat template does what the sandbox forbids (access to attribute '__class__'",
        ),
        ("{{ 2 ** 100000000 }}", "test: the chat template was stopped: 2 ** 100000000 is too large"),
    ],
)
def test_a_template_that_misbehaves_is_one_error_naming_it(text, message):
    from dllm_jax.text.chat_template import ChatTemplate

    with pytest.raises(TokenizerError) as error:
        ChatTemplate(text, source="test").render([{"role": "user", "content": "hi"}])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_trace_function_of_the_caller_is_restored():
    from dllm_jax.text.chat_template import ChatTemplate

    def tracer(frame, event, arg):
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        ChatTemplate("{{ messages[0]['content'] }}", source="test").render([{"role": "user", "content": "x"}])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)
