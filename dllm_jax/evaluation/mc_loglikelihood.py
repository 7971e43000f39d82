"""LLaDA's Monte-Carlo estimate of log p(continuation | context), over the full (no cache) forward
(for a Dream model too: its predictions read from the rows before their positions).

For a context of P tokens and a continuation of L tokens, each sample masks some of the
continuation and scores the masked tokens; LLaDA's estimator (its eval_llada.py
``get_log_likelihood``) is

    log p ~= - mean over batches of  (1/b) * sum_i sum_{j masked in row i} -log p(x_j | noisy_i) / (m_i / L)

where a batch has b rows, row i masks m_i of the L continuation positions chosen uniformly
at random, and the counts are stratified: draw k uniformly in [1, L], then
m_i = ((round(k + i * L / b) - 1) mod L) + 1. mc_num samples are drawn in mc_num / b batches.
With cfg_scale > 0 the logits are LLaDA's unsupervised guidance
un + (cfg_scale + 1) * (cond - un), where the unconditional input masks the whole context.

The random masks of a request come from its own generator, seeded by the seed and the
request's tokens, so an estimate does not depend on the other requests or their order.
"""

from __future__ import annotations

import dataclasses
import hashlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.families import model_class
from dllm_jax.models.transformer import Transformer, Weights

_MIN_BUCKET = 16


