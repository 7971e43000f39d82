"""What the parity tests against transformers' models share, for every family.

A family's block is a transformers decoder block without the causal mask: given the same
weights and a 4-D boolean mask [B, 1, T, T] that lets every query see every valid key, the
transformers model computes what dllm_jax must. Here: O(1) random params, padded inputs, both
sides' hidden states (the embedding, each layer, the last one after the final norm) and logits,
and the comparison of the two.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from safetensors.torch import load_file

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.families import block_class, model_class
from dllm_jax.models.loading import LoadedModel, load_model
from dllm_jax.models.transformer import abstract_params, forward, predictions

# relative L2 error allowed between the two implementations, per dtype
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def random_params(cfg: ModelConfig, seed: int):
    """Weights whose activations and logits are O(1): unit embeddings, 1/sqrt(fan_in) kernels,
    norm gains scattered around 1 (so a swapped norm would show), biases of size ~0.3 (so a
    dropped or misplaced bias shows)."""
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
        elif kind == "bias":
            leaves.append(0.3 * noise)
        else:
            leaves.append(noise / np.sqrt(leaf.shape[-2]))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def padded_inputs(vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens int [2, 16] and key_valid bool [2, 16]: the second row's last 5 keys are padding."""
    tokens = np.random.default_rng(seed).integers(0, vocab_size, size=(2, 16))
    key_valid = np.ones((2, 16), dtype=bool)
    key_valid[1, -5:] = False
    return tokens, key_valid


def hf_decoder_fields(cfg: ModelConfig) -> dict:
    """The transformers config fields (LlamaConfig, Qwen2Config) that a family's config fixes."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_hidden_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_sequence_length,
        tie_word_embeddings=False,
        # sdpa honours a boolean mask; eager adds the mask to the logits, so a boolean one
        # becomes +1/+0 and padding keys would stay visible
        attn_implementation="sdpa",
    )


def transformers_run(
    model: torch.nn.Module,
    checkpoint: Path,
    dtype: str,
    tokens,
    key_valid,
    hf_name: Callable[[str], str] = lambda name: name,
):
    """The transformers model, loaded (strictly) from the folder's model.safetensors under the
    names hf_name gives, run bidirectionally in dtype: float32 numpy hidden states
    [n_layers + 1] x [B, T, D] and logits [B, T, V], the logits unshifted."""
    state = {hf_name(name): tensor for name, tensor in load_file(str(checkpoint / "model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    model = model.to(getattr(torch, dtype)).eval()
    B, T = tokens.shape
    # [B, 1, T, T] True = may attend: bidirectional, padding keys hidden from every query
    mask = torch.from_numpy(key_valid)[:, None, None, :].expand(B, 1, T, T)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), attention_mask=mask, output_hidden_states=True)
    as_numpy = lambda t: t.float().numpy()  # noqa: E731
    return [as_numpy(h) for h in out.hidden_states], as_numpy(out.logits)


def jax_run(cfg: ModelConfig, params, tokens, key_valid):
    """dllm_jax's hidden states in transformers_run's convention, layer by layer through the
    family's block, and its predictions (row i predicts token i: Dream's logits shifted by one)."""
    tokens, key_valid = jnp.asarray(tokens), jnp.asarray(key_valid)
    model = model_class(cfg)(cfg)
    h = model.apply({"params": params}, tokens, method=type(model).embed)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    states = [h]
    for layer in range(cfg.n_layers):
        layer_params = jax.tree.map(lambda leaf: leaf[layer], params["layers"])
        h, _ = block_class(cfg)(cfg).apply({"params": layer_params}, h, positions, key_valid[:, None, :])
        states.append(h)
    states[-1] = model.apply({"params": params}, h, method=lambda m, x: m.ln_f(x))
    logits = predictions(cfg, forward(cfg, params, tokens, key_valid=key_valid))
    as_numpy = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    return [as_numpy(s) for s in states], as_numpy(logits)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual.astype(np.float64) - expected) / np.linalg.norm(expected.astype(np.float64)))


def assert_the_loaded_model_matches(
    checkpoint: Path, dtype: str, inputs, torch_run: Callable, *, padding_queries: bool
) -> LoadedModel:
    """load_model(checkpoint, dtype) against ``torch_run(checkpoint, config, tokens, key_valid)``
    on inputs (tokens, key_valid): every hidden state and the logits (of the padding queries too
    if padding_queries) within TOLERANCE[dtype]; in float32 the same argmax too. Returns the
    loaded model."""
    loaded = load_model(checkpoint, dtype=dtype)
    tokens, key_valid = inputs
    jax_states, jax_logits = jax_run(loaded.config, loaded.weights, tokens, key_valid)
    torch_states, torch_logits = torch_run(checkpoint, loaded.config, tokens, key_valid)
    assert len(jax_states) == len(torch_states) == loaded.config.n_layers + 1
    for index, (actual, expected) in enumerate(zip(jax_states, torch_states)):
        assert relative_error(actual, expected) < TOLERANCE[dtype], f"hidden state {index}"
    rows = ... if padding_queries else key_valid
    assert relative_error(jax_logits[rows], torch_logits[rows]) < TOLERANCE[dtype]
    if dtype == "float32":
        np.testing.assert_array_equal(jax_logits.argmax(-1)[rows], torch_logits.argmax(-1)[rows])
    return loaded
