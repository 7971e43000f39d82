"""DiffusionGemma's denoising statistics of a canvas's logits in two passes over the vocabulary.

The denoising step (dllm_jax.policies.canvas, dllm_jax.policies.entropy_bound) reads the
decoder's logits as the LM head rounds them (the model dtype, [R, V] for R canvas rows) and
needs, of the processed logits p = cap * tanh(logits / cap) / T (the soft-cap, then the step's
temperature T per row):
  argmax   int32 [R], the first index of the largest p (ties to the lowest index);
  entropy  float32 [R], the entropy of softmax(p);
  sample   int32 [R], the inverse-CDF draw from softmax(p) at one uniform per row
           (pallas_kernels.sampling.inverse_cdf.sample: never a token without probability);
  finite   bool [R], every soft-capped logit of the row is finite;
  probs    [R, V] in the model dtype, softmax(float32(p rounded to the model dtype)) rounded to
           the model dtype: the self-conditioning input of the next step (times the embedding
           table, dllm_jax.models.diffusion_gemma.embed_probabilities).
XLA makes these in about seven passes over [R, V] (at the 26B-A4B shape V = 262144: 256 MiB
of float32 per slot each); the kernel reads the logits twice and writes probs once:

  pass 1 (``_stats_kernel``): per (row, split) program over its contiguous share of the
    vocabulary in chunks of block_v: the max of p and its first index, whether any capped
    logit is not finite, and an online sum of exp(round(p) - round(max)) (the probs'
    denominator, rescaled whenever the running max grows);
  combine (jnp, [R, splits]): the row's max, argmax and denominator;
  pass 2 (``_probs_kernel``): the same chunks again, with the row's max m known exactly:
    w = exp(p - m) summed per block of the inverse-CDF search (``block_size(V)`` tokens, as the
    reference's), sum(w * (p - m)) for the entropy, and probs written;
  finish (jnp): entropy = log(s) - sum(w (p - m)) / s with s the sum of the block sums, and the
    draw from the block sums (``sample_from_blocks``), whose chosen block's weights are
    recomputed from the logits (one block of block_size(V) tokens per row; XLA's exp is not
    Triton's, so the target left within the block is scaled by their sum over the block's).

Numerics: the same float32 operations per element as the reference (``canvas_sampler_reference``,
today's XLA path built from the same functions), sums in another order, so entropy, the block
sums and the denominator differ by float32 rounding; argmax is the same wherever p is (on a GPU
Triton's tanh and XLA's may differ in the last bits); a draw can differ only where its uniform
falls within rounding of a token boundary; probs can differ by one unit in the last place of
the model dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    NUM_SMS,
    cdiv,
    check_float,
    check_launch,
    check_power_of_two,
    check_shape,
    compiler_params,
    next_power_of_two,
)
from pallas_kernels.sampling.inverse_cdf import block_size, sample, sample_from_blocks, soft_cap, token_entropy


class CanvasSample(NamedTuple):
    """The denoising statistics of R rows of logits (see the module doc)."""

    argmax: jax.Array  # int32 [R]
    entropy: jax.Array  # float32 [R]
    sample: jax.Array  # int32 [R]
    finite: jax.Array  # bool [R]
    probs: jax.Array  # [R, V], the logits' dtype


@dataclasses.dataclass(frozen=True)
class SamplerBlockSizes:
    """block_v: vocabulary entries per load (a power of two, at least the inverse-CDF block);
    num_splits: programs per row, each over a contiguous share of the chunks of block_v (it
    must divide their number); Triton launch parameters."""

    block_v: int = 4096
    num_splits: int = 1
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        check_power_of_two("block_v", self.block_v, 16)
        if not isinstance(self.num_splits, int) or self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits!r}: expected an int >= 1")
        check_launch(self.num_warps, self.num_stages)


def default_sampler_block_sizes(rows: int, vocab: int) -> SamplerBlockSizes:
    """Chunks of up to 4096 entries (at least one inverse-CDF block); each row split over
    programs (halving its chunks while they divide) until the grid has about two programs per SM."""
    block_v = max(block_size(vocab), min(4096, next_power_of_two(vocab)))
    chunks = cdiv(vocab, block_v)
    splits = 1
    while rows * splits < 2 * NUM_SMS and chunks % (2 * splits) == 0:
        splits *= 2
    return SamplerBlockSizes(block_v=block_v, num_splits=splits)


def _check(logits: jax.Array, temperature: jax.Array, uniform: jax.Array, softcap: float) -> None:
    check_float("logits", logits)
    if logits.ndim != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: expected [R, V]")
    rows = logits.shape[0]
    for name, x in (("temperature", temperature), ("uniform", uniform)):
        check_shape(name, x, (rows,))
        check_float(name, x)
    if not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"softcap={softcap!r}: expected a number > 0")


def _rounded(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """float32 x rounded to dtype (to nearest, ties to even), back in float32.

    bfloat16 by its bits: XLA may drop an ``astype`` round trip (its excess-precision
    simplification, which here runs the kernel's body in interpret mode, and some fusions of it
    but not others: a chunk of 4096 lost it, one of 1024 kept it), integer operations it keeps.
    In: 33.679806 (0x4206B818). Out: 33.75 (0x42070000).
    """
    if dtype == jnp.float32:
        return x
    if dtype == jnp.bfloat16:
        bits = lax.bitcast_convert_type(x, jnp.int32)
        # add half a unit of bfloat16 (less one, plus the kept last bit: ties to even), truncate
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & jnp.int32(-65536)
        return lax.bitcast_convert_type(bits, jnp.float32)
    return x.astype(dtype).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("softcap", "interpret", "block_sizes"))
def canvas_sampler_reference(
    logits: jax.Array,
    temperature: jax.Array,
    uniform: jax.Array,
    *,
    softcap: float,
    interpret: bool = False,
    block_sizes: SamplerBlockSizes | None = None,
) -> CanvasSample:
    """Pure jnp, today's XLA path: the same statistics as ``canvas_sampler``."""
    del interpret, block_sizes
    _check(logits, temperature, uniform, softcap)
    capped = soft_cap(logits, softcap)
    processed = capped / temperature.astype(jnp.float32)[:, None]
    probs = jax.nn.softmax(processed.astype(logits.dtype).astype(jnp.float32), axis=-1).astype(logits.dtype)
    return CanvasSample(
        argmax=jnp.argmax(processed, axis=-1).astype(jnp.int32),
        entropy=token_entropy(processed),
        sample=sample(processed, uniform),
        finite=jnp.all(jnp.isfinite(capped), axis=-1),
        probs=probs,
    )


