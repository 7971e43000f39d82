import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from safetensors.numpy import load_file, save_file

import convert.conversion
import dllm_jax.models.checkpoint.hf_reader
from convert.conversion import convert_checkpoint
from convert.hf_to_jax import main
from convert.jax_to_hf import save_hf_checkpoint
from dllm_jax.models.checkpoint.converted import METADATA_FILE, PARAMS_DIR
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.generation_config import GENERATION_CONFIG_FILE as GENERATION_FILE
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.models.loading import load_model, read_model_config
from dllm_jax.models.transformer import init_params
from dllm_jax.sampling.generation_defaults import GenerationDefaults

pytestmark = pytest.mark.unit

INDEX = "model.safetensors.index.json"
# a generation_config.json as transformers writes one (the sampling values of its requests' defaults)
GENERATION_CONFIG = {"eos_token_id": 127, "max_new_tokens": 48, "temperature": 0.2, "transformers_version": "4.46.2"}


@pytest.fixture(scope="module")
def params():
    """The tiny model's params (params, made once for the module)."""
    return init_params(tiny_config(), jax.random.key(0))


@pytest.fixture(scope="module")
def pristine_hf_dir(tmp_path_factory, params, tiny_tokenizer_dir):
    """The tiny model as a Hugging Face LLaDA folder in two safetensors shards, with a tokenizer
    and a generation_config.json."""
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    folder = save_hf_checkpoint(
        tmp_path_factory.mktemp("pristine") / "hf",
        tiny_config(),
        params,
        max_shard_bytes=int(total * 0.6),
        tokenizer_dir=tiny_tokenizer_dir,
        generation_config=GENERATION_CONFIG,
    )
    assert len(shards(folder)) == 2
    return folder


@pytest.fixture
def hf_dir(pristine_hf_dir, tmp_path):
    """A private copy of the two-shard folder that a test may damage."""
    return Path(shutil.copytree(pristine_hf_dir, tmp_path / "hf"))


def shards(folder):
    return sorted(folder.glob("model-*.safetensors"))


def edit_shard(path, change):
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_weight_map(folder, change):
    index = json.loads((folder / INDEX).read_text())
    change(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def cast(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), params)


def assert_conversion_fails(hf, out, match):
    """The conversion raises a ConversionError matching ``match`` and leaves nothing beside ``out``."""
    before = sorted(out.parent.iterdir())
    with pytest.raises(ConversionError, match=match):
        convert_checkpoint(hf, out, dtype="float32")
    assert sorted(out.parent.iterdir()) == before


# ---------------------------------------------------------------------------------------------
# Round trips


def test_two_shard_conversion_round_trips_every_leaf(hf_dir, tmp_path, tiny_cfg, params):
    out = convert_checkpoint(hf_dir, tmp_path / "converted", dtype="float32")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [PARAMS_DIR, METADATA_FILE, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", GENERATION_FILE]
    )
    assert not list(tmp_path.glob(".converted.tmp-*"))
    metadata = json.loads((out / METADATA_FILE).read_text())
    assert metadata["format_version"] == 1
    assert metadata["hf_config"] == json.loads((hf_dir / "config.json").read_text())
    assert metadata["dtype"] == "float32"
    assert metadata["tensor_count"] == 3 + 9 * tiny_cfg.n_layers
    assert metadata["source"] == str(hf_dir.resolve())
    loaded = load_model(out, dtype="float32")
    assert loaded.config == tiny_cfg
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(loaded.weights))
    assert_trees_equal(loaded.weights, params)
    assert loaded.tokenizer.encode("What is 2 + 2?", chat=True)[0] == loaded.tokenizer.encode("<|startoftext|>")[0]
    # the sampling defaults survive the round trip: converted, loaded, and written back as Hugging Face's
    assert loaded.generation_config == GENERATION_CONFIG
    back = save_hf_checkpoint(
        tmp_path / "back", loaded.config, loaded.weights, generation_config=loaded.generation_config
    )
    assert json.loads((back / GENERATION_FILE).read_text()) == GENERATION_CONFIG
    assert dict(GenerationDefaults.of_folder(back).values) == {"max_new_tokens": 48, "temperature": 0.2}


