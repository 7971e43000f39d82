"""Lowers a jitted function for TPU on a CPU-only machine (Pallas -> Mosaic, no TPU).

Runs the real Pallas TPU lowering of every pallas_call (interpret=False), so an operation or
block shape it rejects fails here. Wherever the lowering needs the chip (block-shape rules,
the generation), ``jax._src.pallas.mosaic.tpu_info.get_device_kind`` reads it from the abstract
mesh's AbstractDevice, in jax 0.10.2 (installed source) and 0.11 alike; without one it asks the
default device and raises "Unsupported TPU device kind: cpu" (0.11's message adds: wrap the
code in ``jax.sharding.use_abstract_mesh`` with the TPU version to target). Nothing else is
needed: no TPU plugin, no topology. Mosaic's layout passes (``needs_layout_passes``) run later,
in the TPU compiler, and are not covered.
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
