"""8-bit weights: FP8 (W8A8) and int8 weight-only block projections, an int8 embedding, a
load-time choice.

The transformer blocks' seven projections are quantized (q/k/v, attention output, the two
SwiGLU input projections and its output), and the embedding table is stored in int8 in both
modes; the LM head, the norms, attention and RoPE keep the model dtype. A quantized projection
stores, instead of ``kernel`` [in, out]:

  qkernel  [out, in]  float8_e4m3fn ("fp8") or int8 ("int8-weights"), one row per output
  scale    [out]      float32: w[:, j] ~= qkernel[j, :] * scale[j]   (per output channel)

[out, in] is the layout the FP8 tensor-core GEMM reads (both operands K-major), so XLA needs
no transpose of the weights at run time. The matmuls:

  fp8            activations quantized per row at run time (x ~= xq * xs, xs = max|x| / 448),
                 here or, handed over as QuantizedRows, by the kernel that produced them
                 (layers.Fp8Producers); one float8 x float8 dot_general (float32 accumulation,
                 the product rounded to the output dtype), then * xs * scale.
  int8-weights   activations stay in the model dtype; the int8 weights are converted to it
                 inside the GEMM, float32 accumulation, then * scale: XLA's dot on the
                 converted weights (on the H200 slower than bf16: BENCHMARKS.md). Two
                 kernels read each weight byte once and dequantize it in registers: the
                 Mosaic GPU one (pallas_kernels.matmul.weight_only_matmul: wgmma with the
                 weights as the register operand; "auto" runs it on Hopper GPUs for the row
                 counts where it measured faster than XLA's, WEIGHT_ONLY_MAX_ROWS) and the
                 older Triton one (pallas_kernels.matmul.int8_matmul, opt-in, int8_gemm="pallas": on
                 the H200 1.45-2.0x the bf16 GEMM's time).

DiffusionGemma (dllm_jax.models.diffusion_gemma) quantizes, in every layer, its attention
projections (q/k/v, o_proj) and dense MLP (gate/up/down) the same way, and its routed experts'
two weight stacks, which are already [E, out, in] per layer, in place:

  experts/{gate_up_proj, down_proj}  {"qkernel": [E, out, in] 8-bit, "scale": [E, out] float32}
                                     (per expert and output channel)

Their grouped GEMMs (quantized_ragged_dot) keep jax.lax.ragged_dot_general: fp8 quantizes the
gathered rows per row and runs it on float8 operands, int8-weights converts the weights to the
rows' dtype inside it; the product is scaled by each row's expert's channel scales. On NVIDIA
GPUs the same products run as the Pallas grouped GEMM (dllm_jax.models.experts, grouped_gemm). Its
router, self-conditioning MLP and embedding (tied to its LM head) stay in the model dtype.

The embedding (``wte``) stores, instead of ``embedding`` [V, D]:

  qembedding  [V, D]  int8, whatever the mode (a lookup is a gather, not a GEMM: no FP8 to gain)
  scale       [V]     float32: embedding[t] ~= qembedding[t] * scale[t]   (per row, per token)

Only the gathered rows are dequantized (embedding_rows). A family whose LM head is the
embedding (weight_tying) keeps the table in the model dtype, as the head is. At LLaDA-8B's
shape this stores the weights in 8.54 GB instead of 9.06 GB (bf16: 16.03 GB).

On a CPU, XLA emulates the 8-bit dots by converting to float32 (same numbers, not faster).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.common import platform
from dllm_jax.models.checkpoint.dtypes import QUANTIZATIONS, quantizes_embedding
from dllm_jax.models.diffusion_gemma_config import STACKS

QUANTIZED_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
# DiffusionGemma's, per layer of its stacks: projections by their path in the layer's tree, and
# the experts' weight stacks (under "experts")
DIFFUSION_GEMMA_PROJECTIONS: tuple[tuple[str, ...], ...] = (
    ("q_proj",),
    ("k_proj",),
    ("v_proj",),  # sliding layers only (full layers take v from k_proj)
    ("o_proj",),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)
DIFFUSION_GEMMA_EXPERTS: tuple[str, ...] = ("gate_up_proj", "down_proj")
# rows [M, K] (ragged along M, sorted by group) times weights [G, N, K]: contract K with K
GROUPED_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)

_FP8 = jnp.float8_e4m3fn
_FP8_MAX = float(jnp.finfo(_FP8).max)  # 448
_INT8_MAX = 127.0

# int8_gemm choices of quantized_matmul: "auto" = the Mosaic GPU weight-only kernel on a Hopper
# GPU whose JAX builds it, for bf16 activations of at most WEIGHT_ONLY_MAX_ROWS rows, else the
# Triton kernel on an NVIDIA GPU for at most INT8_KERNEL_MAX_ROWS rows, else XLA; "xla";
# "mosaic" (the Mosaic GPU kernel); "pallas" (the Triton kernel); "interpret" = the Triton
# kernel in interpret mode (CPU tests). INT8_KERNEL_MAX_ROWS is 0 because the Triton kernel's
# default tiling ran slower than XLA's int8 fusion at 128, 1024 and 4096 rows on the H200
# (scripts/bench_gemm.py, BENCHMARKS.md). WEIGHT_ONLY_MAX_ROWS = 128 (one slot's sparse step):
# there the Mosaic kernel made the int8-weights 1-slot flash_cache step 7.20 ms against 8.66
# through XLA (bf16: 6.96-7.00), H200, scripts/gpu/one_request.py; the 640-row full pass of
# the same slot took 46.0 ms through it against 34.1 through XLA (which converts the weights
# and calls cuBLAS at that size), so larger row counts stay with XLA until measured better.
INT8_GEMMS: tuple[str, ...] = ("auto", "xla", "mosaic", "pallas", "interpret")
INT8_KERNEL_MAX_ROWS = 0
WEIGHT_ONLY_MAX_ROWS = 128


def weight_dtype(mode: str) -> Any:
    """The storage dtype of a quantized kernel."""
    return {"fp8": _FP8, "int8-weights": jnp.int8}[mode]


def quantize_kernel(kernel: Any, mode: str) -> dict[str, Any]:
    """kernel [..., in, out] (any float dtype, numpy or jax) -> {"qkernel": [..., out, in], "scale": [..., out]}.

    Per-output-channel symmetric scales (max |w| of the channel maps to the format's largest
    value); an all-zero channel gets scale 1. A stack ([NL, in, out]) is converted one matrix
    at a time (_per_matrix).
    """
    return _per_matrix(lambda w: _quantize_channels(w.swapaxes(-1, -2), mode), kernel)


def quantize_experts(weights: Any, mode: str) -> dict[str, Any]:
    """Expert weights [..., E, out, in] (torch's Linear layout per expert; numpy or jax) ->
    {"qkernel": [..., E, out, in], "scale": [..., E, out]}: quantize_kernel's rule per expert
    and output channel, one expert's matrix at a time."""
    return _per_matrix(lambda w: _quantize_channels(w, mode), weights)


def _per_matrix(quantize: Any, w: Any) -> dict[str, Any]:
    """quantize (one 2-D matrix -> a dict of arrays) over every matrix of w [..., a, b], the
    results stacked on w's leading axes: one matrix's float32 copy at a time (a numpy stack is
    filled into outputs allocated once; a jax one goes through lax.map)."""
    if w.ndim <= 2:
        return quantize(w)
    if not isinstance(w, np.ndarray):
        return jax.lax.map(lambda one: _per_matrix(quantize, one), w)
    first = _per_matrix(quantize, w[0])
    out = {key: np.empty((w.shape[0], *value.shape), value.dtype) for key, value in first.items()}
    for i in range(w.shape[0]):
        for key, value in (first if i == 0 else _per_matrix(quantize, w[i])).items():
            out[key][i] = value
    return out


def _quantize_channels(w: Any, mode: str) -> dict[str, Any]:
    """w [out, in] -> {"qkernel": [out, in] 8-bit, "scale": float32 [out]} (quantize_kernel's rule)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w = xp.asarray(w, dtype=np.float32)
    amax = xp.max(xp.abs(w), axis=-1)
    limit = _FP8_MAX if mode == "fp8" else _INT8_MAX
    # Written as multiplications by float32 reciprocals, the form XLA rewrites a division by a
    # broadcast into, so that numpy (the converter) and jax (load-time) store the same numbers.
    scale = xp.where(amax > 0, amax * np.float32(1.0 / limit), np.float32(1.0)).astype(np.float32)
    scaled = w * (np.float32(1.0) / scale)[..., None]
    if mode == "fp8":
        q = scaled.astype(_FP8)
    elif mode == "int8-weights":
        q = xp.clip(xp.round(scaled), -_INT8_MAX, _INT8_MAX).astype(np.int8)
    else:
        raise ValueError(f"quantization={mode!r}: expected one of {QUANTIZATIONS[1:]}")
    return {"qkernel": q, "scale": scale}


def dequantize_kernel(leaf: dict[str, Any]) -> jax.Array:
    """The float32 [..., in, out] kernel a quantized leaf stands for (tests, error reports)."""
    w = leaf["qkernel"].astype(jnp.float32) * leaf["scale"][..., None]
    return jnp.swapaxes(w, -1, -2)


# rows of a host (numpy) table quantized at a time: a 4096-row float32 copy of LLaDA-8B's
# table is 64 MB, the whole one 2 GB
_HOST_EMBEDDING_ROWS = 4096


def quantize_embedding(table: Any) -> dict[str, Any]:
    """table [V, D] (any float dtype, numpy or jax) -> {"qembedding": int8 [V, D], "scale": float32 [V]}.

    Per-row symmetric int8 (max |row| maps to 127; an all-zero row gets scale 1): the rule of
    quantize_kernel("int8-weights") with the rows as output channels, so the host and device
    paths store the same numbers. A numpy table is converted a block of rows at a time.
    """
    if isinstance(table, np.ndarray):
        blocks = [
            quantize_kernel(table[i : i + _HOST_EMBEDDING_ROWS].T, "int8-weights")
            for i in range(0, table.shape[0], _HOST_EMBEDDING_ROWS)
        ]
        q = {key: np.concatenate([block[key] for block in blocks]) for key in ("qkernel", "scale")}
    else:
        q = quantize_kernel(table.T, "int8-weights")
    return {"qembedding": q["qkernel"], "scale": q["scale"]}


def dequantize_embedding(leaf: dict[str, Any]) -> jax.Array:
    """The float32 [V, D] table a quantized embedding stands for (tests, error reports)."""
    return leaf["qembedding"].astype(jnp.float32) * leaf["scale"][:, None]


def embedding_rows(qembedding: jax.Array, scale: jax.Array, tokens: jax.Array, dtype: Any) -> jax.Array:
    """The rows of int tokens [...] in a quantized table -> [..., D] in dtype.

    Gathers the int8 rows and their scales, then dequantizes only those (float32 product,
    rounded once to dtype); the [V, D] table is never converted.
    """
    rows = jnp.take(qembedding, tokens, axis=0).astype(jnp.float32)
    return (rows * jnp.take(scale, tokens, axis=0)[..., None]).astype(dtype)


def quantize_params(params: Any, mode: str) -> Any:
    """The params tree with every block projection quantized (LLaDA and Dream's "layers";
    DiffusionGemma's stacks: DIFFUSION_GEMMA_PROJECTIONS and DIFFUSION_GEMMA_EXPERTS), and the
    embedding unless the tree has no lm_head (a tied head: quantizes_embedding); a no-op for "none".

    Works on layer-stacked ([NL, in, out]) and per-layer (a tuple of trees) params, and on
    numpy or jax leaves; one projection is converted at a time.
    """
    if mode == "none":
        return params
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization={mode!r}: expected one of {QUANTIZATIONS}")

    def projection(sub: dict[str, Any]) -> dict[str, Any]:
        # a projection's other leaves (Dream's q/k/v biases) stay as they are
        return {**{k: v for k, v in sub.items() if k != "kernel"}, **quantize_kernel(sub["kernel"], mode)}

    def block(tree: dict[str, Any]) -> dict[str, Any]:
        return {
            name: projection(sub) if name in QUANTIZED_MODULES and "kernel" in sub else sub
            for name, sub in tree.items()
        }

    def diffusion_gemma_layer(tree: dict[str, Any]) -> dict[str, Any]:
        tree = {**tree, "mlp": dict(tree["mlp"])}
        for path in DIFFUSION_GEMMA_PROJECTIONS:
            parent = tree if len(path) == 1 else tree[path[0]]
            if path[-1] in parent:
                parent[path[-1]] = projection(parent[path[-1]])
        experts = tree["experts"]
        tree["experts"] = {
            name: quantize_experts(w, mode) if name in DIFFUSION_GEMMA_EXPERTS else w for name, w in experts.items()
        }
        return tree

    def each_layer(layers: Any, quantize: Any) -> Any:
        return tuple(quantize(lp) for lp in layers) if isinstance(layers, (list, tuple)) else quantize(layers)

    quantized = dict(params)
    if "layers" in params:
        quantized["layers"] = each_layer(params["layers"], block)
    for stack in STACKS.values():
        if stack in params:
            quantized[stack] = each_layer(params[stack], diffusion_gemma_layer)
    if quantizes_embedding(mode, weight_tying="lm_head" not in params) and "embedding" in params.get("wte", {}):
        quantized["wte"] = quantize_embedding(params["wte"]["embedding"])
    return quantized


def fp8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (e4m3 rows [..., K], float32 scales [..., 1]): each row scaled so that its
    largest |value| is e4m3's 448 (an all-zero row: scale 1)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / _FP8_MAX, 1.0)
    return (x32 / x_scale).astype(_FP8), x_scale


def _fp8_product_dtype(out_dtype: Any) -> Any:
    # the GEMM writes out_dtype when that is narrower than float32 (its float32 accumulator
    # rounded once; XLA can fuse the scaling into the consumer): half the product's bytes,
    # which at 32 slots are 200 MB per [4096, 12288] float32 product
    return jnp.float32 if jnp.dtype(out_dtype).itemsize >= 4 else out_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """Activation rows quantized per row for the FP8 GEMMs: x ~= rows * scale[..., None].

    rows: float8_e4m3fn [..., W]; scale: float32 [...]. What an fp8 block's producers hand
    the projections that read their output (layers.Fp8Producers), so the rows are quantized
    once, by the producer, instead of by quantized_matmul before every GEMM.
    """

    rows: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rows.shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnscaledProduct:
    """An FP8 GEMM's product before its scales: x @ w ~= product * row_scale[..., None] * col_scale.

    product: [..., out] (the float32 accumulator rounded to its dtype); row_scale: float32 [...]
    (the activation rows'); col_scale: float32 [out] (the weights'). For a consumer that
    applies the scales itself (layers.Fp8Producers.swiglu), so the scaled product is never
    written out.
    """

    product: jax.Array
    row_scale: jax.Array
    col_scale: jax.Array


def unscaled_product(x: QuantizedRows, qkernel: jax.Array, scale: jax.Array, out_dtype: Any) -> UnscaledProduct:
    """x [..., in] @ the float8 kernel [out, in], without the scales: quantized_matmul's FP8
    GEMM, its product in out_dtype (float32 accumulation)."""
    if qkernel.dtype != _FP8:
        raise ValueError(f"an unscaled product needs float8_e4m3fn weights, not {qkernel.dtype}")
    return UnscaledProduct(_fp8_dot(x.rows, qkernel, out_dtype), x.scale, scale)


def _fp8_dot(xq: jax.Array, qkernel: jax.Array, out_dtype: Any) -> jax.Array:
    """float8 rows [..., in] . float8 kernel [out, in] -> [..., out], float32 accumulation
    (written in _fp8_product_dtype(out_dtype))."""
    contract = (((xq.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(xq, qkernel, contract, preferred_element_type=_fp8_product_dtype(out_dtype))


def quantized_matmul(
    x: jax.Array | QuantizedRows, qkernel: jax.Array, scale: jax.Array, out_dtype: Any, *, int8_gemm: str = "auto"
) -> jax.Array:
    """x [..., in] @ the quantized kernel -> [..., out] in out_dtype (accumulated in float32).

    The mode follows from qkernel's dtype: float8_e4m3fn = W8A8, int8 = weight-only (int8_gemm
    picks its GEMM: INT8_GEMMS). With fp8 weights x is quantized per row here, unless it comes
    quantized already (QuantizedRows: then the FP8 GEMM reads its rows as they are).
    """
    if qkernel.dtype == _FP8:
        xq, x_scale = (x.rows, x.scale[..., None]) if isinstance(x, QuantizedRows) else fp8_rows(x)
        y = _fp8_dot(xq, qkernel, out_dtype)
        return (y.astype(jnp.float32) * (x_scale * scale)).astype(out_dtype)
    if isinstance(x, QuantizedRows):
        raise ValueError(f"quantized rows go with float8_e4m3fn weights, not {qkernel.dtype}")
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    gemm = _int8_gemm(int8_gemm, x, qkernel, out_dtype)
    lead, (n, k) = x.shape[:-1], qkernel.shape
    if gemm == "mosaic":
        from pallas_kernels.matmul.weight_only_matmul import weight_only_matmul

        return weight_only_matmul(x.reshape(-1, k), qkernel, scale, out_dtype=jnp.dtype(out_dtype)).reshape(*lead, n)
    if gemm == "triton":
        from pallas_kernels.matmul.int8_matmul import int8_weight_matmul

        y = int8_weight_matmul(
            x.reshape(-1, k), qkernel, scale, out_dtype=jnp.dtype(out_dtype), interpret=int8_gemm == "interpret"
        )
        return y.reshape(*lead, n)
    y = jax.lax.dot_general(x, qkernel.astype(x.dtype), contract, preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype)


def quantized_ragged_dot(
    x: jax.Array,
    qweights: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    row_groups: jax.Array,
    out_dtype: Any,
) -> jax.Array:
    """Grouped GEMM over quantized weights: rows x [M, in], sorted by group (group_sizes int32
    [G] rows each), times their group's weights -> [M, out] in out_dtype (float32 accumulation).

    qweights: [G, out, in] 8-bit (quantize_experts); scale: float32 [G, out]; row_groups: int32
    [M], each row's group (whose channel scales its product takes). One
    jax.lax.ragged_dot_general (GROUPED_ROWS) as the unquantized experts run it: on e4m3 rows
    (quantized per row, as quantized_matmul's W8A8) and weights for fp8, on the weights converted
    to x's dtype for int8-weights; the product times the row's and its group's scales.
    """
    if qweights.dtype == _FP8:
        xq, x_scale = fp8_rows(x)
        y = jax.lax.ragged_dot_general(
            xq, qweights, group_sizes, GROUPED_ROWS, preferred_element_type=_fp8_product_dtype(out_dtype)
        )
        return (y.astype(jnp.float32) * (x_scale * scale[row_groups])).astype(out_dtype)
    y = jax.lax.ragged_dot_general(
        x, qweights.astype(x.dtype), group_sizes, GROUPED_ROWS, preferred_element_type=jnp.float32
    )
    return (y * scale[row_groups]).astype(out_dtype)


def _int8_gemm(int8_gemm: str, x: jax.Array, qkernel: jax.Array, out_dtype: Any) -> str:
    """Which GEMM an int8 weight product runs: "mosaic", "triton" or "xla" (see INT8_GEMMS)."""
    if int8_gemm not in INT8_GEMMS:
        raise ValueError(f"int8_gemm={int8_gemm!r}: expected one of {INT8_GEMMS}")
    if int8_gemm == "xla":
        return "xla"
    from pallas_kernels.matmul import weight_only_matmul as mosaic
    from pallas_kernels.matmul.int8_matmul import supports

    rows = math.prod(x.shape[:-1])
    mosaic_fits = mosaic.supports(rows, *qkernel.shape, out_dtype=out_dtype) and x.dtype == jnp.bfloat16
    triton_fits = supports(rows, *qkernel.shape) and jnp.issubdtype(x.dtype, jnp.floating)
    if int8_gemm == "mosaic":
        if not mosaic_fits or not mosaic.available():
            raise ValueError(
                f"int8_gemm='mosaic': the kernel does not take x {x.shape} {x.dtype} @ qkernel {qkernel.shape} "
                f"with this JAX ({jax.__version__})"
            )
        return "mosaic"
    if int8_gemm != "auto":
        if not triton_fits:
            raise ValueError(f"int8_gemm={int8_gemm!r}: the kernel does not take x {x.shape} @ qkernel {qkernel.shape}")
        return "triton"
    if mosaic_fits and rows <= WEIGHT_ONLY_MAX_ROWS and mosaic.runs_here():
        return "mosaic"

    return "triton" if triton_fits and rows <= INT8_KERNEL_MAX_ROWS and platform.on_nvidia_gpu() else "xla"


def compiler_options(mode: str) -> dict[str, Any]:
    """XLA options for compiling a model stored with this quantization (Engine's default).

    On NVIDIA GPUs, for fp8 models (measured on the H200, BENCHMARKS.md):
    - XLA's Triton GEMM autotuner is off. With it, an fp8 decode loop compiled for 37 s at
      1 slot, 93 s at 8 and past 180 s at 32 (bf16: 12-15 s), and XLA chose cuBLASLt's FP8
      GEMMs all the same; without it 18-20 s.
    - XLA's DotMerger is off (threshold 0 MB). It merges dots that share an input when one of
      them is under 32 MB, concatenating their weights: 8-bit q/k/v weights fall under that
      where bf16 ones do not, and without a Triton GEMM to fuse the concatenation into, the
      concatenated weights were copied on every call (2.7 of 7.3 ms of device time per 1-slot
      step).
    int8-weights keeps the defaults (without Triton its GEMM would be a convert + cuBLAS GEMM).
    """

    if mode == "fp8" and platform.on_nvidia_gpu():
        return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
    return {}


def weight_bytes(params: Any) -> int:
    """Bytes of every leaf of a params tree (the weight-streaming floor's numerator)."""
    return sum(int(leaf.size) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(params))
