"""Lowers a jitted function for CUDA on a CPU-only machine (Pallas -> Triton IR, no GPU).

This runs the real Triton lowering of every pallas_call with interpret=False, so an
operation the Triton backend rejects fails here. jax 0.11 needs an abstract GPU to pick the
compute capability; jax 0.10 lowers without one. ``lower_decode_loop_for_cuda`` lowers the
engine's whole decode loop at a real model's shapes, over abstract params.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.engine.engine import Engine
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import abstract_params, unstack_layers
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.kernel_routing import FP8_FUSED_QKV_ROWS, Kernels
from dllm_jax.runtime.slots import zero_sampling

# what backend="auto" picks on an NVIDIA GPU
GPU_AUTO = Kernels(attention=True, scatter=True, top_p_top_k=True, experts=True, canvas_sampler=True, head_norm=True)
# auto with the fp8 producers and, on Hopper, the fused FP8 q/k/v kernel (opt-in: they change
# only fp8 models' programs)
GPU_FP8_FUSED = dataclasses.replace(GPU_AUTO, fp8_producers=True, fp8_fused_qkv_rows=FP8_FUSED_QKV_ROWS)


def _abstract_h200():
    sharding = jax.sharding
    if not hasattr(sharding, "AbstractDevice") or not hasattr(sharding, "use_abstract_mesh"):
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return sharding.use_abstract_mesh(sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def lower_for_cuda(jitted_fn, *args, **kwargs) -> str:
    """StableHLO text of a jitted function lowered for CUDA; args may be jax.ShapeDtypeStruct."""
    with _abstract_h200():
        return jitted_fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


def lower_decode_loop_for_cuda(config: ModelConfig, backend: str) -> str:
    """StableHLO text of the engine's jitted decode loop (flash_cache + verify, 8 slots,
    gen_length 256) at config's shapes over abstract params, lowered for CUDA. backend is an
    Engine backend name or "gpu-auto" (GPU_AUTO, over per-layer params as on a GPU)."""
    if backend == "gpu-auto":
        engine = Engine(
            config, jax.eval_shape(unstack_layers, abstract_params(config)), backend=GPU_AUTO, full_pass_lanes=()
        )
    else:
        engine = Engine(config, abstract_params(config), backend=backend, full_pass_lanes=())
    decode = DecodeConfig(method="flash_cache", gen_length=256, batch_size=8, verify=True)
    loop = engine.decode_loop(decode, 256)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    state = jax.eval_shape(loop.init_state, i32(32, 256), i32(32), jax.eval_shape(lambda: zero_sampling((32,))), i32())
    return lower_for_cuda(
        jax.jit(loop.run, donate_argnums=1), engine.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_)
    )
