"""The end of a Gemma 4 mixture-of-experts block in one pass: the routed experts' weighted sum,
gathered from the down GEMM's expert-sorted rows, the block's three post-norms, the residual
add and the layer scalar.

Per token row t (every step rounded to the model dtype, as the model rounds it):

    routed = sum_k weights[t, k] * products[position[t, k]]     (float32, k in order; -1: none)
    out[t] = (h[t] + norm(norm(dense[t], w_dense) + norm(routed, w_routed), w_out)) * scale[t]

with norm Gemma's RMSNorm (float32 statistics: dllm_jax's rms_normalize). XLA runs this as two
passes (the gathered sum, 4.2 ms of a 32-slot 26B-A4B step on the H100, and one fusion of the
norms and the residual, 3.1 ms), writing the [T, D] sum between them and reading it back; here
each program reads its rows' k products, the dense MLP's output and the residual once and
writes the layer's output once.

Rounding: each op's result is rounded to the model dtype, as the model's ops round one by one
(and transformers' do); the k products are summed in order with fused multiply-adds. On the CPU
in bfloat16 this equals the reference run op by op bit for bit but where a norm's sum of squares
(per segment here) moves a result by one step (1 element in 20000 at D 2816), while XLA compiling
the reference skips some of the intermediate roundings (excess precision) and differs from both
in about 15% of the elements by one step.

Shapes: D a multiple of 16 (``supports``): a program holds its rows as power-of-two column
segments (2816 = 2048 + 512 + 256), so no load or store is masked and no lane is idle.
Pallas Triton: lowers on a CPU for CUDA and runs in interpret mode; moe_residual_reference is
the same function in jnp, and weighted_sum its first step (the experts' gathered sum,
dllm_jax.models.experts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import RowBlockSizes, check_float, check_shape, compiler_params, rows_within
from pallas_kernels.norm.rms_norm import rms_normalize

# elements of a row block one program holds per tensor, at most, by default: one 26B-A4B row
# (2816) on 4 warps, 22 float32 values per thread and tensor
ELEMENTS_PER_PROGRAM = 4096


def default_block_sizes(d: int) -> RowBlockSizes:
    """As many rows as keep a program at ELEMENTS_PER_PROGRAM elements per tensor, at least one, on 4 warps."""
    return RowBlockSizes(block_rows=rows_within(d, ELEMENTS_PER_PROGRAM), num_warps=4)


def supports(d: int) -> bool:
    """Whether the kernel takes rows of width d (power-of-two segments of at least 16)."""
    return d > 0 and d % 16 == 0


def _segments(d: int) -> list[pl.Slice]:
    """[0, d) as power-of-two column blocks, widest first: 2816 -> [0, 2048), [2048, 2560), [2560, 2816)."""
    blocks, start = [], 0
    for bit in reversed(range(d.bit_length())):
        if d >> bit & 1:
            blocks.append(pl.ds(start, 1 << bit))
            start += 1 << bit
    return blocks


def _check(h, dense, products, position, weights, w_dense, w_routed, w_out, scale) -> None:
    check_float("h", h)
    if h.ndim != 2:
        raise ValueError(f"h.shape={h.shape}: expected [T, D]")
    t, d = h.shape
    check_shape("dense", dense, (t, d))
    if products.ndim != 2 or products.shape[1] != d:
        raise ValueError(f"products.shape={products.shape}: expected [M, {d}]")
    if position.ndim != 2 or position.shape[0] != t or position.dtype != jnp.int32:
        raise ValueError(f"position {position.shape} {position.dtype}: expected int32 [{t}, K]")
    check_shape("weights", weights, position.shape)
    if weights.dtype != jnp.float32:
        raise ValueError(f"weights.dtype={weights.dtype}: expected float32")
    for name, w in (("w_dense", w_dense), ("w_routed", w_routed), ("w_out", w_out)):
        check_shape(name, w, (d,))
    check_shape("scale", scale, (t,))


def weighted_sum(products: jax.Array, position: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_k weights[t, k] * products[position[t, k]] -> float32 [T, D]; position -1 adds
    nothing (its row, never written, is masked rather than multiplied by 0: NaN * 0).

    products [M, D] (any float dtype), position int32 [T, K], weights float32 [T, K]."""
    t, k = position.shape
    # gathering the products (rather than scattering a float32 copy of them) lets XLA read
    # them once, inside the sum
    gathered = products[jnp.maximum(position, 0).reshape(-1)].reshape(t, k, -1).astype(jnp.float32)
    gathered = jnp.where((position >= 0)[:, :, None], gathered, 0.0)
    return jnp.sum(gathered * weights[:, :, None], axis=1)


