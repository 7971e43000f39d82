"""Which accelerator JAX runs on (read when asked, so tests can stand in for a GPU or TPU)."""

from __future__ import annotations

import jax


def on_nvidia_gpu() -> bool:
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and "nvidia" in device.device_kind.lower()


def on_tpu() -> bool:
    try:
        return jax.devices()[0].platform == "tpu"
    except RuntimeError:
        return False
