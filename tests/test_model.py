import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.models import transformer
from dllm_jax.models.config import ConfigError, ModelConfig, llada_8b_config
from dllm_jax.models.transformer import Block, abstract_params, count_params, forward, init_params

pytestmark = pytest.mark.unit


def test_llada_8b_config_has_the_published_parameter_count():
    cfg = llada_8b_config()
    params = abstract_params(cfg)
    assert count_params(params) == 8_015_581_184 == cfg.num_params()
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    assert nbytes == 16_031_162_368
    # layers are stacked, not copied per layer
    assert params["layers"]["q_proj"]["kernel"].shape == (32, 4096, 4096)


def test_attention_is_bidirectional_and_respects_key_padding(tiny_cfg, tiny_params):
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, tiny_cfg.vocab_size)
    base = forward(tiny_cfg, tiny_params, tokens)
    changed_last = forward(tiny_cfg, tiny_params, tokens.at[0, -1].set((tokens[0, -1] + 1) % 100))
    # position 0 sees the last token: no causal mask
    assert not np.allclose(base[0, 0], changed_last[0, 0])
    valid = jnp.arange(12)[None] < 10
    padded = forward(tiny_cfg, tiny_params, tokens, key_valid=valid)
    padded_changed = forward(tiny_cfg, tiny_params, tokens.at[0, -1].set(3), key_valid=valid)
    np.testing.assert_array_equal(padded[0, :10], padded_changed[0, :10])


def test_scan_compiles_one_layer_body(tiny_cfg, tiny_params):
    deep = dataclasses.replace(tiny_cfg, n_layers=6)
    params = init_params(deep, jax.random.key(0))
    tokens = jnp.zeros((1, 8), jnp.int32)
    hlo = jax.jit(lambda p, t: forward(deep, p, t)).lower(params, tokens).as_text()
    assert "while" in hlo
    assert hlo.count("dot_general") < 20  # 6 unrolled layers would hold 7 * 6 projections


@pytest.mark.parametrize("rows", [transformer.MERGED_QKV_MAX_ROWS, transformer.MERGED_QKV_MAX_ROWS + 8])
def test_qkv_read_their_own_rows_past_the_merge_limit(tiny_cfg, tiny_params, rows):
    """Past MERGED_QKV_MAX_ROWS the projections' dots get separate inputs (an optimization
    barrier, so XLA:GPU's DotMerger cannot concatenate their weights on every call); the values
    are those of the plain projections either way."""
    layer = jax.tree.map(lambda a: a[0], tiny_params["layers"])
    x = jax.random.normal(jax.random.key(2), (2, rows // 2, tiny_cfg.d_model), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(rows // 2), (2, rows // 2))

    def project(x, positions):
        return Block(tiny_cfg).apply({"params": layer}, x, positions, method=Block.project_qkv)

    hlo = jax.jit(project).lower(x, positions).as_text()
    assert ("optimization_barrier" in hlo) == (rows > transformer.MERGED_QKV_MAX_ROWS)
    _, _, v = project(x, positions)
    np.testing.assert_array_equal(
        v.reshape(rows, -1), (x.reshape(rows, -1) @ layer["v_proj"]["kernel"]).astype(v.dtype)
    )


@pytest.mark.parametrize(
    "key,value",
    [
        ("alibi", True),
        ("include_bias", True),
        ("attention_layer_norm", True),
        ("layer_norm_type", "default"),
        ("include_qkv_bias", True),
        ("scale_logits", True),
    ],
)
def test_unsupported_options_are_named(key, value):
    hf = llada_8b_config().to_hf_config()
    hf[key] = value
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf_config(hf)


def test_missing_key_is_named():
    hf = llada_8b_config().to_hf_config()
    del hf["n_layers"]
    with pytest.raises(ConfigError, match="n_layers"):
        ModelConfig.from_hf_config(hf)


def test_hf_config_round_trip():
    cfg = llada_8b_config()
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