def _load_processed(logits_ref, temperature, row, start, *, vocab: int, softcap: float, block_v: int):
    """One chunk of a row: the soft-capped logits float32 [block_v], the processed ones (-inf
    past the vocabulary) and the in-vocabulary mask."""
    valid = start + jnp.arange(block_v, dtype=jnp.int32) < vocab
    x = plgpu.load(logits_ref.at[row, pl.ds(start, block_v)], mask=valid, other=0)
    capped = soft_cap(x, softcap)
    return capped, jnp.where(valid, capped / temperature, -jnp.inf), valid


def _stats_kernel(
    logits_ref, temperature_ref, top_ref, index_ref, total_ref, bad_ref, *, vocab, softcap, blocks, chunks
):
    """Pass 1 of program (row, split). Refs: logits [R, V], temperature float32 [R]; out, flat
    [R * S] at row * S + split: top (the max of p) and total (sum of exp(round(p) -
    round(top))) float32, index (top's first index) and bad (non-finite capped logits) int32."""
    row, split = pl.program_id(0), pl.program_id(1)
    bv, dtype = blocks.block_v, logits_ref.dtype
    temperature = temperature_ref[row]
    first = split * chunks * bv

    def body(c, carry):
        top, index, total, bad = carry
        start = first + c * bv
        capped, p, valid = _load_processed(
            logits_ref, temperature, row, start, vocab=vocab, softcap=softcap, block_v=bv
        )
        bad += jnp.sum(jnp.where(valid & ~jnp.isfinite(capped), 1, 0))
        chunk_top = jnp.max(p)
        # strictly greater: an earlier chunk keeps a tie (the lowest index, as jnp.argmax)
        index = jnp.where(chunk_top > top, start + jnp.argmax(p).astype(jnp.int32), index)
        new_top = jnp.maximum(top, chunk_top)
        # the running denominator, rescaled to the new max (exp(-inf) = 0 at the first chunk)
        new_top16 = _rounded(new_top, dtype)
        scale = jnp.exp(_rounded(top, dtype) - new_top16)
        total = total * scale + jnp.sum(jnp.exp(_rounded(p, dtype) - new_top16))
        return new_top, index, total, bad

    init = (jnp.float32(-jnp.inf), jnp.int32(0), jnp.float32(0.0), jnp.int32(0))
    top, index, total, bad = lax.fori_loop(0, chunks, body, init)
    at = row * blocks.num_splits + split
    top_ref[at] = top
    index_ref[at] = index
    total_ref[at] = total
    bad_ref[at] = bad


def _probs_kernel(
    logits_ref,
    temperature_ref,
    top_ref,
    total_ref,
    probs_ref,
    mass_ref,
    spread_ref,
    *,
    vocab,
    softcap,
    blocks,
    chunks,
    block,
):
    """Pass 2 of program (row, split). Refs: logits [R, V], temperature, top (the row's max of
    p), total (its probs' denominator) float32 [R]; out: probs [R, V] (the logits' dtype),
    mass float32 [R, V' / block] (each inverse-CDF block's sum of exp(p - top), V' = V rounded
    up to chunks), spread float32 [R * S] (sum of exp(p - top) * (p - top) at row * S + split)."""
    row, split = pl.program_id(0), pl.program_id(1)
    bv, dtype = blocks.block_v, logits_ref.dtype
    per_chunk = bv // block
    temperature, top, total = temperature_ref[row], top_ref[row], total_ref[row]
    top16 = _rounded(top, dtype)

    def body(c, spread):
        chunk = split * chunks + c
        start = chunk * bv
        _, p, valid = _load_processed(logits_ref, temperature, row, start, vocab=vocab, softcap=softcap, block_v=bv)
        # [block_v]: unnormalized probabilities, the largest 1 (0 past the vocabulary)
        weight = jnp.exp(p - top)
        mass_ref[row, pl.ds(chunk * per_chunk, per_chunk)] = jnp.sum(weight.reshape(per_chunk, block), axis=1)
        spread += jnp.sum(jnp.where(valid, weight * (p - top), 0.0))
        probs = jnp.exp(_rounded(p, dtype) - top16) / total
        plgpu.store(probs_ref.at[row, pl.ds(start, bv)], probs.astype(dtype), mask=valid)
        return spread

    spread_ref[row * blocks.num_splits + split] = lax.fori_loop(0, chunks, body, jnp.float32(0.0))


