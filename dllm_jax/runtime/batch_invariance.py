"""Batch-invariant decoding: a slot's rows computed the same whatever the other slots hold.

What the mode changes in every model pass (dllm_jax.runtime.cached_forward, when
``Kernels.invariant`` is set; the engine's ``batch_invariant=True``):
* every Linear (q/k/v, attention output, the MLP, the LM head) runs as
  ``pallas_kernels.matmul.invariant_matmul`` (Triton, NVIDIA GPUs) or its jnp reference (XLA's
  dot on fixed-shape row tiles, elsewhere): fixed tiles, fixed-order K loop, no split-K,
  so a row's result does not depend on the number of rows (slots x rows) of the GEMM;
* every RMSNorm runs as ``pallas_kernels.norm.invariant_rms_norm`` (Triton) or its jnp reference
  (the model's math on fixed-shape row tiles): XLA:GPU's row reduction follows the whole
  shape, and on the H200 a row's ff_norm differed in the last bf16 bit with the row count;
* the XLA path's attention runs one group at a time (``map_groups``) over key chunks of a
  fixed INVARIANT_BLOCK_K, so its batched dots and its online-softmax order see neither the
  number of groups nor max_len (the prompt-length bucket);
* the Pallas attention kernel runs without key splits (its split count otherwise grows
  when few groups leave SMs idle);
* the fused projection kernel (backend "pallas") is not used: its row tiling follows the
  row count.
Everything else (RoPE, elementwise ops, sampling, commits) is computed row by row or slot by
slot already, which the leak report checks on the GPU (every op's output is a tap). The debug taps (``LayerTaps``) capture a pass's intermediates per layer
to find where two runs' activations first differ (scripts/batch_invariance.py).

Run-to-run determinism (same inputs, same bits across processes) on a GPU also needs XLA's
deterministic ops, set before JAX starts its backend: ``deterministic_xla_flags``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.models.layers import Linear, RMSNorm
from pallas_kernels.matmul.invariant_matmul import MatmulBlockSizes, invariant_matmul, invariant_matmul_reference
from pallas_kernels.norm.invariant_rms_norm import RMSNormBlockSizes, invariant_rms_norm, invariant_rms_norm_reference

# The row tile of the jnp reference: a slot's 128 query rows of Flash-Cache's sparse step
# in one GEMM (the kernel's tiles are its own default).
REFERENCE_BLOCKS = MatmulBlockSizes(block_m=128)
REFERENCE_NORM_BLOCKS = RMSNormBlockSizes(block_m=128)

# Keys per chunk of the XLA path's attention in this mode (its default follows the number of
# groups and max_len).
INVARIANT_BLOCK_K = 128

# XLA flags for run-to-run determinism on GPUs (jax 0.10/0.11): deterministic scatter and
# reductions (no atomics) and no autotuning (whose timing-dependent choice of GEMM
# algorithm may differ between processes).
DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0")

# The order of a layer's taps in a pass (the first differing op is the first in this order).
LAYER_TAP_ORDER = (
    "attn_norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "q",
    "k",
    "v",
    "attention",
    "attention_scores",
    "attn_out",
    "ff_norm",
    "ff_proj",
    "up_proj",
    "ff_out",
    "residual",
)


def deterministic_xla_flags(environ: dict[str, str] | None = None) -> str:
    """XLA_FLAGS with DETERMINISTIC_XLA_FLAGS added (flags already set are kept). Put the
    result in os.environ["XLA_FLAGS"] before the first JAX computation."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in flags}
    return " ".join(flags + [f for f in DETERMINISTIC_XLA_FLAGS if f.split("=")[0] not in names])


def check_model(config) -> None:
    """Raises ValueError for a model the batch-invariant mode cannot run."""
    if config.quantization != "none":
        raise ValueError(f"batch_invariant=True runs {config.dtype} weights, not quantization={config.quantization!r}")
    if config.weight_tying:
        raise ValueError("batch_invariant=True does not support weight_tying (the tied LM head is not a Linear)")


def _matmul(kernels) -> Callable[..., jax.Array]:
    if kernels.matmul:
        return lambda x, w, out_dtype: invariant_matmul(x, w, out_dtype=out_dtype, interpret=kernels.interpret)
    return lambda x, w, out_dtype: invariant_matmul_reference(x, w, out_dtype=out_dtype, block_sizes=REFERENCE_BLOCKS)


def _rms_norm(kernels) -> Callable[..., jax.Array]:
    if kernels.matmul:
        return lambda x, w, eps: invariant_rms_norm(x, w, eps, interpret=kernels.interpret)
    return lambda x, w, eps: invariant_rms_norm_reference(x, w, eps, block_sizes=REFERENCE_NORM_BLOCKS)


@contextlib.contextmanager
def invariant_ops(kernels) -> Iterator[None]:
    """Within this context (at trace time) every model Linear computes x @ kernel with the
    batch-invariant matmul and every RMSNorm with the batch-invariant norm (the Pallas
    kernels when kernels.matmul, else their jnp references)."""
    matmul = _matmul(kernels)
    rms_norm = _rms_norm(kernels)

    def linear(module, x, out_dtype):
        if module.quantization != "none":
            raise ValueError(f"batch_invariant=True: {module.name} holds {module.quantization} weights")
        out_dtype = module.dtype if out_dtype is None else out_dtype
        kernel = module.get_variable("params", "kernel")
        y = matmul(x.astype(module.dtype).reshape(-1, x.shape[-1]), kernel, jnp.dtype(out_dtype))
        return y.reshape(*x.shape[:-1], kernel.shape[1])

    def norm(module, x):
        y = rms_norm(x.reshape(-1, x.shape[-1]), module.get_variable("params", "weight"), float(module.eps))
        return y.reshape(x.shape)

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if isinstance(module, Linear):
            return linear(module, args[0], args[1] if len(args) > 1 else kwargs.get("out_dtype"))
        if isinstance(module, RMSNorm):
            return norm(module, args[0] if args else kwargs["x"])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(intercept):
        yield


def map_groups(fn: Callable[..., Any], *args: Any) -> Any:
    """fn applied to one group at a time: each arg (a pytree of arrays with a leading group
    axis S, or None) is cut into S slices with a leading axis of 1; the outputs (leading
    axis 1) are stacked back to S. The groups run in sequence (lax.map)."""

    def one(xs):
        out = fn(*jax.tree_util.tree_map(lambda a: a[None], xs))
        return jax.tree_util.tree_map(lambda a: a[0], out)

    return jax.lax.map(one, args)


class LayerTaps:
    """Collects one layer's intermediates while the layer is traced (debug passes only).

    ``recording()`` records the output of every named Linear and RMSNorm the block calls
    (q_proj ... ff_out, attn_norm, ff_norm); ``put`` adds the others (q, k, v after RoPE,
    attention, the residual). ``values`` holds them by name.
    """

    def __init__(self):
        self.values: dict[str, jax.Array] = {}

    def put(self, name: str, value: jax.Array | None) -> None:
        if value is not None:
            self.values[name] = value

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        def intercept(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            module = context.module
            if isinstance(module, (Linear, RMSNorm)) and context.method_name == "__call__" and module.name:
                self.values[module.name] = out
            return out

        with nn.intercept_methods(intercept):
            yield
