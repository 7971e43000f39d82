"""Property tests of the commit rules: their invariants hold for any float input.

The decode loop ends only because every step commits at least one eligible position; a rule
that commits nothing on NaN, inf or ties spins forever, one that commits an ineligible
position overwrites a decoded token. Each property is checked against a plain Python model
of the rule on random arrays that mix finite values, repeats, signed zeros, +-inf and NaN.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dllm_jax.policies.commit_rules import count_commit, descending_rank, threshold_commit

pytestmark = pytest.mark.unit

# A few repeated finite values make ties likely; the rest are the non-finite and signed-zero cases.
SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, 0.5, 0.9, 1e-30, -1e30]
# No subnormals: XLA flushes them to zero, so their order against 0.0 is the platform's, not the rule's.
FLOATS = st.one_of(
    st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False, width=32)
)
SIZE = st.integers(1, 12)


@st.composite
def candidates(draw):
    """(confidence float32 [C], eligible bool [C]) for a random C."""
    size = draw(SIZE)
    values = draw(st.lists(FLOATS, min_size=size, max_size=size))
    eligible = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    return np.array(values, np.float32), np.array(eligible, bool)


def reference_order(values, eligible):
    """Indices by the documented order: eligible first, then descending value (NaN as -inf,
    -0.0 as 0.0), then ascending index."""

    def key(i):
        v = -math.inf if math.isnan(values[i]) else float(values[i]) + 0.0
        return (not eligible[i], -v, i)

    return sorted(range(len(values)), key=key)


# jit once per shape: hypothesis draws many arrays of few sizes
rank_fn = jax.jit(descending_rank)
threshold_fn = jax.jit(threshold_commit)
count_fn = jax.jit(count_commit)

settings.register_profile("commit_rules", max_examples=150, deadline=None)
settings.load_profile("commit_rules")


@given(candidates())
def test_rank_is_the_documented_permutation(case):
    values, eligible = case
    rank = np.asarray(rank_fn(jnp.asarray(values), jnp.asarray(eligible)))
    order = reference_order(values, eligible)
    expected = np.empty(len(values), np.int64)
    expected[order] = np.arange(len(values))
    np.testing.assert_array_equal(rank, expected)
    # every eligible entry ranks before every ineligible one
    if eligible.any() and (~eligible).any():
        assert rank[eligible].max() < rank[~eligible].min()


@given(candidates(), FLOATS)
def test_threshold_commit_commits_at_least_one_eligible_and_never_an_ineligible(case, threshold):
    values, eligible = case
    commit = np.asarray(threshold_fn(jnp.asarray(values), jnp.asarray(eligible), jnp.float32(threshold)))
    assert not (commit & ~eligible).any()
    assert commit.any() == eligible.any()
    # exactly the eligible ones at or above the threshold, plus the most confident eligible one
    expected = eligible & (values >= np.float32(threshold))
    if eligible.any():
        expected[reference_order(values, eligible)[0]] = True
    np.testing.assert_array_equal(commit, expected)


@given(candidates(), st.integers(-3, 15))
def test_count_commit_commits_exactly_count_eligible(case, count):
    values, eligible = case
    commit = np.asarray(count_fn(jnp.asarray(values), jnp.asarray(eligible), jnp.int32(count)))
    assert not (commit & ~eligible).any()
    assert commit.sum() == min(max(count, 0), eligible.sum())
    # the committed ones are the first in the documented order
    chosen = reference_order(values, eligible)[: commit.sum()]
    assert set(np.flatnonzero(commit)) == set(chosen)


def test_the_examples_of_issue_20():
    all_nan = jnp.full(3, jnp.nan)
    eligible = jnp.array([True, True, False])
    np.testing.assert_array_equal(
        threshold_commit(jnp.array([jnp.nan, jnp.nan, 0.5]), eligible, 0.9), [True, False, False]
    )
    np.testing.assert_array_equal(threshold_commit(all_nan, eligible, jnp.nan), [True, False, False])
    # an eligible -inf against an ineligible +inf: the eligible one commits
    np.testing.assert_array_equal(
        threshold_commit(jnp.array([jnp.inf, -jnp.inf]), jnp.array([False, True]), 0.9), [False, True]
    )
    np.testing.assert_array_equal(count_commit(all_nan, jnp.array([False, True, True]), 2), [False, True, True])


def test_the_rules_batch_under_vmap():
    values = jnp.array([[jnp.nan, 0.2, 0.3], [0.1, -jnp.inf, jnp.nan]])
    eligible = jnp.array([[True, False, True], [False, True, True]])
    commit = jax.vmap(threshold_commit, in_axes=(0, 0, None))(values, eligible, 0.99)
    np.testing.assert_array_equal(commit, [[False, False, True], [False, True, False]])
