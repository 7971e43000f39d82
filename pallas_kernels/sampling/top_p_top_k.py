"""Per-row top-p / top-k cutoffs of candidate logits, computed only for the rows that ask.

Dream's sampler filters the logits a sampler at temperature T sees (``logits / T``): top_p
keeps the smallest prefix of the descending order whose probability reaches top_p, top_k the
k largest (ties kept); both together keep the smaller set. Dividing by T > 0 keeps the order,
so the kept entries are exactly those whose logit is >= one logit per row, the row's
*cutoff*, and the filter is ``apply_cutoff(logits, cutoff)``, elementwise. (Two different
logits that round to the same scaled value are tied in Dream's code, not here: with bfloat16
logits that needs a temperature near float32's limits.) The cutoff is an unscaled logit so
that no division in another program can round the boundary entry away.

Finding the cutoff is the costly part: the reference sorts the whole vocabulary of every row.
In the decode loop only some slots ask for it, and skipping the sort with a ``lax.cond`` costs
a device-to-host read of the predicate and a stream sync at every step on XLA:GPU (where the
loop's step is a few milliseconds). The kernel instead runs one program per row that returns
at once when the row does not ask (cutoff -inf: keep everything), and otherwise finds the
cutoff without a sort: after a max/min pass and a softmax-denominator pass, a bisection over
the 32-bit ordered keys of the logits, each round one pass over the row that counts the
entries >= the top-k candidate and sums the probability of the entries >= the top-p
candidate. 32 rounds find both cutoffs exactly (the largest logit whose count reaches k, the
largest whose upper mass exceeds top_p); the probabilities add up in another order than the
reference's cumulative sum, which matters only when top_p lies within float32 rounding of a
prefix's mass.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    check_float,
    check_launch,
    check_power_of_two,
    check_shape,
    compiler_params,
    next_power_of_two,
)

# What Dream's filters write into removed entries (torch.finfo(float32).min): finite, so a
# Gumbel-perturbed argmax and a softmax stay well defined.
REMOVED = float(jnp.finfo(jnp.float32).min)
# The smallest temperature the scaling divides by (temperature 0 filters softmax(logits)).
MIN_TEMPERATURE = 1e-6


@dataclasses.dataclass(frozen=True)
class CutoffBlockSizes:
    """block_v vocabulary entries per load (a power of two), Triton launch parameters."""

    block_v: int = 4096
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        check_power_of_two("block_v", self.block_v, 16)
        check_launch(self.num_warps, self.num_stages)


def default_cutoff_block_sizes(vocab: int) -> CutoffBlockSizes:
    return CutoffBlockSizes(block_v=min(4096, max(16, next_power_of_two(vocab))))


def filter_scale(temperature: jax.Array) -> jax.Array:
    """The divisor of the logits a filter sees: T (at least MIN_TEMPERATURE), 1 at T = 0."""
    return jnp.where(temperature > 0, jnp.maximum(temperature, MIN_TEMPERATURE), 1.0)


def apply_cutoff(logits: jax.Array, cutoff: jax.Array) -> jax.Array:
    """logits [N, V] with every entry below its row's cutoff (float32 [N]; -inf keeps the
    row) set to REMOVED. Returns float32 [N, V]."""
    logits = logits.astype(jnp.float32)
    return jnp.where(logits >= cutoff[:, None], logits, REMOVED)


def _check(logits, temperature, top_p, top_k, wants):
    check_float("logits", logits)
    if logits.ndim != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: expected [N, V]")
    n = logits.shape[0]
    kinds = {
        "temperature": (temperature, jnp.floating, "floating"),
        "top_p": (top_p, jnp.floating, "floating"),
        "top_k": (top_k, jnp.integer, "integer"),
        "wants": (wants, jnp.bool_, "bool"),
    }
    for name, (x, kind, expected) in kinds.items():
        check_shape(name, x, (n,))
        if not jnp.issubdtype(x.dtype, kind):
            raise ValueError(f"{name}.dtype={x.dtype}: expected {expected}")


@functools.partial(jax.jit, static_argnames=("interpret", "block_sizes"))
def top_p_top_k_cutoff_reference(logits, temperature, top_p, top_k, wants, *, interpret=False, block_sizes=None):
    """Pure jnp (a sort per row): the same cutoffs as ``top_p_top_k_cutoff``."""
    del interpret, block_sizes
    _check(logits, temperature, top_p, top_k, wants)
    V = logits.shape[-1]
    ordered = -jnp.sort(-logits.astype(jnp.float32), axis=-1)  # descending
    scaled = ordered / filter_scale(temperature)[:, None]
    cumulative = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)
    # Dream removes sorted entry j >= 1 when cumulative[j - 1] > top_p
    kept_p = 1 + jnp.sum(cumulative[:, :-1] <= top_p[:, None], axis=-1)
    kept_k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kept = jnp.minimum(jnp.where(top_p < 1.0, kept_p, V), kept_k)
    cutoff = jnp.take_along_axis(ordered, (kept - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(wants & ((top_p < 1.0) | (top_k > 0)), cutoff, -jnp.inf)


def _key(x):
    """int32 keys ordered as the float32 values (-0.0 just below 0.0)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _value(key):
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def _midpoint(lo, hi):
    """floor((lo + hi) / 2) without int32 overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _cutoff_kernel(logits_ref, temperature_ref, top_p_ref, top_k_ref, wants_ref, out_ref, *, vocab, blocks):
    """Refs: logits [N, V], temperature, top_p f32 [N], top_k, wants int32 [N]; out f32 [N].
    One program per row."""
    row = pl.program_id(0)
    wants = wants_ref[row] != 0
    out_ref[row] = -jnp.inf * jnp.ones((), jnp.float32)  # (a bare -inf literal does not lower to Triton)

    # a row that does not ask skips everything (an scf.if inside the program: no host sync);
    # the loops have static trip counts (the Triton lowering rejects an scf.for whose bounds
    # mix a constant with a run-time int32)
    @pl.when(wants)
    def _():
        _cutoff_row(logits_ref, temperature_ref, top_p_ref, top_k_ref, out_ref, row, vocab=vocab, blocks=blocks)


def _cutoff_row(logits_ref, temperature_ref, top_p_ref, top_k_ref, out_ref, row, *, vocab, blocks):
    """The cutoff of one row that asks, written to out_ref[row]."""
    bv = blocks.block_v
    n_blocks = -(-vocab // bv)
    rounds = 32

    scale = filter_scale(temperature_ref[row])
    top_p, top_k = top_p_ref[row], top_k_ref[row]

    def load(b):
        cols = b * bv + jnp.arange(bv, dtype=jnp.int32)
        valid = cols < vocab
        x = plgpu.load(logits_ref.at[row, pl.ds(b * bv, bv)], mask=valid, other=0)
        return x.astype(jnp.float32), valid

    def extremes(b, carry):
        hi, lo = carry
        x, valid = load(b)
        return (
            jnp.maximum(hi, jnp.max(jnp.where(valid, x, -jnp.inf))),
            jnp.minimum(lo, jnp.min(jnp.where(valid, x, jnp.inf))),
        )

    top, bottom = lax.fori_loop(0, n_blocks, extremes, (jnp.float32(-jnp.inf), jnp.float32(jnp.inf)))

    def denominator(b, total):
        x, valid = load(b)
        return total + jnp.sum(jnp.where(valid, jnp.exp((x - top) / scale), 0.0))

    total = lax.fori_loop(0, n_blocks, denominator, jnp.float32(0.0))
    kept_k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    mass_bound = top_p * total

    def bisect(_, bounds):
        k_lo, k_hi, p_lo, p_hi = bounds
        k_mid, p_mid = _midpoint(k_lo, k_hi), _midpoint(p_lo, p_hi)
        k_cut, p_cut = _value(k_mid), _value(p_mid)

        def count(b, acc):
            n, mass = acc
            x, valid = load(b)
            n += jnp.sum(jnp.where(valid & (x >= k_cut), 1, 0))
            mass += jnp.sum(jnp.where(valid & (x >= p_cut), jnp.exp((x - top) / scale), 0.0))
            return n, mass

        n, mass = lax.fori_loop(0, n_blocks, count, (jnp.int32(0), jnp.float32(0.0)))
        k_ok, p_ok = n >= kept_k, mass > mass_bound
        return (
            jnp.where(k_ok, k_mid, k_lo),
            jnp.where(k_ok, k_hi, k_mid),
            jnp.where(p_ok, p_mid, p_lo),
            jnp.where(p_ok, p_hi, p_mid),
        )

    # the answers lie in [key(bottom), key(top)]: lo always satisfies its test (or is the
    # keep-everything answer), hi never does
    lo, hi = _key(bottom), _key(top) + 1
    k_lo, _, p_lo, _ = lax.fori_loop(0, rounds, bisect, (lo, hi, lo, hi))
    cut_k = jnp.where(top_k > 0, _value(k_lo), -jnp.inf)
    cut_p = jnp.where(top_p < 1.0, _value(p_lo), -jnp.inf)
    out_ref[row] = jnp.maximum(cut_k, cut_p)


@functools.partial(jax.jit, static_argnames=("interpret", "block_sizes"))
def top_p_top_k_cutoff(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    wants: jax.Array,
    *,
    interpret: bool = False,
    block_sizes: CutoffBlockSizes | None = None,
) -> jax.Array:
    """Each row's cutoff for ``apply_cutoff``: Dream's top_p_logits then top_k_logits on
    softmax(logits / T) (softmax(logits) at T = 0).

    logits: [N, V] float; temperature, top_p (1 = off): float32 [N]; top_k: int32 [N] (0 =
    off); wants: bool [N], rows that ask (the others cost one program that returns at once).
    Returns float32 [N]: the smallest kept logit of a row that asks, -inf for the others
    (and for rows with top_p = 1 and top_k = 0).
    """
    _check(logits, temperature, top_p, top_k, wants)
    n, vocab = logits.shape
    blocks = block_sizes or default_cutoff_block_sizes(vocab)
    kernel = functools.partial(_cutoff_kernel, vocab=vocab, blocks=blocks)
    return pl.pallas_call(
        kernel,
        grid=(n,),
        out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="top_p_top_k_cutoff",
    )(
        logits,
        temperature.astype(jnp.float32),
        top_p.astype(jnp.float32),
        top_k.astype(jnp.int32),
        wants.astype(jnp.int32),
    )
