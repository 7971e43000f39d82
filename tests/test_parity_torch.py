"""dllm_jax against an independent PyTorch implementation: transformers' own LlamaForCausalLM.

A LLaDA block is a Llama block (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU)
without the causal mask. So transformers' Llama, given the same weights (read from the same
LLaDA-format checkpoint through a name map) and a 4-D boolean mask that lets every query see
every valid key, computes the function dllm_jax must compute. dllm_jax's side goes through the
real loader (load_model on the Hugging Face folder).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_config
from convert.jax_to_hf import save_hf_checkpoint
from dllm_jax.config import ModelConfig
from dllm_jax.loading import load_model
from dllm_jax.models import LLaDABlock, LLaDAModel, abstract_params, forward

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

_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def llama_name(llada_name: str) -> str:
    for pattern, replacement in _LLAMA_NAMES:
        name, count = re.subn(f"^{pattern}$", replacement, llada_name)
        if count:
            return name
    raise KeyError(f"no Llama name for {llada_name}")


def llama_config(cfg: ModelConfig) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_hidden_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_sequence_length,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        # sdpa honours a boolean mask; eager adds the mask to the logits, so a boolean one
        # becomes +1/+0 and padding keys would stay visible
        attn_implementation="sdpa",
    )


def random_params(cfg: ModelConfig, seed: int):
    """Params whose activations and logits are O(1): unit embeddings, 1/sqrt(fan_in) kernels,
    norm gains scattered around 1 (so a swapped norm would show)."""
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params(cfg))
    keys = jax.random.split(jax.random.key(seed), len(paths_and_leaves))
    leaves = []
    for (path, leaf), key in zip(paths_and_leaves, keys):
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        kind = path[-1].key
        if kind == "weight":
            leaves.append(1.0 + 0.2 * noise)
        elif kind == "embedding":
            leaves.append(noise)
        else:
            leaves.append(noise / np.sqrt(leaf.shape[-2]))
    return jax.tree_util.tree_unflatten(treedef, leaves)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 3-layer GQA model (4 query heads, 2 kv heads) as a float32 LLaDA-format folder."""
    cfg = tiny_config(n_layers=3)
    return save_hf_checkpoint(tmp_path_factory.mktemp("parity") / "hf", cfg, random_params(cfg, seed=3))


@pytest.fixture(scope="module")
def inputs():
    """Tokens [2, 16]; the second row's last 5 keys are padding."""
    tokens = np.random.default_rng(0).integers(0, tiny_config().vocab_size, size=(2, 16))
    key_valid = np.ones((2, 16), dtype=bool)
    key_valid[1, -5:] = False
    return tokens, key_valid


def torch_run(checkpoint, cfg: ModelConfig, tokens, key_valid):
    """transformers' hidden states (embedding, each layer; the last one after the final norm) and logits."""
    model = LlamaForCausalLM(llama_config(cfg))
    state = {llama_name(name): tensor for name, tensor in load_file(str(checkpoint / "model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    model = model.to(getattr(torch, cfg.dtype)).eval()
    B, T = tokens.shape
    # [B, 1, T, T] True = may attend: bidirectional, padding keys hidden from every query
    mask = torch.from_numpy(key_valid)[:, None, None, :].expand(B, 1, T, T)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), attention_mask=mask, output_hidden_states=True)
    as_numpy = lambda t: t.float().numpy()
    return [as_numpy(h) for h in out.hidden_states], as_numpy(out.logits)


def jax_run(cfg: ModelConfig, params, tokens, key_valid):
    """dllm_jax's hidden states in the same convention as torch_run, layer by layer, and its logits."""
    tokens, key_valid = jnp.asarray(tokens), jnp.asarray(key_valid)
    model = LLaDAModel(cfg)
    h = model.apply({"params": params}, tokens, method=LLaDAModel.embed)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    states = [h]
    for layer in range(cfg.n_layers):
        layer_params = jax.tree.map(lambda leaf: leaf[layer], params["layers"])
        h, _ = LLaDABlock(cfg).apply({"params": layer_params}, h, positions, key_valid[:, None, :])
        states.append(h)
    states[-1] = model.apply({"params": params}, h, method=lambda m, x: m.ln_f(x))
    logits = forward(cfg, params, tokens, key_valid=key_valid)
    as_numpy = lambda x: np.asarray(x.astype(jnp.float32))
    return [as_numpy(s) for s in states], as_numpy(logits)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual.astype(np.float64) - expected) / np.linalg.norm(expected.astype(np.float64)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_layer_and_the_logits_match_transformers_llama(checkpoint, inputs, dtype):
    loaded = load_model(checkpoint, dtype=dtype)
    tokens, key_valid = inputs
    torch_states, torch_logits = torch_run(checkpoint, loaded.config, tokens, key_valid)
    jax_states, jax_logits = jax_run(loaded.config, loaded.params, tokens, key_valid)
    assert len(jax_states) == len(torch_states) == loaded.config.n_layers + 1
    for index, (actual, expected) in enumerate(zip(jax_states, torch_states)):
        assert relative_error(actual, expected) < _TOLERANCE[dtype], f"hidden state {index}"
    assert relative_error(jax_logits, torch_logits) < _TOLERANCE[dtype]
    if dtype == "float32":
        np.testing.assert_array_equal(jax_logits.argmax(-1), torch_logits.argmax(-1))


def test_padding_keys_are_invisible_in_both_implementations(checkpoint, inputs):
    """Changing a padding token changes nothing at the other positions, in either implementation."""
    loaded = load_model(checkpoint, dtype="float32")
    tokens, key_valid = inputs
    changed = tokens.copy()
    changed[1, -1] = (changed[1, -1] + 1) % loaded.config.vocab_size
    _, torch_logits = torch_run(checkpoint, loaded.config, tokens, key_valid)
    _, torch_changed = torch_run(checkpoint, loaded.config, changed, key_valid)
    np.testing.assert_allclose(torch_changed[1, :-1], torch_logits[1, :-1], rtol=1e-6, atol=1e-6)
    jax_logits = jax_run(loaded.config, loaded.params, tokens, key_valid)[1]
    jax_changed = jax_run(loaded.config, loaded.params, changed, key_valid)[1]
    np.testing.assert_array_equal(jax_changed[1, :-1], jax_logits[1, :-1])
