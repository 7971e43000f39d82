"""Lowers a jitted function for CUDA on a CPU-only machine (Pallas -> Triton IR, no GPU).

This runs the real Triton lowering of every pallas_call with interpret=False, so an
operation the Triton backend rejects fails here. jax 0.11 needs an abstract GPU to pick the
compute capability; jax 0.10 lowers without one.
"""

from __future__ import annotations

import contextlib

import jax


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