def bucket_length(n: int) -> int:
    """n rounded up to one of four sizes per octave (at most 25% padding; few compiled shapes)."""
    if n <= _MIN_BUCKET:
        return _MIN_BUCKET
    step = max(8, 1 << ((n - 1).bit_length() - 3))
    return -(-n // step) * step


def draw_masks(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """One batch of LLaDA's random masks over a continuation: bool [batch, length].

    Row i masks m_i positions (stratified counts, see the module docstring), chosen by a
    random permutation: position j is masked iff perm_i[j] < m_i.
    """
    k = int(rng.integers(1, length + 1))
    counts = np.round(np.linspace(k, k + (batch - 1) * (length / batch), batch)).astype(np.int64)
    counts = (counts - 1) % length + 1
    perms = np.stack([rng.permutation(length) for _ in range(batch)])
    return perms < counts[:, None]


def request_rng(seed: int, prefix: list[int], target: list[int]) -> np.random.Generator:
    """The generator of one request's masks: a function of the seed and the request's tokens."""
    digest = hashlib.blake2b(np.asarray(prefix + [-1] + target, np.int64).tobytes(), digest_size=8).digest()
    return np.random.default_rng([seed, int.from_bytes(digest, "little")])


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One request's estimate and the masks it used.

    value: the estimated log-likelihood; masks: bool [mc_num, L], batch after batch.
    """

    value: float
    masks: np.ndarray


class MonteCarloLoglikelihood:
    """Scores continuations with LLaDA's estimator; one compiled forward per shape bucket.

    Args:
      config, params: the model (layer-stacked params, as dllm_jax.models.init_params makes).
      mc_num: samples per request; mc_batch_size: samples per forward pass (divides mc_num).
      cfg_scale: classifier-free guidance scale, 0 = off.
      seed: base of the per-request mask generators.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Weights,
        *,
        mc_num: int,
        mc_batch_size: int,
        cfg_scale: float = 0.0,
        seed: int = 0,
    ):
        if mc_num % mc_batch_size:
            raise ValueError(f"mc_num={mc_num} is not a multiple of mc_batch_size={mc_batch_size}")
        self.config = config
        self.params = params
        self.mc_num = mc_num
        self.mc_batch_size = mc_batch_size
        self.cfg_scale = cfg_scale
        self.seed = seed
        self.forward_passes = 0
        self._score = jax.jit(partial(_target_logprobs, config, guided=cfg_scale > 0))
        self._greedy = jax.jit(partial(_target_argmax, config), static_argnames="rows")

    def estimate(self, prefix: list[int], target: list[int]) -> Estimate:
        """log p(target | prefix) by LLaDA's estimator; an empty target has log-likelihood 0."""
        L = len(target)
        if L == 0:
            return Estimate(0.0, np.zeros((self.mc_num, 0), bool))
        rng = request_rng(self.seed, prefix, target)
        b = self.mc_batch_size
        masks = np.concatenate([draw_masks(rng, b, L) for _ in range(self.mc_num // b)])
        batch_losses = []
        for start in range(0, self.mc_num, b):
            rows = masks[start : start + b]
            logp = self.masked_logprobs(prefix, target, rows)
            share = rows.sum(axis=1, keepdims=True) / L
            batch_losses.append(float(np.sum(np.where(rows, -logp / share, 0.0)) / b))
        return Estimate(-float(np.mean(batch_losses)), masks)

    def masked_logprobs(self, prefix: list[int], target: list[int], masks: np.ndarray) -> np.ndarray:
        """log p(target_j | noisy row) at every continuation position: float64 [rows, L].

        Row r of the input is prefix + target with target position j replaced by [MASK]
        where masks[r, j]; with cfg_scale > 0 the guided logits are scored.
        """
        P, L = len(prefix), len(target)
        rows = masks.shape[0]
        width, target_width = bucket_length(P + L), bucket_length(L)
        tokens = np.full((rows, width), self.config.pad_token_id, np.int32)
        tokens[:, :P] = prefix
        tokens[:, P : P + L] = np.where(masks, self.config.mask_token_id, np.asarray(target, np.int32))
        labels = np.zeros((target_width,), np.int32)
        labels[:L] = target
        logp = self._score(
            self.params,
            jnp.asarray(tokens),
            jnp.asarray(labels),
            jnp.int32(P),
            jnp.int32(P + L),
            jnp.float32(self.cfg_scale),
        )
        self.forward_passes += 1
        return np.asarray(logp, np.float64)[:, :L]

    def greedy_reproduces(self, prefix: list[int], target: list[int]) -> bool:
        """LLaDA's suffix_greedy_prediction: starting from an all-[MASK] continuation, commit the
        most confident prediction one position per step; True iff the result is the target."""
        P, L = len(prefix), len(target)
        if L == 0:
            return True
        width, target_width = bucket_length(P + L), bucket_length(L)
        tokens = np.full((1, width), self.config.pad_token_id, np.int32)
        tokens[0, :P] = prefix
        tokens[0, P : P + L] = self.config.mask_token_id
        for _ in range(L):
            best, confidence = self._greedy(
                self.params, jnp.asarray(tokens), jnp.int32(P), jnp.int32(P + L), rows=target_width
            )
            self.forward_passes += 1
            best, confidence = np.asarray(best)[:L], np.asarray(confidence, np.float64)[:L]
            masked = tokens[0, P : P + L] == self.config.mask_token_id
            j = int(np.argmax(np.where(masked, confidence, -np.inf)))
            tokens[0, P + j] = best[j]
        return bool(np.array_equal(tokens[0, P : P + L], np.asarray(target)))


def _hidden_rows(module: Transformer, tokens, length, start, rows: int):
    """Final hidden rows [B, rows, D] predicting positions start.. (the rows logit_shift before
    them: Dream's row i - 1 predicts token i) of a full bidirectional pass over tokens [B, T],
    keys beyond `length` masked out."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    key_valid = positions < length
    h = module.embed(tokens)
    h, _ = module.layers(h, positions, key_valid[:, None, :])
    index = jnp.clip(start - module.config.logit_shift + jnp.arange(rows), 0, T - 1)
    return h[:, index]


def _target_logprobs(config: ModelConfig, params: Weights, tokens, labels, start, length, cfg_scale, *, guided: bool):
    """log p(labels) at rows start.. : float32 [B, len(labels)] (LLaDA's guidance when guided)."""
    model = model_class(config)(config)
    rows = labels.shape[0]

    def logits_of(batch):
        h = model.apply({"params": params}, batch, length, start, rows, method=_hidden_rows)
        return model.apply({"params": params}, h, method=Transformer.logits).astype(jnp.float32)

    logits = logits_of(tokens)
    if guided:
        context = jnp.arange(tokens.shape[1]) < start
        unconditional = jnp.where(context[None, :], config.mask_token_id, tokens)
        un = logits_of(unconditional)
        logits = un + (cfg_scale + 1.0) * (logits - un)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, jnp.broadcast_to(labels, logp.shape[:2])[..., None], axis=-1)[..., 0]


def _target_argmax(config: ModelConfig, params: Weights, tokens, start, length, rows: int):
    """Argmax token and its softmax probability at rows start.. : int32 [rows], float32 [rows]."""
    model = model_class(config)(config)
    h = model.apply({"params": params}, tokens, length, start, rows, method=_hidden_rows)
    logits = model.apply({"params": params}, h, method=Transformer.logits).astype(jnp.float32)[0]
    probs = jax.nn.softmax(logits, axis=-1)
    best = jnp.argmax(logits, axis=-1)
    return best.astype(jnp.int32), jnp.take_along_axis(probs, best[:, None], axis=-1)[:, 0]
