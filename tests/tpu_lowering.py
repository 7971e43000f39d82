"""Lowers a jitted function for TPU on a CPU-only machine (Pallas -> Mosaic, no TPU).

Runs the real Pallas TPU lowering of every pallas_call (interpret=False), so an operation or
block shape it rejects fails here. The lowering reads the target chip from the abstract mesh's
device (jax 0.10 and 0.11: ``tpu_info.get_device_kind``); without one it would ask the default
device, the CPU. Mosaic's layout passes run later, in the TPU compiler, and are not covered.
"""

from __future__ import annotations

import jax

TPU_KIND = "TPU v5 lite"  # v5e


def lower_for_tpu(jitted_fn, *args, **kwargs) -> str:
    """StableHLO text of a jitted function lowered for TPU; args may be jax.ShapeDtypeStruct."""
    sharding = jax.sharding
    device = sharding.AbstractDevice(device_kind=TPU_KIND, num_cores=1, platform="tpu")
    with sharding.use_abstract_mesh(sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jitted_fn.trace(*args, **kwargs).lower(lowering_platforms=("tpu",)).as_text()