def test_a_bad_generation_config_stops_the_conversion_before_anything_is_written(hf_dir, tmp_path):
    (hf_dir / GENERATION_FILE).write_text(json.dumps({**GENERATION_CONFIG, "top_k": -1}))
    assert_conversion_fails(hf_dir, tmp_path / "out", "generation_config.json: top_k=-1: expected an int in")


def test_bfloat16_conversion_rounds_once(hf_dir, tmp_path, params):
    out = convert_checkpoint(hf_dir, tmp_path / "converted")
    assert json.loads((out / METADATA_FILE).read_text())["dtype"] == "bfloat16"
    assert_trees_equal(load_model(out, dtype="bfloat16").weights, cast(params, jnp.bfloat16))
    # a bf16 checkpoint loaded as float32 holds exactly the bf16 values
    assert_trees_equal(load_model(out, dtype="float32").weights, cast(cast(params, jnp.bfloat16), jnp.float32))


@pytest.mark.parametrize("source_dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_checkpoints_are_cast_to_the_target(tmp_path, tiny_cfg, params, source_dtype):
    half = cast(params, source_dtype)
    hf = save_hf_checkpoint(tmp_path / "hf", tiny_cfg, half)
    assert_trees_equal(load_model(hf, dtype="float32").weights, cast(half, jnp.float32))


def test_hf_folder_and_converted_folder_load_the_same_model(hf_dir, tmp_path):
    files_before = sorted(p.name for p in hf_dir.iterdir())
    from_hf = load_model(hf_dir, dtype="bfloat16")
    assert sorted(p.name for p in hf_dir.iterdir()) == files_before  # converted in memory only
    from_converted = load_model(convert_checkpoint(hf_dir, tmp_path / "converted"), dtype="bfloat16")
    assert from_hf.config == from_converted.config
    assert from_hf.config.dtype == "bfloat16"
    assert_trees_equal(from_hf.weights, from_converted.weights)
    text = "The quick brown fox"
    assert from_hf.tokenizer.encode(text, chat=True) == from_converted.tokenizer.encode(text, chat=True)


def test_a_diffusion_gemma_folder_converts_and_loads_as_its_family(tmp_path):
    hf_dir = tiny_model_path("tiny-diffusiongemma")
    from_hf = load_model(hf_dir, dtype="float32")
    from_converted = load_model(convert_checkpoint(hf_dir, tmp_path / "converted", dtype="float32"), dtype="float32")
    assert from_converted.config.family == "diffusion_gemma" and from_hf.config == from_converted.config
    assert read_model_config(tmp_path / "converted") == from_hf.config
    assert_trees_equal(from_hf.weights, from_converted.weights)
    text = "sort: 3 9 1 4"
    assert from_hf.tokenizer.encode(text, chat=True) == from_converted.tokenizer.encode(text, chat=True)


@pytest.mark.parametrize("mode", ["fp8", "int8-weights"])
def test_a_diffusion_gemma_folder_converts_to_8_bit_weights_and_loads_as_stored(tmp_path, mode):
    """The converter (host, numpy) stores what loading the Hugging Face folder quantizes on the
    host, exactly; an unquantized converted folder quantized as it loads (device, jax) stores the
    same weights up to a last-bit scale at a rounding boundary (see test_quantization)."""
    hf_dir = tiny_model_path("tiny-diffusiongemma")
    out = convert_checkpoint(hf_dir, tmp_path / "q", dtype="float32", quantization=mode)
    assert json.loads((out / METADATA_FILE).read_text())["quantization"] == mode
    stored = load_model(out, dtype="float32")
    assert stored.config.family == "diffusion_gemma" and stored.config.quantization == mode
    assert set(stored.weights["full_layers"]["experts"]["gate_up_proj"]) == {"qkernel", "scale"}
    assert_trees_equal(stored.weights, load_model(hf_dir, dtype="float32", quantization=mode).weights)
    plain = convert_checkpoint(hf_dir, tmp_path / "plain", dtype="float32")
    on_load = load_model(plain, dtype="float32", quantization=mode)
    assert on_load.config == stored.config
    for a, b in zip(jax.tree.leaves(on_load.weights), jax.tree.leaves(stored.weights)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b)
    size = lambda folder: sum(p.stat().st_size for p in (folder / PARAMS_DIR).rglob("*") if p.is_file())  # noqa: E731
    assert size(out) < 0.5 * size(plain)
    with pytest.raises(ConversionError, match=f"stored with quantization='{mode}'.*cannot be loaded as"):
        load_model(out, dtype="float32", quantization="none")


def test_folder_without_tokenizer_files_loads_without_tokenizer(tmp_path, tiny_cfg, params):
    hf = save_hf_checkpoint(tmp_path / "hf", tiny_cfg, params)
    assert load_model(hf, dtype="float32").tokenizer is None


def test_a_folder_that_is_neither_kind_is_a_clear_error(tmp_path):
    with pytest.raises(ConversionError, match="neither a converted dllm_jax checkpoint"):
        load_model(tmp_path)


def test_converted_folder_with_unknown_format_version_is_refused(hf_dir, tmp_path):
    out = convert_checkpoint(hf_dir, tmp_path / "converted")
    metadata = json.loads((out / METADATA_FILE).read_text())
    metadata["format_version"] = 99
    (out / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(ConversionError, match="format_version=99"):
        load_model(out)


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda out: shutil.rmtree(out / PARAMS_DIR), "params checkpoint folder not found"),
        (lambda out: (out / PARAMS_DIR / "manifest.ocdbt").unlink(), "cannot restore the params"),
        (lambda out: (out / METADATA_FILE).write_text("{"), "cannot read the metadata"),
    ],
    ids=["no params", "damaged params", "damaged metadata"],
)
def test_damaged_converted_folder_is_a_conversion_error(hf_dir, tmp_path, damage, match):
    out = convert_checkpoint(hf_dir, tmp_path / "converted")
    damage(out)
    with pytest.raises(ConversionError, match=match):
        load_model(out)


