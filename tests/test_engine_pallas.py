"""The engine on the Pallas kernels (interpret mode) decodes the same tokens as on XLA."""

import jax
import numpy as np
import pytest

from dllm_jax.decode_config import DecodeConfig
from dllm_jax.engine import Engine
from dllm_jax.model import init_params
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(method="flash_cache", gen_length=32, batch_size=2, threshold=0.7, mask_num=2, track_num=1, verify=True, gamma=0.3),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, threshold=0.5, batch_size=2),
    ],
    ids=["flash_verify", "fast_dllm_dual"],
)
def test_pallas_backend_decodes_like_xla(decode):
    # head_dim 32: the kernels' smallest tile is 16 rotary pairs
    cfg = tiny_config(d_model=128, mlp_hidden_size=128)
    params = init_params(cfg, jax.random.key(0))
    params["layers"] = jax.tree_util.tree_map(lambda w: w * 8 if w.ndim == 3 else w, params["layers"])
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 20
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, 100, n)) for n in (12, 7, 15, 9, 3)]
    xla = Engine(cfg, params, backend="xla").generate(prompts, decode)
    pallas = Engine(cfg, params, backend="pallas", interpret=True).generate(prompts, decode)
    assert [r.token_ids for r in pallas.results] == [r.token_ids for r in xla.results]
    assert [r.steps for r in pallas.results] == [r.steps for r in xla.results]
    assert xla.stats.tokens_per_step > 1.05
