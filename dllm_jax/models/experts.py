"""Routed experts (DiffusionGemma / Gemma 4): the router and the grouped expert MLPs.

Router (per token row x [D], the layer's pre-MLP residual): RMSNorm without a weight, times a
learned ``scale`` [D] and D^-0.5, projected to E expert scores; softmax in float32; the top k
probabilities, renormalised to sum to 1, each times the expert's learned ``per_expert_scale``.

Experts: expert e is a GELU-gated MLP, y = (gelu(x Wg_e) * (x Wu_e)) Wd_e, on the rows routed to
it; a row's output is the weighted sum of its k experts' outputs (accumulated in float32).
``grouped_expert_mlp`` computes this as two grouped GEMMs (``jax.lax.ragged_dot_general``,
ragged_dot with the weights' input axis last) over the rows sorted by expert;
``dense_expert_mlp`` is the plain reference that runs every expert on every row and masks.
``routed_products`` are the grouped GEMMs' per-assignment outputs over a contiguous block of
the experts (a device's share of them under a mesh, dllm_jax.runtime.expert_sharding) with
each assignment's row, and ``routed_sum`` their float32 weighted sum
(pallas_kernels.norm.moe_residual.weighted_sum; its kernel fuses that sum with the layer's
post-norms).

Which grouped GEMM (``grouped_gemm``, GROUPED_GEMMS): "xla", jax.lax.ragged_dot_general, which
CPUs and TPUs run well and XLA:GPU (jax 0.11.2) rewrites into a dense product of every row with
every expert; "pallas", pallas_kernels.matmul.grouped_matmul (a Triton grouped GEMM that reads
only the rows' own experts: the kernel routing's choice on NVIDIA GPUs,
dllm_jax.runtime.kernel_routing); "interpret", the same kernel in Pallas interpret mode (CPU
tests). Shapes the kernel does not tile (widths not multiples of 16) stay with "xla". The
kernel's gate/up product is grouped_matmul_gated, gelu(gate) * up in its epilogue, so the
[T * K, 2F] product is never written (XLA's path: the product, then an XLA pass over it).

Parameter layout (one layer), Hugging Face's ([out, in] per expert, as torch's Linear):
  experts/gate_up_proj  [E, 2F, D]   (rows [0, F) the gate, [F, 2F) the up projection)
  experts/down_proj     [E, D, F]
With 8-bit weights (dllm_jax.models.quantization.quantize_experts) each is
{"qkernel": [E, out, in] 8-bit, "scale": float32 [E, out]}, and the grouped GEMMs are
quantization.quantized_ragged_dot.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models.gemma_layers import gelu_tanh, rms_normalize
from dllm_jax.models.layers import INIT, Linear
from dllm_jax.models.quantization import GROUPED_ROWS, fp8_rows, quantized_ragged_dot, weight_dtype
from pallas_kernels.norm.moe_residual import weighted_sum

# An expert weight stack: [E, out, in] in the model dtype, or its 8-bit {"qkernel", "scale"}
ExpertWeights = Any
GROUPED_GEMMS: tuple[str, ...] = ("xla", "pallas", "interpret")


class Router(nn.Module):
    """Token rows [T, D] -> (top-k weights float32 [T, K], expert ids int32 [T, K])."""

    n_experts: int
    top_k: int
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,), self.dtype)
        per_expert_scale = self.param("per_expert_scale", nn.initializers.ones, (self.n_experts,), self.dtype)
        # in the model dtype, as transformers scales before the projection
        x = rms_normalize(x, self.eps) * scale.astype(x.dtype) * jnp.asarray(d**-0.5, x.dtype)
        scores = Linear(self.n_experts, self.dtype, name="proj")(x)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * per_expert_scale.astype(jnp.float32)[experts], experts.astype(jnp.int32)


# (x, weights, experts, gate_up, down) -> [T, D]: grouped_expert_mlp's signature and result
ExpertMLP = Callable[[jax.Array, jax.Array, jax.Array, ExpertWeights, ExpertWeights], jax.Array]


class Experts(nn.Module):
    """The expert weights of one layer (8-bit with quantization "fp8" or "int8-weights");
    applied as grouped GEMMs (expert_mlp, None: grouped_expert_mlp)."""

    n_experts: int
    d_model: int
    hidden: int
    dtype: Any
    quantization: str = "none"
    expert_mlp: ExpertMLP | None = None

    def setup(self):
        E, D, F = self.n_experts, self.d_model, self.hidden
        self.gate_up_proj = self._weights("gate_up_proj", (E, 2 * F, D))
        self.down_proj = self._weights("down_proj", (E, D, F))

    def _weights(self, name: str, shape: tuple[int, ...]) -> ExpertWeights:
        if self.quantization == "none":
            return self.param(name, INIT, shape, self.dtype)
        q = weight_dtype(self.quantization)
        # one param holding both leaves (quantize_experts' tree); init only gives the shapes
        return self.param(name, lambda _: {"qkernel": jnp.zeros(shape, q), "scale": jnp.ones(shape[:-1], jnp.float32)})

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """x [T, D], weights float32 [T, K], experts int32 [T, K] -> [T, D] (grouped_expert_mlp)."""
        expert_mlp = grouped_expert_mlp if self.expert_mlp is None else self.expert_mlp
        return expert_mlp(x, weights, experts, self.gate_up_proj, self.down_proj)


def grouped_expert_mlp(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    grouped_gemm: str = "xla",
) -> jax.Array:
    """The routed experts' output per row, as two grouped GEMMs.

    Args:
      x: [T, D] rows (already normed), in the model dtype.
      weights: float32 [T, K] routing weights; experts: int32 [T, K] expert ids.
      gate_up: [E, 2F, D]; down: [E, D, F] (or each 8-bit: see the module docstring).
      grouped_gemm: which grouped GEMM runs them (GROUPED_GEMMS).
    Returns:
      [T, D] in x's dtype: sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), summed in float32.
    """
    return routed_sum(x, weights, experts, gate_up, down, grouped_gemm=grouped_gemm).astype(x.dtype)


def expert_mlp_with(grouped_gemm: str) -> ExpertMLP | None:
    """grouped_expert_mlp running its GEMMs with `grouped_gemm` (None for "xla": the default)."""
    if grouped_gemm not in GROUPED_GEMMS:
        raise ValueError(f"grouped_gemm={grouped_gemm!r}: expected one of {GROUPED_GEMMS}")
    return None if grouped_gemm == "xla" else functools.partial(grouped_expert_mlp, grouped_gemm=grouped_gemm)


def routed_products(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    first_expert: int | jax.Array = 0,
    grouped_gemm: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """Each assignment's expert output, by the grouped GEMMs over the rows sorted by expert,
    for the E experts gate_up and down hold: those from ``first_expert`` on (all of them by
    default).

    Returns (products [T * K, D] in x's dtype, the expert outputs in expert order, rounded as
    transformers rounds them; position int32 [T, K], each assignment's row of products, -1 for
    an assignment to another block's expert). The other assignments are sorted last, in no
    group: the Pallas grouped GEMM skips them (no MMA, no store), so their rows hold anything.
    """
    T, K = experts.shape
    E = _shape(gate_up)[0]
    local = experts.reshape(T * K) - first_expert
    here = (local >= 0) & (local < E)
    # [T * K] the assignments sorted by local expert, those to other experts (key E) last and
    # in no group (stable: a row's k slots keep their order)
    key = jnp.where(here, local, E)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=E).astype(jnp.int32)
    # each sorted row's local expert (E, clamped by the scales' gather, for rows in no group)
    sorted_experts = key[order]
    gated, gemm = _gemms_for(grouped_gemm, T * K, gate_up, down)
    # [T * K, F] in x's dtype: gelu(gate) * up of the token rows in expert order (gathered by
    # the GEMM: order // K)
    hidden = gated(x, gate_up, group_sizes, sorted_experts, (order // K).astype(jnp.int32))
    products = gemm(hidden, down, group_sizes, sorted_experts).astype(x.dtype)
    position = jnp.zeros((T * K,), jnp.int32).at[order].set(jnp.arange(T * K, dtype=jnp.int32))
    return products, jnp.where(here, position, -1).reshape(T, K)


def routed_sum(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    first_expert: int | jax.Array = 0,
    grouped_gemm: str = "xla",
) -> jax.Array:
    """grouped_expert_mlp's sum before its rounding, over the experts gate_up and down hold
    (routed_products' block).

    Returns float32 [T, D]: sum over the rows' assignments to those experts of the routing
    weight times the expert's output (rounded to x's dtype, as transformers rounds it); the
    other assignments add nothing. Summed over disjoint blocks of experts, the blocks' sums
    are all experts' (exactly so for top-2 routing: each block adds a row's two terms, or one,
    or none, to zeros).
    """
    products, position = routed_products(x, weights, experts, gate_up, down, first_expert, grouped_gemm)
    return weighted_sum(products, position, weights)


def _shape(w: ExpertWeights) -> tuple[int, ...]:
    """The shape of a layer's expert weights, [E, out, in], plain or 8-bit."""
    return (w["qkernel"] if isinstance(w, Mapping) else w).shape