# ---------------------------------------------------------------------------------------------
# Bad input: a ConversionError naming what is wrong, and nothing left on disk


def test_missing_config(hf_dir, tmp_path):
    (hf_dir / "config.json").unlink()
    assert_conversion_fails(hf_dir, tmp_path / "out", "config.json: config file not found")


def test_unsupported_config_option_is_named(hf_dir, tmp_path):
    config = json.loads((hf_dir / "config.json").read_text())
    config["alibi"] = True
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert_conversion_fails(hf_dir, tmp_path / "out", "alibi")


def test_missing_shard_is_found_before_any_shard_is_read(hf_dir, tmp_path, monkeypatch):
    opened = []
    real_safe_open = dllm_jax.models.checkpoint.hf_reader.safe_open
    monkeypatch.setattr(
        dllm_jax.models.checkpoint.hf_reader, "safe_open", lambda *a, **k: opened.append(a) or real_safe_open(*a, **k)
    )
    missing = shards(hf_dir)[1]
    missing.unlink()
    assert_conversion_fails(hf_dir, tmp_path / "out", f"{INDEX}: shard file.* not found: {missing.name}")
    assert opened == []


def test_no_weights_at_all(tmp_path, hf_dir):
    for shard in shards(hf_dir):
        shard.unlink()
    (hf_dir / INDEX).unlink()
    assert_conversion_fails(hf_dir, tmp_path / "out", "no model.safetensors.index.json and no model.safetensors")


def test_tensor_missing_from_the_index(hf_dir, tmp_path):
    name = "model.transformer.blocks.1.up_proj.weight"
    edit_weight_map(hf_dir, lambda weight_map: weight_map.pop(name))
    assert_conversion_fails(hf_dir, tmp_path / "out", f"{INDEX}: missing tensor.*'{name}'")


def test_tensor_missing_from_its_shard(hf_dir, tmp_path):
    name = "model.transformer.ln_f.weight"
    edit_shard(shards(hf_dir)[1], lambda tensors: tensors.pop(name))
    assert_conversion_fails(hf_dir, tmp_path / "out", f"hf: missing tensor.*'{name}'")


def test_tensor_missing_from_a_single_file_checkpoint(tmp_path, tiny_cfg, params):
    hf = save_hf_checkpoint(tmp_path / "hf", tiny_cfg, params)
    edit_shard(hf / "model.safetensors", lambda tensors: tensors.pop("model.transformer.wte.weight"))
    assert_conversion_fails(hf, tmp_path / "out", "missing tensor.*'model.transformer.wte.weight'")


