"""make_policy: the policy object that implements a DecodeConfig."""

from __future__ import annotations

from dllm_jax.models.config import ModelConfig
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.policy import DecodePolicy
from dllm_jax.policies.block import BlockPolicy
from dllm_jax.policies.dream_sampler import DreamSamplerPolicy
from dllm_jax.policies.flash_cache import FlashCachePolicy


def make_policy(decode: DecodeConfig, model: ModelConfig, max_len: int) -> DecodePolicy:
    """The policy object (static, hashable) implementing a DecodeConfig."""
    W = decode.window
    if decode.method == "flash_cache":
        return FlashCachePolicy(
            window=W,
            lookahead=(decode.mask_num - 1) * W,
            tracked=decode.track_num * W if decode.track_num >= 0 else -1,
            max_len=max_len,
            n_heads=model.n_heads,
            eos_id=model.eos_token_id,
            mask_id=model.mask_token_id,
            verify=decode.verify,
            accept=decode.accept,
            pin=decode.pin,
            logit_shift=model.logit_shift,
        )
    if decode.method == "dream":
        return DreamSamplerPolicy(
            block=decode.gen_length,
            gen_length=decode.gen_length,
            cache="none",
            steps_per_block=decode.total_steps,
            eos_id=model.eos_token_id,
            alg=decode.alg,
            eps=decode.eps,
            steps=decode.total_steps,
        )
    blocks = decode.gen_length // W
    return BlockPolicy(
        block=W,
        gen_length=decode.gen_length,
        cache="none" if decode.method == "llada" else decode.cache,
        steps_per_block=decode.total_steps // blocks if decode.uses_schedule else None,
        eos_id=model.eos_token_id,
    )

