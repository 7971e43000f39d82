"""Log-probabilities of committed tokens, recorded at their commit (SamplingParams.logprobs).

A step's candidate logits give, for each position the step commits, the log-probability its
token had then, log_softmax(logits)[token], and the step's K most likely tokens. These are the
model's own probabilities at that step (before temperature, top_p and top_k: the logits the
policy got, guidance applied). Positions committed later in the same request are not revisited:
a diffusion model's token has the probability of the step that committed it.

The work is skipped by a conditional when no active slot asks, so a loop whose requests do not
ask pays one predicate per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.runtime.policy import DecodePolicy
from dllm_jax.runtime.slots import Slots


def record_commit_logprobs(policy: DecodePolicy, old: Slots, new: Slots, logits: jax.Array) -> Slots:
    """`new` with the log-probabilities of the positions this step committed, for slots that ask.

    old, new: the slots before and after this step's commits (leading [B] axis);
    logits: [B, C, V] the unfiltered logits of old's candidates (policy.candidates order).
    """
    wants = old.active & (old.sampling.logprobs >= 0)

    def record(arrays):
        logprob, top_ids, top_logprobs = arrays
        B, L = old.tokens.shape
        K = top_ids.shape[-1]
        positions, valid = jax.vmap(policy.candidates)(old)
        safe = jnp.minimum(positions, L - 1)
        committed = (
            jnp.take_along_axis(new.decoded, safe, axis=1) & ~jnp.take_along_axis(old.decoded, safe, axis=1) & valid
        )
        fresh = committed & wants[:, None]
        tokens = jnp.take_along_axis(new.tokens, safe, axis=1)  # [B, C]
        scores = logits.astype(jnp.float32)
        normalizer = jax.nn.logsumexp(scores, axis=-1)  # [B, C]
        chosen = jnp.take_along_axis(scores, tokens[..., None], axis=-1)[..., 0] - normalizer
        rows = jnp.arange(B)[:, None]
        target = jnp.where(fresh, positions, L)  # L is out of range: dropped
        logprob = logprob.at[rows, target].set(chosen, mode="drop")
        if K:
            values, ids = jax.lax.top_k(scores, K)  # [B, C, K]
            top_ids = top_ids.at[rows, target].set(ids.astype(jnp.int32), mode="drop")
            top_logprobs = top_logprobs.at[rows, target].set(values - normalizer[..., None], mode="drop")
        return logprob, top_ids, top_logprobs

    arrays = (new.logprob, new.top_ids, new.top_logprobs)
    logprob, top_ids, top_logprobs = jax.lax.cond(jnp.any(wants), record, lambda a: a, arrays)
    return new.replace(logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs)
