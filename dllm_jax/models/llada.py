"""LLaDA (LLaDA-8B-Base/Instruct, LLaDA-1.5): a Llama block without the causal mask.

No biases, multi-head attention (n_kv_heads == n_heads in the published models; GQA is
accepted), untied LM head, same-position logits (logit_shift 0: the output row of position i
predicts token i). Hugging Face names: convert/llada_names.py.
"""

from __future__ import annotations

from dllm_jax.models.transformer import Block, Transformer


class LLaDABlock(Block):
    """One LLaDA block (config.qkv_bias is False for every LLaDA config.json)."""


class LLaDAModel(Transformer):
    """LLaDA's mask predictor: tokens -> logits of every position."""