def test_unexpected_tensor_in_the_index(hf_dir, tmp_path):
    edit_weight_map(hf_dir, lambda weight_map: weight_map.update({"model.transformer.blocks.0.q_norm.weight": "x"}))
    assert_conversion_fails(hf_dir, tmp_path / "out", f"{INDEX}: unexpected tensor.*'model.transformer.blocks.0.q_norm")


def test_unexpected_tensor_in_a_shard(hf_dir, tmp_path):
    shard = shards(hf_dir)[0]
    edit_shard(shard, lambda tensors: tensors.update({"model.transformer.blocks.9.q_proj.weight": np.zeros((64, 64))}))
    assert_conversion_fails(
        hf_dir, tmp_path / "out", f"{shard.name}: unexpected tensor 'model.transformer.blocks.9.q_proj.weight'"
    )


def test_tensor_with_the_wrong_shape(hf_dir, tmp_path):
    name = "model.transformer.blocks.1.k_proj.weight"
    shard = next(s for s in shards(hf_dir) if name in load_file(str(s)))
    edit_shard(shard, lambda tensors: tensors.update({name: np.zeros((64, 64), np.float32)}))
    assert_conversion_fails(
        hf_dir, tmp_path / "out", rf"{shard.name}: tensor '{name}' has shape \(64, 64\), expected \(32, 64\)"
    )


@pytest.mark.parametrize("dtype,code", [(np.int32, "I32"), (np.float64, "F64")])
def test_tensor_with_an_unsupported_dtype(hf_dir, tmp_path, dtype, code):
    name = "model.transformer.ln_f.weight"
    shard = shards(hf_dir)[1]
    edit_shard(shard, lambda tensors: tensors.update({name: tensors[name].astype(dtype)}))
    assert_conversion_fails(hf_dir, tmp_path / "out", f"{shard.name}: tensor '{name}' has dtype {code}")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_shard(hf_dir, tmp_path, damage):
    shard = shards(hf_dir)[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07not a safetensors file" * 10)
    assert_conversion_fails(hf_dir, tmp_path / "out", f"{shard.name}: not a readable safetensors file")


@pytest.mark.parametrize(
    "index_text,match",
    [
        ("{not json", "not valid JSON"),
        ('{"metadata": {}}', "non-empty 'weight_map'"),
        ('["model-00001-of-00002.safetensors"]', "non-empty 'weight_map'"),
        ('{"weight_map": {"model.transformer.wte.weight": "../elsewhere.safetensors"}}', "not a file name"),
    ],
)
def test_malformed_index(hf_dir, tmp_path, index_text, match):
    (hf_dir / INDEX).write_text(index_text)
    assert_conversion_fails(hf_dir, tmp_path / "out", f"{INDEX}: .*{match}")


def test_existing_output_folder_is_left_alone(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_conversion_fails(hf_dir, out, "output folder already exists")
    assert (out / "keep.txt").read_text() == "mine"


def test_failure_while_writing_removes_the_temporary_folder(hf_dir, tmp_path, monkeypatch):
    def failing_save(path, params):
        path.mkdir()
        (path / "partial").write_text("half written")
        raise OSError("disk full")

    monkeypatch.setattr(convert.conversion, "save_params", failing_save)
    before = sorted(tmp_path.iterdir())
    # the error names the output folder, not the temporary one it was being written into
    with pytest.raises(ConversionError, match=f"^{tmp_path / 'out'}: cannot write the checkpoint .*disk full"):
        convert_checkpoint(hf_dir, tmp_path / "out")
    assert sorted(tmp_path.iterdir()) == before


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_converts_and_reports_bad_input_without_traceback(hf_dir, tmp_path, capsys):
    assert main(["--hf-dir", str(hf_dir), "--out", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["--hf-dir", str(hf_dir), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'out'}: output folder already exists"


@pytest.mark.integration
def test_cli_module_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "convert.hf_to_jax", "--hf-dir", str(tmp_path / "absent"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'absent'}: checkpoint folder not found"
