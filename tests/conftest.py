"""Shared test fixtures. Tests run on the CPU; Pallas kernels run in interpret mode."""

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from dllm_jax.config import ModelConfig
from dllm_jax.model import init_params


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer LLaDA-shaped config with grouped-query attention (4 query heads, 2 kv heads)."""
    base = ModelConfig(
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp_hidden_size=96,
        vocab_size=128,
        rope_theta=10000.0,
        mask_token_id=126,
        eos_token_id=127,
        pad_token_id=127,
        bos_token_id=125,
        max_sequence_length=512,
        dtype="float32",
    )
    return dataclasses.replace(base, **overrides)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return tiny_config()


@pytest.fixture
def tiny_params(tiny_cfg):
    return init_params(tiny_cfg, jax.random.key(0))
