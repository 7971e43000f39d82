"""dllm_jax against an independent PyTorch implementation: transformers' own LlamaForCausalLM.

A LLaDA block is a Llama block (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU)
without the causal mask. So transformers' Llama, given the same weights (read from the same
LLaDA-format checkpoint through a name map) and a 4-D boolean mask that lets every query see
every valid key, computes the function dllm_jax must compute. dllm_jax's side goes through the
real loader (load_model on the Hugging Face folder).
"""

import re

import numpy as np
import pytest
from conftest import tiny_config
from transformers import LlamaConfig, LlamaForCausalLM
from transformers_parity import (
    assert_the_loaded_model_matches,
    hf_decoder_fields,
    jax_run,
    padded_inputs,
    random_params,
    transformers_run,
)

from convert.jax_to_hf import save_hf_checkpoint
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.loading import load_model

pytestmark = pytest.mark.unit

# LLaDA tensor name -> transformers Llama tensor name.
_LLAMA_NAMES = (
    (r"model\.transformer\.wte\.weight", r"model.embed_tokens.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.([qkv])_proj\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.attn_out\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_proj\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.up_proj\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_out\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"model\.transformer\.ln_f\.weight", r"model.norm.weight"),
    (r"model\.transformer\.ff_out\.weight", r"lm_head.weight"),
)


def llama_name(llada_name: str) -> str:
    for pattern, replacement in _LLAMA_NAMES:
        name, count = re.subn(f"^{pattern}$", replacement, llada_name)
        if count:
            return name
    raise KeyError(f"no Llama name for {llada_name}")


def llama_config(cfg: ModelConfig) -> LlamaConfig:
    return LlamaConfig(**hf_decoder_fields(cfg), head_dim=cfg.head_dim, attention_bias=False, mlp_bias=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 3-layer GQA model (4 query heads, 2 kv heads) as a float32 LLaDA-format folder."""
    cfg = tiny_config(n_layers=3)
    return save_hf_checkpoint(tmp_path_factory.mktemp("parity") / "hf", cfg, random_params(cfg, seed=3))


@pytest.fixture(scope="module")
def inputs():
    return padded_inputs(tiny_config().vocab_size, seed=0)


def torch_run(checkpoint, cfg: ModelConfig, tokens, key_valid):
    """transformers' Llama on the LLaDA-format checkpoint, its tensors renamed."""
    return transformers_run(LlamaForCausalLM(llama_config(cfg)), checkpoint, cfg.dtype, tokens, key_valid, llama_name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_layer_and_the_logits_match_transformers_llama(checkpoint, inputs, dtype):
    assert_the_loaded_model_matches(checkpoint, dtype, inputs, torch_run, padding_queries=True)


def test_padding_keys_are_invisible_in_both_implementations(checkpoint, inputs):
    """Changing a padding token changes nothing at the other positions, in either implementation."""
    loaded = load_model(checkpoint, dtype="float32")
    tokens, key_valid = inputs
    changed = tokens.copy()
    changed[1, -1] = (changed[1, -1] + 1) % loaded.config.vocab_size
    _, torch_logits = torch_run(checkpoint, loaded.config, tokens, key_valid)
    _, torch_changed = torch_run(checkpoint, loaded.config, changed, key_valid)
    np.testing.assert_allclose(torch_changed[1, :-1], torch_logits[1, :-1], rtol=1e-6, atol=1e-6)
    jax_logits = jax_run(loaded.config, loaded.weights, tokens, key_valid)[1]
    jax_changed = jax_run(loaded.config, loaded.weights, changed, key_valid)[1]
    np.testing.assert_array_equal(jax_changed[1, :-1], jax_logits[1, :-1])
