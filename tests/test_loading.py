"""dllm_jax.models.loading: the dtype default, Hub ids resolved through a Hugging Face cache laid out by
the test (models--ORG--NAME/refs/main + snapshots/HASH/, as huggingface_hub writes it), local
folders winning over Hub ids, and the embedded model's converted copy run with default options."""

import json
import os
import subprocess
import sys

import huggingface_hub.constants
import pytest

from convert.hf_to_jax import main as convert_main
from dllm_jax import ConversionError, ModelNotFoundError, default_dtype, load_model
from dllm_jax.cli.generate import main as generate_main
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.models.loading import read_model_config, resolve_model_path

pytestmark = pytest.mark.unit

REPO_ID = "tiny-org/tiny-llada-jax"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache holding REPO_ID: the embedded model, converted (float32)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.parent.mkdir(parents=True)
    # the converter's command line, as a user would fill a cache by hand (in this process)
    status = convert_main(["--hf-dir", str(tiny_model_path()), "--out", str(snapshot), "--dtype", "float32"])
    assert status == 0
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    """huggingface_hub reads its cache folder and offline switch from `constants` at call time."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_default_dtype_is_float32_on_the_cpu():
    assert default_dtype() == "float32"
    assert load_model(tiny_model_path()).config.dtype == "float32"
    assert load_model(tiny_model_path(), dtype="bfloat16").config.dtype == "bfloat16"


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(offline_cache):
    snapshot = offline_cache / "models--tiny-org--tiny-llada-jax" / "snapshots" / COMMIT
    assert resolve_model_path(REPO_ID) == snapshot
    loaded = load_model(REPO_ID)
    assert loaded.path == snapshot
    assert loaded.config == read_model_config(tiny_model_path(), dtype="float32")
    assert loaded.tokenizer.encode("sort: 1 2") == load_model(tiny_model_path()).tokenizer.encode("sort: 1 2")


def test_a_local_folder_wins_over_a_hub_id(offline_cache, tmp_path, monkeypatch):
    local = tmp_path / REPO_ID
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"model_type": "llada"}))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(REPO_ID) == local
    with pytest.raises(ConversionError, match=f"{REPO_ID}/config.json"):  # the local folder was read, not the cache
        load_model(REPO_ID)


def test_a_model_missing_from_the_cache_is_one_clear_error(offline_cache):
    with pytest.raises(ModelNotFoundError) as e:
        load_model("tiny-org/not-downloaded")
    message = str(e.value)
    assert message.startswith("tiny-org/not-downloaded: not a local folder and not in the Hugging Face cache")
    assert str(offline_cache) in message and "HF_HUB_OFFLINE" in message and "\n" not in message


@pytest.mark.parametrize("name", ["/no/such/folder", "./missing", "a/b/c"])
def test_a_missing_path_is_not_looked_up_on_the_hub(name, offline_cache):
    with pytest.raises(ModelNotFoundError, match="model folder not found"):
        resolve_model_path(name)


def _cli(args, hub_cache):
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dllm_jax.cli.generate", *args, "--no-progress"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
        env=env,
    )


@pytest.mark.integration
def test_the_cli_runs_a_cached_hub_model_with_default_options(hub_cache):
    # the converted copy of the embedded model: 128 positions, so the default gen_length must fit them
    result = _cli(["--model", REPO_ID, "--prompt", "sort: 3 9 1 4"], hub_cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "### [0] sort: 3 9 1 4\n1 3 4 9\n#### 1349\n\n"
    assert "gen_length=64" in result.stderr


def test_the_cli_names_a_hub_model_missing_from_the_cache(offline_cache, capsys):
    status = generate_main(["--model", "tiny-org/not-downloaded", "--prompt", "hi", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert err.startswith("error: tiny-org/not-downloaded: not a local folder and not in the Hugging Face cache")
