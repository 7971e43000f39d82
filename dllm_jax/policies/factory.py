"""make_policy: the policy object that implements a DecodeConfig."""

from __future__ import annotations

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.diffusion_gemma_config import DiffusionGemmaConfig
from dllm_jax.policies.block import BlockPolicy
from dllm_jax.policies.canvas import CanvasPolicy
from dllm_jax.policies.dream_sampler import DreamSamplerPolicy
from dllm_jax.policies.flash_cache import FlashCachePolicy
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.policy import DecodePolicy


def make_policy(decode_config: DecodeConfig, model: ModelConfig, max_len: int) -> DecodePolicy:
    """The policy object (static, hashable) implementing a DecodeConfig."""
    W = decode_config.window
    if decode_config.method == "flash_cache":
        return FlashCachePolicy(
            window=W,
            lookahead=(decode_config.mask_num - 1) * W,
            tracked=decode_config.track_num * W if decode_config.track_num >= 0 else -1,
            max_len=max_len,
            n_heads=model.n_heads,
            eos_id=model.eos_token_id,
            mask_id=model.mask_token_id,
            verify=decode_config.verify,
            accept=decode_config.accept,
            pin=decode_config.pin,
            logit_shift=model.logit_shift,
        )
    if decode_config.method == "dream":
        return DreamSamplerPolicy(
            block=decode_config.gen_length,
            gen_length=decode_config.gen_length,
            cache="none",
            steps_per_block=decode_config.total_steps,
            eos_id=model.eos_token_id,
            alg=decode_config.alg,
            eps=decode_config.eps,
            steps=decode_config.total_steps,
        )
    blocks = decode_config.gen_length // W
    return BlockPolicy(
        block=W,
        gen_length=decode_config.gen_length,
        cache="none" if decode_config.method == "llada" else decode_config.cache,
        steps_per_block=decode_config.total_steps // blocks if decode_config.fixed_schedule else None,
        eos_id=model.eos_token_id,
    )


def make_canvas_policy(decode_config: DecodeConfig, model: DiffusionGemmaConfig) -> CanvasPolicy:
    """The canvas policy (static, hashable) of a diffusion_gemma DecodeConfig resolved for the
    model (DecodeConfig.for_model: its canvas length)."""
    return CanvasPolicy(
        canvas_length=decode_config.window,
        vocab_size=model.vocab_size,
        max_stability=decode_config.max_stability_threshold,
        eos_ids=model.eos_token_ids,
        pad_id=model.pad_token_id,
        cached_rows=decode_config.canvas_rows,
    )
