"""Dream: config.json parsing, the Hugging Face Dream layout, and parity with transformers' Qwen2.

A Dream block is a Qwen2 block (q/k/v biases, GQA, RMSNorm, rotate-half RoPE, SwiGLU) without
the causal mask, and Dream's prediction of token i is the output row at i - 1. So
transformers' Qwen2ForCausalLM, loaded from the same Dream-layout safetensors (Dream's names
are Qwen2's) and given a 4-D boolean mask that lets every query see every valid key, computes
what dllm_jax must; the shift is applied to both sides as Dream's sampler applies it.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_dream_config
from safetensors.numpy import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers_parity import (
    assert_the_loaded_model_matches,
    hf_decoder_fields,
    padded_inputs,
    random_params,
    relative_error,
    transformers_run,
)

from convert.jax_to_hf import save_hf_checkpoint
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.hf_reader import read_checkpoint
from dllm_jax.models.checkpoint.tensor_names import tensor_entries
from dllm_jax.models.config import ConfigError, ModelConfig, dream_7b_config
from dllm_jax.models.loading import load_model
from dllm_jax.models.transformer import abstract_params, count_params, forward, predictions

pytestmark = pytest.mark.unit

# Dream-v0-Instruct-7B's published config.json (auto_map points at its own modeling code).
DREAM_7B_JSON = {
    "architectures": ["DreamModel"],
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "mask_token_id": 151666,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "Dream",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "pad_token_id": 151643,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}


# ----- config --------------------------------------------------------------------------------


def test_dream_7b_config_maps_to_exactly_its_parameter_count():
    cfg = ModelConfig.from_hf_config(DREAM_7B_JSON)
    assert cfg == dream_7b_config()
    assert (cfg.family, cfg.qkv_bias, cfg.logit_shift) == ("dream", True, 1)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (28, 4, 128)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (151666, 151643, 151643)
    assert count_params(abstract_params(cfg)) == cfg.num_params() == 7_615_616_512


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 5}, "not a multiple of n_kv_heads"),
        ({"mask_token_id": 200000}, r"mask_token_id=200000: expected an integer token id in \[0, 152064\)"),
        ({"num_key_value_heads": True}, "num_key_value_heads=true: expected a positive integer"),
        ({"eos_token_id": [151643, "x"]}, "eos_token_id="),
        ({"tie_word_embeddings": "no"}, 'tie_word_embeddings="no": expected true or false'),
        ({"rope_theta": -1.0}, "rope_theta=-1.0: expected a finite positive number"),
        ({"head_dim": 64}, "head_dim=64"),
        ({"model_type": "qwen2"}, 'model_type="qwen2" is not supported'),
    ],
)
def test_bad_dream_configs_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config({**DREAM_7B_JSON, **change}, source="x/config.json")
    # the message names the file first, then the key
    with pytest.raises(ConfigError, match=r"^x/config.json: "):
        ModelConfig.from_hf_config({**DREAM_7B_JSON, **change}, source="x/config.json")


@pytest.mark.parametrize(
    "key", ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
)
def test_a_missing_dream_key_is_named(key):
    hf = {k: v for k, v in DREAM_7B_JSON.items() if k != key}
    with pytest.raises(ConfigError, match=f"x/config.json: missing required key '{key}'"):
        ModelConfig.from_hf_config(hf, source="x/config.json")


def test_to_hf_config_round_trips_and_writes_no_remote_code():
    cfg = tiny_dream_config()
    hf = cfg.to_hf_config()
    assert hf["model_type"] == "Dream" and "auto_map" not in hf
    assert ModelConfig.from_hf_config(hf, dtype="float32") == cfg


# ----- conversion ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 3-layer Dream-layout float32 folder (4 query heads over 2 kv heads, q/k/v biases)."""
    cfg = tiny_dream_config(n_layers=3, n_kv_heads=2)
    folder = tmp_path_factory.mktemp("dream") / "hf"
    save_hf_checkpoint(folder, cfg, random_params(cfg, seed=5))
    config = json.loads((folder / "config.json").read_text())
    # a real Dream folder points at its own modeling code: loading must not care
    config["auto_map"] = {"AutoModel": "modeling_dream.DreamModel"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_file_uses_hugging_face_dream_names(checkpoint):
    names = set(load_file(str(checkpoint / "model.safetensors")))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names and "model.norm.weight" in names
    for proj in "qkv":
        assert f"model.layers.2.self_attn.{proj}_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert {
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
    } <= names
    cfg = tiny_dream_config(n_layers=3, n_kv_heads=2)
    assert names == {entry.hf_name for entry in tensor_entries(cfg)}


def test_reading_back_gives_the_written_params(checkpoint):
    cfg = tiny_dream_config(n_layers=3, n_kv_heads=2)
    info, params = read_checkpoint(checkpoint, dtype="float32")
    assert info.config == cfg
    expected = random_params(cfg, seed=5)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, expected)


