"""A tiny DiffusionGemma checkpoint written by transformers' own save_pretrained, for the tests.

It keeps every feature of the family: sliding and full layers interleaved (the full ones with
wider heads, fewer kv heads and k = v), a window shorter than a prompt, 4 experts with top-2
routing, self-conditioning, layer scalars that differ between encoder and decoder, and a
vision tower (which dllm_jax skips).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

TEXT_CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=16,
    num_global_key_value_heads=1,
    sliding_window=4,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=16,
    max_position_embeddings=64,
)
VISION_CONFIG = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=4,
    pooling_kernel_size=1,
    position_embedding_size=16,
)


def save_tiny_diffusion_gemma(folder: Path, canvas_length: int, **text_overrides) -> DiffusionGemmaForBlockDiffusion:
    """Saves transformers' model with O(1) random weights in `folder` and returns it.

    Norm gains and scales scatter around 1 and the layer scalars around 1 (the encoder's differ
    from the decoder's); self-conditioning's output projection is small, so a step's float32
    rounding is not amplified from step to step of a generation (at full scale the random map
    is chaotic at low temperature).
    """
    text = {**TEXT_CONFIG, **text_overrides}
    config = DiffusionGemmaConfig(text_config=text, vision_config=VISION_CONFIG, canvas_length=canvas_length)
    # sdpa: transformers' generate builds its padded decoder mask from the int canvas, which its
    # eager mask (a float mask of the inputs' dtype) cannot take
    config._attn_implementation = config.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        model.model.decoder.self_conditioning.down_proj.weight.mul_(0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(folder)
    return model
