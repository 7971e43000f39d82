"""Batch invariance in bfloat16 on the CPU: a request's answer does not depend on the batch.

tests/test_engine.py checks the same in float32; bf16 rounds every activation, so a result
that depends on how many rows share a GEMM, an attention call or a full-pass lane shows up here.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decode_config import DecodeConfig
from dllm_jax.engine import Engine


@pytest.fixture(scope="module")
def lively_bf16(lively):
    cfg, params = lively
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    return cfg, jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), params)


def _prompts(seed, lengths):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(0, 100, n)) for n in lengths]


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(method="flash_cache", gen_length=32, batch_size=4, threshold=0.5, mask_num=2, track_num=1),
        DecodeConfig(method="flash_cache", gen_length=32, batch_size=4, threshold=0.5, mask_num=2, track_num=1, verify=True),
        DecodeConfig(method="fast_dllm", gen_length=32, block_length=16, threshold=0.5, batch_size=4),
        DecodeConfig(method="llada", gen_length=32, block_length=16, steps=16, batch_size=4),
    ],
    ids=["flash", "flash_verify", "fast_dllm", "llada"],
)
def test_bf16_answers_do_not_depend_on_the_batch(lively_bf16, decode):
    cfg, params = lively_bf16
    engine = Engine(cfg, params, backend="xla")
    many = _prompts(1, (5, 14, 8, 11, 3, 16, 9))
    together = engine.generate(many, decode)
    assert together.stats.iterations < sum(r.steps for r in together.results), "slots ran concurrently"
    answers = [r.token_ids for r in together.results]
    assert len({tuple(a) for a in answers}) > 1, "the prompts should get different answers"
    for i in (0, 3, 5):
        alone = engine.generate([many[i]], decode).results[0]
        assert (alone.token_ids, alone.steps) == (answers[i], together.results[i].steps), i