def folder_with_tensors(checkpoint, folder, tensors):
    """The checkpoint's config.json beside other tensors, in folder."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text((checkpoint / "config.json").read_text())
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_wrong_bias_shape_and_a_missing_bias_are_named(checkpoint, tmp_path):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    bad = folder_with_tensors(
        checkpoint, tmp_path / "bad", {**tensors, "model.layers.1.self_attn.k_proj.bias": np.zeros((3,), np.float32)}
    )
    with pytest.raises(
        ConversionError, match=r"'model.layers.1.self_attn.k_proj.bias' has shape \(3,\), expected \(32,\)"
    ):
        read_checkpoint(bad, dtype="float32")
    del tensors["model.layers.2.self_attn.q_proj.bias"]
    folder_with_tensors(checkpoint, bad, tensors)
    with pytest.raises(ConversionError, match="missing tensor.*model.layers.2.self_attn.q_proj.bias"):
        read_checkpoint(bad, dtype="float32")


def test_an_o_proj_bias_is_an_unexpected_tensor(checkpoint, tmp_path):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    bad = folder_with_tensors(
        checkpoint, tmp_path / "bad", {**tensors, "model.layers.0.self_attn.o_proj.bias": np.zeros((64,), np.float32)}
    )
    with pytest.raises(ConversionError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
        read_checkpoint(bad, dtype="float32")


# ----- parity with transformers' Qwen2 ---------------------------------------------------------


def qwen2_config(cfg: ModelConfig) -> Qwen2Config:
    return Qwen2Config(**hf_decoder_fields(cfg), use_sliding_window=False)


@pytest.fixture(scope="module")
def inputs():
    return padded_inputs(tiny_dream_config().vocab_size, seed=1)


def shifted(logits: np.ndarray) -> np.ndarray:
    """Dream's alignment, written out: row i of the result predicts token i."""
    return np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


def torch_run(checkpoint, cfg: ModelConfig, tokens, key_valid):
    """transformers' Qwen2 on the Dream-layout checkpoint (the same names), its logits shifted
    by one as Dream does."""
    states, logits = transformers_run(Qwen2ForCausalLM(qwen2_config(cfg)), checkpoint, cfg.dtype, tokens, key_valid)
    return states, shifted(logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_layer_and_the_shifted_logits_match_transformers_qwen2(checkpoint, inputs, dtype):
    loaded = assert_the_loaded_model_matches(checkpoint, dtype, inputs, torch_run, padding_queries=False)
    assert loaded.config.family == "dream"


def test_the_biases_matter(checkpoint, inputs):
    """Zeroing the q/k/v biases changes the output: the parity above is not blind to them."""
    loaded = load_model(checkpoint, dtype="float32")
    tokens, key_valid = inputs
    no_bias = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.zeros_like(leaf) if path[-1].key == "bias" else leaf, loaded.weights
    )
    with_bias = forward(loaded.config, loaded.weights, jnp.asarray(tokens))
    without = forward(loaded.config, no_bias, jnp.asarray(tokens))
    assert relative_error(np.asarray(without), np.asarray(with_bias)) > 1e-2


def test_predictions_shift_by_one_only_for_dream():
    logits = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    dream = predictions(tiny_dream_config(), logits)
    np.testing.assert_array_equal(dream[:, 1:], logits[:, :-1])
    np.testing.assert_array_equal(dream[:, 0], logits[:, 0])
    llada = dataclasses.replace(tiny_dream_config(), family="llada", qkv_bias=False)
    np.testing.assert_array_equal(predictions(llada, logits), logits)


def test_a_converted_dream_folder_loads_the_same_params(checkpoint, tmp_path):
    from convert.conversion import convert_checkpoint

    out = convert_checkpoint(checkpoint, tmp_path / "converted", dtype="float32")
    converted, direct = load_model(out, dtype="float32"), load_model(checkpoint, dtype="float32")
    assert converted.config == direct.config and converted.config.family == "dream"
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), converted.weights, direct.weights
    )


def test_8bit_dream_weights_keep_the_biases(checkpoint, tmp_path):
    """A quantized Dream folder: the projections become qkernel/scale, the q/k/v biases stay, the
    embedding is int8, and the logits stay close to the float32 model's."""
    from convert.conversion import convert_checkpoint

    out = convert_checkpoint(checkpoint, tmp_path / "int8", dtype="float32", quantization="int8-weights")
    quantized, direct = load_model(out, dtype="float32"), load_model(checkpoint, dtype="float32")
    assert quantized.config.quantization == "int8-weights"
    for name in ("q_proj", "k_proj", "v_proj"):
        leaf = quantized.weights["layers"][name]
        assert set(leaf) == {"qkernel", "scale", "bias"}
        np.testing.assert_array_equal(np.asarray(leaf["bias"]), np.asarray(direct.weights["layers"][name]["bias"]))
    assert (
        set(quantized.weights["wte"]) == {"qembedding", "scale"}
        and quantized.weights["wte"]["qembedding"].dtype == jnp.int8
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, direct.config.vocab_size, (1, 12)), jnp.int32)
    want = np.asarray(forward(direct.config, direct.weights, tokens))
    got = np.asarray(forward(quantized.config, quantized.weights, tokens))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
