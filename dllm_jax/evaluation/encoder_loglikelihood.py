"""DiffusionGemma's log p(continuation | context), exactly: its encoder is a causal language model.

The encoder (dllm_jax.models.diffusion_gemma.encode) reads tokens causally, and its last layer
through the final norm, the tied LM head and the soft-cap gives at row i a distribution over
token i + 1: transformers' DiffusionGemma exposes ``encoder_last_hidden_state`` "to compute an
autoregressive loss on the encoder during training", and the embedded tiny model was trained
with that loss (scripts/train_tiny_diffusion_gemma.py). So, in one pass over context and
continuation (P + L tokens, the last one not read),

    log p(x_P .. x_{P+L-1} | x_0 .. x_{P-1}) = sum_j log softmax(logits[P - 1 + j])[x_{P+j}]

and the continuation is greedy when each of its tokens is its row's argmax (lm-eval's is_greedy
for autoregressive models). LLaDA's Monte-Carlo estimator does not apply to this family: its
decoder denoises canvases corrupted with uniformly random tokens, not masks, and transformers
computes no likelihood with it. A request without context is scored after the BOS token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.evaluation.mc_loglikelihood import bucket_length
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.diffusion_gemma_config import DiffusionGemmaConfig


@dataclasses.dataclass(frozen=True)
class EncoderScore:
    """value: log p(continuation | context) (a float64 sum); greedy: every continuation token is
    the argmax of the row that predicts it."""

    value: float
    greedy: bool


def next_token_scores(
    config: DiffusionGemmaConfig, weights: dg.Weights, tokens: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each row's log-probability of the token after it and its argmax.

    Args:
      tokens: int32 [B, T]; valid: bool [B, T] (False: right padding, never attended).
    Returns:
      (float32 [B, T - 1]: log p(tokens[:, i + 1] | tokens[:, :i + 1]), int32 [B, T - 1]: the
      argmax of the distribution row i gives).
    """
    B, T = tokens.shape
    _, _, hidden = dg.encode(config, weights, tokens, dg.init_cache(config, B, T), valid, return_hidden=True)
    logp = jax.nn.log_softmax(dg.final_logits(config, weights, hidden[-1][:, :-1]), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return picked, jnp.argmax(logp, axis=-1).astype(jnp.int32)


class EncoderLoglikelihood:
    """Scores continuations with the encoder; one compiled pass per length bucket
    (mc_loglikelihood.bucket_length: at most 25% padding)."""

    def __init__(self, config: DiffusionGemmaConfig, weights: dg.Weights):
        self.config = config
        self.weights = weights
        self.forward_passes = 0
        self._scores = jax.jit(functools.partial(next_token_scores, config))

    def score(self, prefix: list[int], target: list[int]) -> EncoderScore:
        """log p(target | prefix) and whether target is greedy; prefix [] means after BOS.

        Raises ValueError for an empty target, or an empty prefix when the model has no BOS.
        """
        if not target:
            raise ValueError("the continuation is empty: nothing to score")
        if not prefix:
            if self.config.bos_token_id is None:
                raise ValueError("the context is empty and the model has no BOS token to start from")
            prefix = [self.config.bos_token_id]
        sequence = prefix + target
        width = bucket_length(len(sequence))
        padded = np.full((1, width), self.config.pad_token_id, np.int32)
        padded[0, : len(sequence)] = sequence
        # the last token is only predicted: no row reads it (nor the padding after it)
        valid = np.arange(width)[None] < len(sequence) - 1
        logp, argmax = jax.device_get(self._scores(self.weights, jnp.asarray(padded), jnp.asarray(valid)))
        self.forward_passes += 1
        rows = slice(len(prefix) - 1, len(prefix) - 1 + len(target))
        return EncoderScore(
            value=float(np.sum(logp[0, rows], dtype=np.float64)),
            greedy=bool(np.array_equal(argmax[0, rows], np.asarray(target))),
        )