def _round(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype).astype(jnp.float32)


def _kernel(
    position_ref,
    weights_ref,
    products_ref,
    dense_ref,
    h_ref,
    w_dense_ref,
    w_routed_ref,
    w_out_ref,
    scale_ref,
    o_ref,
    *,
    block_rows: int,
    eps: float,
):
    dt = o_ref.dtype
    rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
    d, k = o_ref.shape[1], position_ref.shape[1]
    segments = _segments(d)

    def normed(parts, w_ref):
        """rms_normalize of a row block held as column segments (float32 values of dt)."""
        square_sum = sum(jnp.sum(x * x, axis=1) for x in parts)
        inv_rms = lax.rsqrt(square_sum * jnp.float32(1 / d) + jnp.float32(eps))[:, None]
        return [_round(x * inv_rms * w_ref[s].astype(jnp.float32)[None, :], dt) for x, s in zip(parts, segments)]

    # [rows] each: the k assignments' sorted rows (clamped for the load) and weights
    positions = [position_ref[rows, j] for j in range(k)]
    weights = [weights_ref[rows, j] for j in range(k)]
    routed = []
    for s in segments:
        acc = jnp.zeros((block_rows, s.size), jnp.float32)
        for p, w in zip(positions, weights):
            y = jnp.where((p >= 0)[:, None], products_ref[jnp.maximum(p, 0), s].astype(jnp.float32), 0.0)
            acc = acc + y * w[:, None]
        routed.append(_round(acc, dt))
    dense = [dense_ref[rows, s].astype(jnp.float32) for s in segments]
    mixed = [_round(a + b, dt) for a, b in zip(normed(dense, w_dense_ref), normed(routed, w_routed_ref))]
    scale = scale_ref[rows].astype(jnp.float32)[:, None]
    for s, x in zip(segments, normed(mixed, w_out_ref)):
        residual = _round(h_ref[rows, s].astype(jnp.float32) + x, dt)
        o_ref[rows, s] = (residual * scale).astype(dt)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_sizes"))
def moe_residual(
    h: jax.Array,
    dense: jax.Array,
    products: jax.Array,
    position: jax.Array,
    weights: jax.Array,
    w_dense: jax.Array,
    w_routed: jax.Array,
    w_out: jax.Array,
    scale: jax.Array,
    *,
    eps: float,
    interpret: bool = False,
    block_sizes: RowBlockSizes | None = None,
) -> jax.Array:
    """The MoE block's output rows (see the module doc) -> [T, D] in h's dtype.

    Args:
      h: [T, D] the residual rows (any float dtype: the model's); D a multiple of 16.
      dense: [T, D] the dense MLP's output, before its post-norm.
      products: [M, D] the routed experts' outputs in expert order (the down GEMM's rows).
      position: int32 [T, K] each assignment's row of products, -1 for none (an expert of
        another device; its row may hold anything).
      weights: float32 [T, K] the routing weights.
      w_dense, w_routed, w_out: [D] the post-norms' weights: the dense MLP's, the experts', the
        block's.
      scale: [T] each row's layer scalar.
      eps: the norms' epsilon; interpret: the Pallas interpreter (CPU tests).
    ValueError for shapes it does not take.
    """
    _check(h, dense, products, position, weights, w_dense, w_routed, w_out, scale)
    t, d = h.shape
    if not supports(d):
        raise ValueError(f"h.shape={h.shape}: D must be a multiple of 16")
    blocks = block_sizes or default_block_sizes(d)
    block_rows = blocks.rows_for(t)
    return pl.pallas_call(
        functools.partial(_kernel, block_rows=block_rows, eps=float(eps)),
        grid=(t // block_rows,),
        out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="moe_residual",
    )(position, weights, products, dense, h, w_dense, w_routed, w_out, scale)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "block_sizes"))
def moe_residual_reference(
    h, dense, products, position, weights, w_dense, w_routed, w_out, scale, *, eps, interpret=False, block_sizes=None
):
    """Pure jnp ``moe_residual``: the model's ops as DiffusionGemmaLayer writes them."""
    del interpret, block_sizes
    _check(h, dense, products, position, weights, w_dense, w_routed, w_out, scale)
    routed = weighted_sum(products, position, weights).astype(h.dtype)
    mixed = rms_normalize(dense, eps, w_dense) + rms_normalize(routed, eps, w_routed)
    return (h + rms_normalize(mixed, eps, w_out)) * scale[:, None]
