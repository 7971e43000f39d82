"""Dream (Dream-v0-Base/Instruct-7B, Dream-Coder-v0-Instruct-7B, DiffuCoder-7B): a Qwen2 block
without the causal mask.

q/k/v projections with biases, grouped-query attention (Dream-7B: 28 query heads, 4 kv
heads), untied LM head, and **shifted logits** (logit_shift 1): Dream keeps the
autoregressive head of the Qwen2.5 model it was initialised from, so the output row of
position i - 1 predicts token i. The model below computes the output rows; the alignment is
applied by whoever reads them (dllm_jax.models.predictions for full sequences, the decode
loop's predictor rows for cached steps). Hugging Face names: convert/dream_names.py.
"""

from __future__ import annotations

from dllm_jax.models.transformer import Block, Transformer


class DreamBlock(Block):
    """One Dream (Qwen2) block (config.qkv_bias is True for every Dream config.json)."""


class DreamModel(Transformer):
    """Dream's mask predictor: tokens -> output rows of every position (row i - 1 predicts token i)."""