@functools.partial(jax.jit, static_argnames=("softcap", "interpret", "block_sizes"))
def canvas_sampler(
    logits: jax.Array,
    temperature: jax.Array,
    uniform: jax.Array,
    *,
    softcap: float,
    interpret: bool = False,
    block_sizes: SamplerBlockSizes | None = None,
) -> CanvasSample:
    """The denoising statistics of R rows of logits (see the module doc).

    Args:
      logits: [R, V] float (the LM head's output in the model dtype, before the soft-cap).
      temperature: float32 [R] (> 0), the step's temperature of each row.
      uniform: float32 [R] in [0, 1), each row's draw.
      softcap: the final-logit soft-cap (> 0).
    Returns:
      CanvasSample; a row whose ``finite`` is False has unspecified other values.
    """
    _check(logits, temperature, uniform, softcap)
    R, V = logits.shape
    dtype = logits.dtype
    block = block_size(V)
    blocks = block_sizes or default_sampler_block_sizes(R, V)
    S, bv = blocks.num_splits, blocks.block_v
    if bv < block:
        raise ValueError(f"block_v={bv}: expected at least the inverse-CDF block {block} of V={V}")
    n_chunks = cdiv(V, bv)
    if n_chunks % S:
        raise ValueError(f"num_splits={S}: expected a divisor of the {n_chunks} chunks of block_v={bv} in V={V}")
    chunks = n_chunks // S
    temperature = temperature.astype(jnp.float32)
    common = dict(vocab=V, softcap=float(softcap), blocks=blocks, chunks=chunks)
    launch = dict(
        grid=(R, S), compiler_params=compiler_params(blocks.num_warps, blocks.num_stages), interpret=interpret
    )

    flat = lambda dt: jax.ShapeDtypeStruct((R * S,), dt)  # noqa: E731
    parts = pl.pallas_call(
        functools.partial(_stats_kernel, **common),
        out_shape=(flat(jnp.float32), flat(jnp.int32), flat(jnp.float32), flat(jnp.int32)),
        name="canvas_sampler_stats",
        **launch,
    )(logits, temperature)
    # [R, S] each: the splits of a row combined
    top_parts, index_parts, total_parts, bad_parts = (x.reshape(R, S) for x in parts)
    best = jnp.argmax(top_parts, axis=1)
    top = jnp.max(top_parts, axis=1)
    argmax = jnp.take_along_axis(index_parts, best[:, None], axis=1)[:, 0]
    top16 = _rounded(top, dtype)
    total = (
        jnp.sum(total_parts * jnp.exp(_rounded(top_parts, dtype) - top16[:, None]), axis=1)
        if S > 1
        else total_parts[:, 0]
    )

    probs, mass, spread = pl.pallas_call(
        functools.partial(_probs_kernel, block=block, **common),
        out_shape=(
            jax.ShapeDtypeStruct((R, V), dtype),
            jax.ShapeDtypeStruct((R, n_chunks * bv // block), jnp.float32),
            flat(jnp.float32),
        ),
        name="canvas_sampler_probs",
        **launch,
    )(logits, temperature, top, total)
    # [R, NB]: the reference's blocks (those past V's last block hold nothing)
    mass = mass[:, : cdiv(V, block)]
    mass_sum = jnp.sum(mass, axis=1)
    entropy = jnp.log(mass_sum) - jnp.sum(spread.reshape(R, S), axis=1) / mass_sum

    def block_weights(chosen: jax.Array) -> jax.Array:
        # [R, block]: the chosen block's exp(p - top), recomputed as the kernel did
        cols = chosen[:, None] * block + jnp.arange(block, dtype=jnp.int32)
        x = jnp.take_along_axis(logits, jnp.minimum(cols, V - 1), axis=1)
        p = soft_cap(x, softcap) / temperature[:, None]
        return jnp.where(cols < V, jnp.exp(p - top[:, None]), 0.0)

    return CanvasSample(
        argmax=argmax,
        entropy=entropy,
        sample=sample_from_blocks(mass, uniform, block_weights, recomputed=True),
        finite=jnp.sum(bad_parts, axis=1) == 0,
        probs=probs,
    )
