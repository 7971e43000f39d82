"""Log-probabilities of committed tokens, recorded at their commit (SamplingParams.logprobs).

A step's candidate logits give, for each position the step commits, the log-probability its
token had then, log_softmax(logits)[token], and the step's K most likely tokens. These are the
model's own probabilities at that step (before temperature, top_p and top_k: the logits the
policy got, guidance applied). Positions committed later in the same request are not revisited:
a diffusion model's token has the probability of the step that committed it.

Whether a loop records is a compile-time choice (DecodeConfig.max_logprobs): a loop compiled
with None, the library's default, has none of this code; one compiled with K >= 0 runs it at
every step for every slot, branch-free (no conditional in the step, whose predicate XLA:GPU
would read back to the host), and writes only the positions committed by slots that ask. Its
cost is one logsumexp over the candidates' logits and a gather, plus, for K > 0, a top-K over
the vocabulary.
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
    K, the alternatives recorded, is new.top_ids' last axis (static).
    """
    B, L = old.tokens.shape
    K = new.top_ids.shape[-1]
    wants = old.active & (old.sampling.logprobs >= 0)  # [B]
    positions, valid = jax.vmap(policy.candidates)(old)  # [B, C]
    safe = jnp.minimum(positions, L - 1)
    committed = jnp.take_along_axis(new.decoded, safe, axis=1) & ~jnp.take_along_axis(old.decoded, safe, axis=1)
    fresh = committed & valid & wants[:, None]
    tokens = jnp.take_along_axis(new.tokens, safe, axis=1)  # [B, C]
    scores = logits.astype(jnp.float32)
    normalizer = jax.nn.logsumexp(scores, axis=-1)  # [B, C]
    chosen = jnp.take_along_axis(scores, tokens[..., None], axis=-1)[..., 0] - normalizer
    rows = jnp.arange(B)[:, None]
    target = jnp.where(fresh, positions, L)  # L is out of range: dropped
    recorded = new.replace(logprob=new.logprob.at[rows, target].set(chosen, mode="drop"))
    if K == 0:
        return recorded
    values, ids = jax.lax.top_k(scores, K)  # [B, C, K]
    return recorded.replace(
        top_ids=new.top_ids.at[rows, target].set(ids.astype(jnp.int32), mode="drop"),
        top_logprobs=new.top_logprobs.at[rows, target].set(values - normalizer[..., None], mode="drop"),
    )
