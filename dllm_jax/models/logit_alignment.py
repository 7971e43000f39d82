"""Which output rows predict which positions: the one place the decode loop applies a model
family's logit alignment (ModelConfig.logit_shift).

With shift s, the prediction for position p is the output row at position p - s (LLaDA:
s = 0, the candidate's own row; Dream: s = 1, the row before it, as in an autoregressive
head). A pass therefore computes logits of the candidates' *predictor rows*, and the tracking
score sums over those same rows (they are the rows whose attention decides the predictions).
A sparse pass of a shifted model recomputes the predictor rows in front of the policy's own
query rows, so every prediction comes from a row computed this step; a position that is both
a predictor and one of the policy's rows is computed twice with identical inputs (identical
K/V written to its cache row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def predictor_positions(candidates: jax.Array, valid: jax.Array, shift: int) -> tuple[jax.Array, jax.Array]:
    """Positions of the output rows that predict the candidates (int32 [..., C]) and their validity.

    A candidate at a position < shift has no predictor row (never the case for a request with
    a prompt: the first generated position is predicted by the last prompt position).
    """
    positions = candidates - shift
    return jnp.maximum(positions, 0).astype(jnp.int32), valid & (positions >= 0)


def with_predictor_rows(
    positions: jax.Array, row_valid: jax.Array, candidates: jax.Array, candidate_valid: jax.Array, shift: int
) -> tuple[jax.Array, jax.Array]:
    """A sparse query [S, R] (its first C rows the candidates) -> the query whose first C rows
    are the candidates' predictor rows: unchanged for shift 0, else [S, C + R]."""
    if shift == 0:
        return positions, row_valid
    predictors, predictor_valid = predictor_positions(candidates, candidate_valid, shift)
    return jnp.concatenate([predictors, positions], axis=1), jnp.concatenate([predictor_valid, row_valid], axis=1)
