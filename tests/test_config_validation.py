"""config.json validation: every key's type and range, one line naming the file and the key.

The table puts each bad value into an otherwise valid tiny config and expects a ConfigError
(from the library) or exit status 2 with one stderr line (from the converter and from
scripts/generate.py), never a traceback and nothing written.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config

import convert.conversion
import convert.hf_to_jax
from dllm_jax.models.checkpoint.converted import METADATA_FILE
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.config import ConfigError, ModelConfig
from dllm_jax.models.loading import load_model

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
SIZE = "expected a positive integer below 2**31"
REAL = "expected a finite positive number"
TOKEN = "expected an integer token id in [0, 128)"
FLAG = "expected true or false"
NOT_SIZES = ["128", "abc", 64.0, 1.5, True, False, 0, -1, None, [], {}, 2**31, 10**30]
NOT_REALS = ["abc", "1e4", math.nan, math.inf, -math.inf, 0, 0.0, -1.0, True, None, [], {}]
NOT_TOKENS = [128, -1, 1.0, "5", True, False, 2**40, math.nan, [], {"id": 1}]

# (key, bad value, words the message must hold besides the file and the key)
CASES = (
    [(key, value, SIZE) for key in ("d_model", "n_layers", "n_heads") for value in NOT_SIZES]
    # null means the default for these three; every other non-size is an error
    + [
        (key, value, SIZE)
        for key in ("n_kv_heads", "mlp_hidden_size", "embedding_size")
        for value in NOT_SIZES
        if value is not None
    ]
    + [("max_sequence_length", value, SIZE) for value in NOT_SIZES]
    + [("vocab_size", value, SIZE) for value in ["128", 1.5, True, 0, -3, None]]
    + [(key, value, REAL) for key in ("rope_theta", "rms_norm_eps") for value in NOT_REALS]
    + [(key, value, TOKEN) for key in ("mask_token_id", "eos_token_id") for value in NOT_TOKENS + [None]]
    + [(key, value, TOKEN) for key in ("pad_token_id", "bos_token_id") for value in NOT_TOKENS]
    + [("weight_tying", value, FLAG) for value in ["false", 0, 1, None, []]]
    + [("multi_query_attention", value, FLAG) for value in ["yes", 0, 1.0]]
    + [("multi_query_attention", True, "unsupported option")]
    + [("alibi", value, "unsupported option") for value in [0, "false", None, True]]
    + [("block_group_size", value, "unsupported option") for value in [True, 1.0, 2, "1"]]
    + [("clip_qkv", value, "unsupported option") for value in [0, 8.0, False]]
    + [("model_type", value, "not supported") for value in ["bert", 5, None, ["llada"]]]
)


def hf_config(**changes):
    """The tiny config as a config.json dict, with keys changed (a value of DELETE removes it)."""
    hf = tiny_config().to_hf_config()
    for key, value in changes.items():
        if value is DELETE:
            hf.pop(key, None)
        else:
            hf[key] = value
    return hf


DELETE = object()
# (changes, key named, words)
STRUCTURE_CASES = [
    (dict(d_model=DELETE), "d_model", "missing required key"),
    (dict(n_layers=DELETE), "n_layers", "missing required key"),
    (dict(n_heads=DELETE), "n_heads", "missing required key"),
    (dict(mask_token_id=DELETE), "mask_token_id", "missing required key"),
    (dict(eos_token_id=DELETE), "eos_token_id", "missing required key"),
    (dict(embedding_size=DELETE, vocab_size=DELETE), "vocab_size", "missing required key"),
    (dict(mlp_hidden_size=DELETE, mlp_ratio=DELETE), "mlp_ratio", "missing required key"),
    (dict(mlp_hidden_size=None, mlp_ratio=1.5), "mlp_ratio", SIZE),
    (dict(mlp_hidden_size=None, mlp_ratio=2**30), "mlp_ratio", "below 2**31"),
    (dict(vocab_size=129), "vocab_size", "exceeds embedding_size=128"),
    (dict(embedding_size=None, vocab_size="128"), "vocab_size", SIZE),
    (dict(n_heads=3), "n_heads", "not divisible"),
    (dict(n_kv_heads=3), "n_kv_heads", "not a multiple"),
    (dict(d_model=12, n_heads=4, n_kv_heads=4), "head_dim", "even"),
    (dict(embedding_size=100, vocab_size=100), "mask_token_id", "[0, 100)"),
]


def assert_one_line_naming(message, source, key, words):
    assert "\n" not in message.strip()
    assert message.startswith(str(source)), message
    assert key in message and words in message, message


@pytest.mark.parametrize("key,value,words", CASES, ids=lambda v: repr(v)[:20])
def test_every_bad_value_is_named(key, value, words):
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_hf_config(hf_config(**{key: value}), source="/m/config.json")
    assert_one_line_naming(str(error.value), "/m/config.json", key, words)


@pytest.mark.parametrize("changes,key,words", STRUCTURE_CASES)
def test_missing_keys_and_inconsistent_sizes_are_named(changes, key, words):
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_hf_config(hf_config(**changes), source="/m/config.json")
    assert_one_line_naming(str(error.value), "/m/config.json", key, words)


@pytest.mark.parametrize(
    "changes,field,expected",
    [
        (dict(n_kv_heads=None), "n_kv_heads", 4),
        (dict(pad_token_id=None), "pad_token_id", 127),
        (dict(bos_token_id=None), "bos_token_id", None),
        (dict(mlp_hidden_size=None, mlp_ratio=2), "mlp_hidden_size", 128),
        (dict(embedding_size=None), "vocab_size", 128),
        (dict(vocab_size=DELETE), "vocab_size", 128),
        (dict(rope_theta=500000), "rope_theta", 500000.0),
        (dict(rope_theta=DELETE), "rope_theta", 10000.0),
        (dict(multi_query_attention=None), "n_heads", 4),
        (dict(multi_query_attention=False), "n_heads", 4),
        (dict(model_type="LLaDA"), "n_heads", 4),
    ],
)
def test_valid_variants_are_accepted(changes, field, expected):
    config = ModelConfig.from_hf_config(hf_config(**changes), dtype="float32")
    assert getattr(config, field) == expected
    assert isinstance(config.rope_theta, float)


def test_the_round_trip_is_unchanged():
    assert ModelConfig.from_hf_config(hf_config(), dtype="float32") == tiny_config()


@pytest.mark.parametrize(
    "field,value",
    [
        ("d_model", True),
        ("vocab_size", 128.0),
        ("max_sequence_length", "512"),
        ("rope_theta", math.nan),
        ("rms_norm_eps", "1e-5"),
        ("eos_token_id", None),
        ("bos_token_id", 1.0),
        ("weight_tying", "no"),
        ("n_layers", 2**31),
    ],
)
def test_direct_construction_checks_the_same(field, value):
    with pytest.raises(ConfigError, match=field):
        tiny_config(**{field: value})


@pytest.mark.parametrize(
    "content,words",
    [
        (b"{", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (b"null", "expected a JSON object, got NoneType"),
        (json.dumps(hf_config()).replace('"rope_theta": 10000.0', '"rope_theta": NaN').encode(), "rope_theta"),
    ],
)
def test_unreadable_files_are_named(tmp_path, content, words):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_json_file(path)
    assert_one_line_naming(str(error.value), path, "", words)


def test_an_unreadable_config_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.mkdir()
    with pytest.raises(ConfigError, match="config file not found"):
        ModelConfig.from_json_file(path)


def write_hf_folder(folder, hf):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


CLI_CASES = [
    ("eos_token_id", None),
    ("vocab_size", "128"),
    ("max_sequence_length", "abc"),
    ("rope_theta", "abc"),
    ("n_layers", True),
    ("d_model", 64.0),
    ("rms_norm_eps", -1),
    ("mask_token_id", 128),
]


def bad_hf_folder(tmp_path, key, value):
    changes = {key: value, "embedding_size": None} if key == "vocab_size" else {key: value}
    return write_hf_folder(tmp_path / "hf", hf_config(**changes))


@pytest.mark.parametrize("key,value", CLI_CASES)
def test_the_conversion_process_exits_2_with_one_line(tmp_path, capsys, key, value):
    """The converter's child process (convert.conversion.worker_main, run here): its last
    stdout line is the message the command line prints (test below), and it writes nothing."""
    hf = bad_hf_folder(tmp_path, key, value)
    into = tmp_path / "into"
    into.mkdir()
    argv = ["--hf-dir", str(hf), "--into", str(into), "--label", str(tmp_path / "out"), "--dtype", "bfloat16"]
    assert convert.conversion.worker_main(argv) == 2
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out
    assert out.startswith(f"{hf / 'config.json'}: {key}=")
    assert list(into.iterdir()) == []


def test_the_converter_exits_2_with_one_line(tmp_path, capsys):
    """The command line around that child process (started once: 1.6 s): exit status 2, the
    child's line after "error: ", nothing written."""
    key, _ = CLI_CASES[0]
    hf = bad_hf_folder(tmp_path, *CLI_CASES[0])
    before = sorted(p.name for p in tmp_path.iterdir())
    code = convert.hf_to_jax.main(["--hf-dir", str(hf), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"error: {hf / 'config.json'}: {key}=")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_converted_folder_with_a_bad_config_is_named(tmp_path):
    folder = tmp_path / "converted"
    folder.mkdir()
    metadata = {"format_version": 1, "hf_config": hf_config(rope_theta="abc"), "dtype": "float32"}
    (folder / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(ConversionError) as error:
        load_model(folder, dtype="float32")
    assert_one_line_naming(str(error.value), folder / METADATA_FILE, "rope_theta", REAL)


def load_generate_script():
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("key,value", CLI_CASES[:4])
def test_generate_exits_2_with_one_line(tmp_path, capsys, key, value):
    changes = {key: value, "embedding_size": None} if key == "vocab_size" else {key: value}
    hf = write_hf_folder(tmp_path / "hf", hf_config(**changes))
    code = load_generate_script().main(["--model", str(hf), "--prompt", "2+3", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{hf / 'config.json'}: {key}=" in err


@pytest.mark.integration
def test_generate_as_a_process_prints_no_traceback(tmp_path):
    hf = write_hf_folder(tmp_path / "hf", hf_config(eos_token_id=None))
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", str(hf), "--prompt", "x", "--no-progress"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"error: {hf / 'config.json'}: eos_token_id=null: {TOKEN}"