def num_experts(w: ExpertWeights) -> int:
    """How many experts the (plain or 8-bit) expert weights hold: their leading axis."""
    return _shape(w)[0]


def _by_expert(
    rows: jax.Array,
    w: ExpertWeights,
    group_sizes: jax.Array,
    row_experts: jax.Array,
    row_index: jax.Array | None = None,
) -> jax.Array:
    """rows [M, in] sorted by expert (group_sizes int32 [E]; row_experts int32 [M]), or
    rows[row_index] (row_index int32 [M]), times their expert's weights -> float32 [M, out]
    (jax.lax.ragged_dot_general)."""
    if row_index is not None:
        rows = rows[row_index]
    if isinstance(w, Mapping):  # flax hands a dict param over as a FrozenDict
        return quantized_ragged_dot(rows, w["qkernel"], w["scale"], group_sizes, row_experts, jnp.float32)
    return jax.lax.ragged_dot_general(rows, w, group_sizes, GROUPED_ROWS, preferred_element_type=jnp.float32)


def _gated_by_expert(
    rows: jax.Array,
    w: ExpertWeights,
    group_sizes: jax.Array,
    row_experts: jax.Array,
    row_index: jax.Array | None = None,
) -> jax.Array:
    """gelu(gate) * up [M, F] in rows' dtype of _by_expert's float32 [M, 2F] gate/up product,
    each half rounded to rows' dtype first (as transformers rounds its projections)."""
    gate_up_out = _by_expert(rows, w, group_sizes, row_experts, row_index)
    F = gate_up_out.shape[1] // 2
    return gelu_tanh(gate_up_out[:, :F].astype(rows.dtype)) * gate_up_out[:, F:].astype(rows.dtype)


