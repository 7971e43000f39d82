"""The top-p/top-k cutoff kernel: interpret mode against the sort-based reference (fresh random
rows, ties, rows that do not ask, ragged vocabularies, NaN rows), the kept sets against
Dream's rule, and its CUDA lowering at LLaDA's vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from test_samplers import dream_filter

from pallas_kernels.sampling.top_p_top_k import (
    REMOVED,
    CutoffBlockSizes,
    apply_cutoff,
    top_p_top_k_cutoff,
    top_p_top_k_cutoff_reference,
)

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]


def _rows(seed: int, n: int, vocab: int, dtype):
    rng = np.random.RandomState(seed)
    logits = rng.randn(n, vocab).astype(np.float32) * 3
    logits[: n // 3] = np.round(logits[: n // 3])  # many ties
    temperature = rng.choice([0.0, 0.7, 1.5], n).astype(np.float32)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.05, 1e-6], n).astype(np.float32)
    top_k = rng.choice([0, 1, 7, 10**6], n).astype(np.int32)
    wants = rng.rand(n) < 0.75
    return (
        jnp.asarray(logits, dtype),
        jnp.asarray(temperature),
        jnp.asarray(top_p),
        jnp.asarray(top_k),
        jnp.asarray(wants),
    )


@pytest.mark.parametrize(
    "vocab,dtype,blocks",
    [
        (300, jnp.float32, CutoffBlockSizes(block_v=64)),
        (256, jnp.bfloat16, None),
        (37, jnp.float32, CutoffBlockSizes(block_v=16)),
    ],
)
def test_kernel_cutoffs_equal_the_reference(vocab, dtype, blocks):
    args = _rows(vocab, 24, vocab, dtype)
    got = np.asarray(top_p_top_k_cutoff(*args, interpret=True, block_sizes=blocks))
    want = np.asarray(top_p_top_k_cutoff_reference(*args))
    np.testing.assert_array_equal(got, want)
    wants = np.asarray(args[-1])
    assert np.all(got[~wants] == -np.inf), "rows that do not ask keep everything"
    assert np.all(np.isfinite(got[wants & ((np.asarray(args[2]) < 1) | (np.asarray(args[3]) > 0))]))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_kernels_kept_sets_are_dreams(temperature):
    rng = np.random.RandomState(5)
    logits = (rng.randn(8, 120) * 2).astype(np.float32)
    for top_p, top_k in [(0.9, 0), (0.3, 5), (1.0, 3), (1e-6, 0)]:
        n = logits.shape[0]
        cutoff = top_p_top_k_cutoff(
            jnp.asarray(logits),
            jnp.full((n,), temperature),
            jnp.full((n,), top_p),
            jnp.full((n,), top_k, jnp.int32),
            jnp.ones((n,), bool),
            interpret=True,
            block_sizes=CutoffBlockSizes(block_v=32),
        )
        out = np.asarray(apply_cutoff(jnp.asarray(logits), cutoff))
        keep = dream_filter(logits, temperature, top_p, top_k)
        np.testing.assert_array_equal(out > REMOVED, keep)
        np.testing.assert_array_equal(out[keep], logits[keep])


def test_a_non_finite_row_ends_and_leaves_the_others_alone():
    logits, temperature, top_p, top_k, _ = _rows(1, 4, 50, jnp.float32)
    logits = logits.at[1, 3].set(jnp.nan).at[2].set(jnp.inf)
    wants = jnp.ones((4,), bool)
    got = np.asarray(
        top_p_top_k_cutoff(
            logits, temperature, top_p, top_k, wants, interpret=True, block_sizes=CutoffBlockSizes(block_v=16)
        )
    )
    want = np.asarray(top_p_top_k_cutoff_reference(logits, temperature, top_p, top_k, wants))
    np.testing.assert_array_equal(got[[0, 3]], want[[0, 3]])


def test_bad_arguments_are_named():
    x = jnp.zeros((2, 8))
    f, i, b = jnp.zeros((2,)), jnp.zeros((2,), jnp.int32), jnp.zeros((2,), bool)
    with pytest.raises(ValueError, match=r"top_k.dtype=float32: expected integer"):
        top_p_top_k_cutoff(x, f, f, f, b, interpret=True)
    with pytest.raises(ValueError, match=r"wants.shape=\(3,\): expected \(2,\)"):
        top_p_top_k_cutoff(x, f, f, i, jnp.zeros((3,), bool), interpret=True)
    with pytest.raises(ValueError, match="block_v=48: expected a power of two"):
        CutoffBlockSizes(block_v=48)


def test_lowers_for_cuda_at_llada_vocabulary():
    n, vocab = 32 * 16, 126464
    spec = jax.ShapeDtypeStruct
    text = lower_for_cuda(
        top_p_top_k_cutoff,
        spec((n, vocab), jnp.bfloat16),
        spec((n,), jnp.float32),
        spec((n,), jnp.float32),
        spec((n,), jnp.int32),
        spec((n,), jnp.bool_),
    )
    assert "top_p_top_k_cutoff" in text
