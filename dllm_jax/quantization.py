"""8-bit projection weights: FP8 (W8A8) and int8 weight-only, a load-time choice.

Only the transformer blocks' seven projections are quantized (q/k/v, attention output, the
two SwiGLU input projections and its output); the embedding, the LM head, the norms,
attention and RoPE keep the model dtype. A quantized projection stores, instead of
``kernel`` [in, out]:

  qkernel  [out, in]  float8_e4m3fn ("fp8") or int8 ("int8-weights"), one row per output
  scale    [out]      float32: w[:, j] ~= qkernel[j, :] * scale[j]   (per output channel)

[out, in] is the layout the FP8 tensor-core GEMM reads (both operands K-major), so XLA needs
no transpose of the weights at run time. The matmuls:

  fp8            activations quantized per row at run time (x ~= xq * xs, xs = max|x| / 448),
                 one float8 x float8 -> float32 dot_general, then * xs * scale.
  int8-weights   activations stay in the model dtype; the int8 weights are converted inside
                 the dot (XLA fuses the convert into the GEMM's operand read), then * scale.

On a CPU, XLA emulates the 8-bit dots by converting to float32 (same numbers, not faster).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.checkpoint.dtypes import QUANTIZATIONS

QUANTIZED_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")

_FP8 = jnp.float8_e4m3fn
_FP8_MAX = float(jnp.finfo(_FP8).max)  # 448
_INT8_MAX = 127.0


def weight_dtype(mode: str) -> Any:
    """The storage dtype of a quantized kernel."""
    return {"fp8": _FP8, "int8-weights": jnp.int8}[mode]


def quantize_kernel(kernel: Any, mode: str) -> dict[str, Any]:
    """kernel [..., in, out] (any float dtype, numpy or jax) -> {"qkernel": [..., out, in], "scale": [..., out]}.

    Per-output-channel symmetric scales (max |w| of the channel maps to the format's largest
    value); an all-zero channel gets scale 1.
    """
    xp = np if isinstance(kernel, np.ndarray) else jnp
    if xp is np and kernel.ndim == 3:  # a host layer stack: one layer's float32 copy at a time
        layers = [quantize_kernel(layer, mode) for layer in kernel]
        return {key: np.stack([layer[key] for layer in layers]) for key in ("qkernel", "scale")}
    w = xp.swapaxes(xp.asarray(kernel, dtype=np.float32), -1, -2)  # [..., out, in]
    amax = xp.max(xp.abs(w), axis=-1)
    limit = _FP8_MAX if mode == "fp8" else _INT8_MAX
    scale = xp.where(amax > 0, amax / limit, 1.0).astype(np.float32)
    scaled = w / scale[..., None]
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


def quantize_params(params: Any, mode: str) -> Any:
    """The params tree with every block projection quantized (a no-op for "none").

    Works on layer-stacked ([NL, in, out]) and per-layer (a tuple of trees) params, and on
    numpy or jax leaves; one projection is converted at a time.
    """
    if mode == "none":
        return params
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization={mode!r}: expected one of {QUANTIZATIONS}")

    def block(tree: dict[str, Any]) -> dict[str, Any]:
        # a projection's other leaves (Dream's q/k/v biases) stay as they are
        return {
            name: {**{k: v for k, v in sub.items() if k != "kernel"}, **quantize_kernel(sub["kernel"], mode)}
            if name in QUANTIZED_MODULES and "kernel" in sub else sub
            for name, sub in tree.items()
        }

    layers = params["layers"]
    layers = tuple(block(lp) for lp in layers) if isinstance(layers, (list, tuple)) else block(layers)
    return {**params, "layers": layers}


def quantized_matmul(x: jax.Array, qkernel: jax.Array, scale: jax.Array, out_dtype: Any) -> jax.Array:
    """x [..., in] @ the quantized kernel -> [..., out] in out_dtype (accumulated in float32).

    The mode follows from qkernel's dtype: float8_e4m3fn = W8A8, int8 = weight-only.
    """
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    if qkernel.dtype == _FP8:
        x32 = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
        x_scale = jnp.where(amax > 0, amax / _FP8_MAX, 1.0)
        xq = (x32 / x_scale).astype(_FP8)
        y = jax.lax.dot_general(xq, qkernel, contract, preferred_element_type=jnp.float32)
        return (y * (x_scale * scale)).astype(out_dtype)
    y = jax.lax.dot_general(x, qkernel.astype(x.dtype), contract, preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype)


def weight_bytes(params: Any) -> int:
    """Bytes of every leaf of a params tree (the weight-streaming floor's numerator)."""
    return sum(int(leaf.size) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(params))