def _gemms_for(grouped_gemm: str, m: int, gate_up: ExpertWeights, down: ExpertWeights) -> tuple[Callable, Callable]:
    """The grouped GEMMs (rows, w, group_sizes, row_experts, row_index=None) of M sorted rows:
    gate/up with the activation -> [M, F] in rows' dtype, and the plain one -> [M, out] (down):
    _gated_by_expert and _by_expert, or the Pallas kernels where they take both shapes
    (_by_expert_kernel, gated: the activation in the GEMM's epilogue)."""
    if grouped_gemm not in GROUPED_GEMMS:
        raise ValueError(f"grouped_gemm={grouped_gemm!r}: expected one of {GROUPED_GEMMS}")
    if grouped_gemm == "xla":
        return _gated_by_expert, _by_expert
    from pallas_kernels.matmul.grouped_matmul import supports, supports_gated

    (_, two_f, d), f = _shape(gate_up), _shape(down)[2]
    if not (supports_gated(m, two_f, d) and supports(m, d, f)):
        return _gated_by_expert, _by_expert
    kernel = functools.partial(_by_expert_kernel, interpret=grouped_gemm == "interpret")
    return functools.partial(kernel, gated=True), kernel


def _by_expert_kernel(
    rows: jax.Array,
    w: ExpertWeights,
    group_sizes: jax.Array,
    row_experts: jax.Array,
    row_index: jax.Array | None = None,
    *,
    interpret: bool,
    gated: bool = False,
) -> jax.Array:
    """_by_expert (gated: _gated_by_expert) through the Pallas grouped GEMM, with the same
    numbers: float32 accumulation, the product rounded once to rows' dtype (the callers' next
    step; float32 rows stay float32) instead of written in float32; 8-bit weights as
    quantized_ragged_dot runs them (fp8: the rows quantized per row, a float8 x float8 product
    times both scales; int8-weights: the weights converted to the rows' dtype, times their
    scales). Gated, gelu(gate) * up is the kernel's epilogue on those rounded halves, computed
    as XLA computes it on rows' dtype (grouped_matmul_gated: equal but for tanh's last bit).
    Rows in no group are left unwritten."""
    from pallas_kernels.matmul.grouped_matmul import grouped_matmul, grouped_matmul_gated

    del row_experts  # each tile knows its expert
    run = functools.partial(
        grouped_matmul_gated if gated else grouped_matmul,
        out_dtype=rows.dtype,
        fill_tail=False,
        interpret=interpret,
        row_index=row_index,
    )
    if not isinstance(w, Mapping):
        return run(rows, w, group_sizes)
    qkernel, scale = w["qkernel"], w["scale"]
    if qkernel.dtype == jnp.float8_e4m3fn:
        # per-row quantization: quantizing the rows before the gather is quantizing their copies
        xq, x_scale = fp8_rows(rows)
        x_scale = x_scale[:, 0] if row_index is None else x_scale[row_index, 0]
        return run(xq, qkernel, group_sizes, scale, x_scale)
    return run(rows, qkernel, group_sizes, scale)


def dense_expert_mlp(
    x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array, down: jax.Array
) -> jax.Array:
    """grouped_expert_mlp's reference, same signature: every expert on every row, one at a
    time, kept where the row routed to it."""
    E, F = gate_up.shape[0], down.shape[2]
    total = jnp.zeros(x.shape, jnp.float32)
    for e in range(E):
        gate_up_out = jnp.dot(x, gate_up[e].T, preferred_element_type=jnp.float32)
        hidden = gelu_tanh(gate_up_out[:, :F].astype(x.dtype)) * gate_up_out[:, F:].astype(x.dtype)
        out = jnp.dot(hidden, down[e].T, preferred_element_type=jnp.float32).astype(x.dtype)
        # [T] the row's weight for expert e (0 when not routed to it)
        weight = jnp.sum(jnp.where(experts == e, weights, 0.0), axis=-1)
        total = total + out.astype(jnp.float32) * weight[:, None]
    return total.astype(x.dtype)
