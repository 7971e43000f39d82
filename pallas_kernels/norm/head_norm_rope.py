"""Gemma's per-head RMSNorm followed by rotate-half RoPE, in one pass (Pallas, Triton backend).

DiffusionGemma norms q, k and v per head (q and k with a learned weight, v without) and rotates
q and k:

    y[n, h] = rope(round(x[n, h] * rsqrt(mean(x[n, h]^2) + eps) * weight), cos[n], sin[n])

with the normed rows rounded to x's dtype before the rotation (as the model writes it, and as
transformers' bf16 model computes it: the norm returns its dtype, RoPE computes in float32) and
the result rounded to x's dtype. XLA:GPU, allowed excess precision, keeps the normed rows in
float32 instead, so in bf16 its results and the kernel's differ by one rounding step in about a
third of the rotated elements (none in float32).

XLA runs this as three or four passes over the projection's output (the mean square, the normed
rows, the rotation's concatenation, at 512-wide heads a transpose): about 8 ms of a 32-slot
26B-A4B decoder step on an H100. A program here owns ``block_rows`` rows of all heads, reads
each half of every head once and writes the result once: 3.4 ms in that step, 1.3-1.6x XLA's
passes per tensor (BENCHMARKS.md, 2026-12-07), plus 1.7 ms of copies XLA now makes of the
slices of its merged projection GEMMs (DotMerger: k with v in sliding layers, q with k in full
ones), which its own fusions read in place.

Shapes: x [N, H, Dh] with H and Dh / 2 powers of two (``supports``); weight [Dh] or None (no
weight); cos, sin float32 [N, Dh / 2] or both None (no rotation): column i rotates the pair
(i, i + Dh / 2), so a partial rotation is cos 1 and sin 0 on the pairs it leaves.
``head_norm_rope_reference`` is the same function in jnp (the model's composition).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import RowBlockSizes, check_float, compiler_params, is_power_of_two, rows_within
from pallas_kernels.norm.rms_norm import rms_normalize
from pallas_kernels.projection.rope import apply_rope

# elements of x one program holds (block_rows x H x Dh) at most, by default, on 8 warps: 8
# float32 values per thread and half. On the H100 at 32 slots' rows (BENCHMARKS.md, 2026-12-07)
# the fastest of 1-16 rows x 4 / 8 warps for each of the 26B-A4B layer's four tensors.
ELEMENTS_PER_PROGRAM = 4096


def default_block_sizes(n_heads: int, head_dim: int) -> RowBlockSizes:
    """As many rows as keep a program at ELEMENTS_PER_PROGRAM elements, at least one (one row of
    16 heads of 256 or 512, two of 8 x 256, four of 2 x 512), on 8 warps."""
    return RowBlockSizes(block_rows=rows_within(n_heads * head_dim, ELEMENTS_PER_PROGRAM))


def supports(n_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes [N, n_heads, head_dim] (Triton's blocks: powers of two)."""
    return is_power_of_two(n_heads) and head_dim % 2 == 0 and is_power_of_two(head_dim // 2)


def _check(x, weight, cos, sin) -> None:
    check_float("x", x)
    if x.ndim != 3 or x.shape[-1] % 2:
        raise ValueError(f"x.shape={x.shape}: expected [N, H, Dh] with an even Dh")
    n, _, dh = x.shape
    if weight is not None and weight.shape != (dh,):
        raise ValueError(f"weight.shape={weight.shape}: expected ({dh},)")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin: give both (a rotation) or neither")
    for name, t in (("cos", cos), ("sin", sin)):
        if t is not None and (t.shape != (n, dh // 2) or t.dtype != jnp.float32):
            raise ValueError(f"{name} {t.shape} {t.dtype}: expected float32 ({n}, {dh // 2})")


def _kernel(x_ref, *refs, block_rows: int, half: int, eps: float, scaled: bool, rotated: bool):
    refs = list(refs)
    w_ref = refs.pop(0) if scaled else None
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if rotated else (None, None)
    (o_ref,) = refs
    rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
    halves = (pl.ds(0, half), pl.ds(half, half))
    x1, x2 = (x_ref[rows, :, cols].astype(jnp.float32) for cols in halves)  # [rows, H, half] each
    square_sum = jnp.sum(x1 * x1, axis=2) + jnp.sum(x2 * x2, axis=2)
    inv_rms = lax.rsqrt(square_sum / jnp.float32(2 * half) + jnp.float32(eps))[:, :, None]

    def normed(x, cols):
        """The normed half, rounded to x's dtype as the model's norm returns it."""
        y = x * inv_rms
        if w_ref is not None:
            y = y * w_ref[cols].astype(jnp.float32)[None, None, :]
        return y.astype(o_ref.dtype).astype(jnp.float32)

    n1, n2 = (normed(x, cols) for x, cols in zip((x1, x2), halves))
    if rotated:
        cos, sin = cos_ref[rows, :][:, None, :], sin_ref[rows, :][:, None, :]
        n1, n2 = n1 * cos - n2 * sin, n2 * cos + n1 * sin
    o_ref[rows, :, halves[0]] = n1.astype(o_ref.dtype)
    o_ref[rows, :, halves[1]] = n2.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_sizes"))
def head_norm_rope(
    x: jax.Array,
    weight: jax.Array | None,
    cos: jax.Array | None,
    sin: jax.Array | None,
    *,
    eps: float,
    interpret: bool = False,
    block_sizes: RowBlockSizes | None = None,
) -> jax.Array:
    """Per-head RMSNorm (times weight) of x [N, H, Dh], then RoPE by cos/sin -> [N, H, Dh] in x's dtype.

    Args:
      x: rows of heads, any float dtype; H and Dh / 2 powers of two (``supports``).
      weight: [Dh] (any float dtype), or None for a norm without weight.
      cos, sin: float32 [N, Dh / 2], or both None for no rotation.
      eps: the norm's epsilon; interpret: the Pallas interpreter (CPU tests).
    ValueError for shapes it does not take.
    """
    _check(x, weight, cos, sin)
    n, heads, dh = x.shape
    if not supports(heads, dh):
        raise ValueError(f"x.shape={x.shape}: H and Dh / 2 must be powers of two")
    blocks = block_sizes or default_block_sizes(heads, dh)
    block_rows = blocks.rows_for(n)
    inputs = [x]
    if weight is not None:
        inputs.append(weight)
    if cos is not None:
        inputs += [cos, sin]
    kernel = functools.partial(
        _kernel,
        block_rows=block_rows,
        half=dh // 2,
        eps=float(eps),
        scaled=weight is not None,
        rotated=cos is not None,
    )
    return pl.pallas_call(
        kernel,
        grid=(n // block_rows,),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="head_norm_rope",
    )(*inputs)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_sizes"))
def head_norm_rope_reference(x, weight, cos, sin, *, eps, interpret=False, block_sizes=None):
    """Pure jnp ``head_norm_rope``: the model's norm (float32 statistics, rounded to x's dtype),
    then apply_rope in float32, rounded to x's dtype."""
    del interpret, block_sizes
    _check(x, weight, cos, sin)
    normed = rms_normalize(x, eps, weight)
    if cos is None:
        return normed
    return apply_rope(normed, cos[:, None, :], sin[:, None, :]).astype(x.dtype)
