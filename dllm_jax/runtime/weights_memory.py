"""Whether a model's weights fit here, known from its config before anything is allocated.

A config.json of a million layers would otherwise allocate for a minute and end in an
out-of-memory traceback; its size is known from the shapes alone (dllm_jax.models.checkpoint's
tensor table). Two memories are checked:
  host    reading a Hugging Face folder builds the whole weights tree in host memory, in the
          target dtype, and moving it to the device needs about one more leaf
          (BENCHMARKS.md: peak = weights + the largest leaf); the converter needs the same.
  device  the weights as loaded (8-bit where quantized), split over the mesh's tensor axis
          (routed experts: over its expert and tensor axes).
On the CPU the two are one memory, counted once. $DLLM_MEMORY_AVAILABLE replaces what each
memory reports (dllm_jax.common.memory_override), as it does for the decode loop's check.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax

from dllm_jax.common.memory_override import MEMORY_ENV, memory_override
from dllm_jax.models.checkpoint.tensor_names import leaf_shape, rules_for
from dllm_jax.models.config import ModelConfig
from dllm_jax.runtime.memory_estimate import DeviceMemory, InsufficientMemoryError, device_memory, host_memory


def host_bytes_to_read(config: ModelConfig) -> int:
    """Host bytes the streaming reader needs for ``config`` (weights in config.dtype, before any
    quantization, plus the largest leaf)."""
    sizes = [math.prod(leaf_shape(rule, config)) for rule in rules_for(config)]
    return (sum(sizes) + max(sizes)) * config.jnp_dtype.itemsize


def available_host_memory(probe: Callable[[], DeviceMemory] = host_memory) -> DeviceMemory:
    """The host's available memory (what ``probe`` reports), or $DLLM_MEMORY_AVAILABLE when it is set."""
    override = memory_override()
    return DeviceMemory(available=override, name=f"${MEMORY_ENV}") if override is not None else probe()


def check_weights_fit(
    config: ModelConfig, *, source: str, read_on_host: bool, tensor: int = 1, expert: int = 1
) -> None:
    """Raises InsufficientMemoryError, one line naming ``source``, when the weights of
    ``config`` (its dtype and quantization) cannot be loaded here.

    read_on_host: the weights are built in host memory first (a Hugging Face folder), not
    restored to the device one leaf at a time (a converted folder).
    tensor, expert: the mesh's axis sizes (the device holds 1/tensor of the weights, and
    1/(tensor x expert) of the routed experts).
    """
    advice = "use --dtype bfloat16 or 8-bit weights (--quantization), or a smaller model"
    on_cpu = jax.default_backend() == "cpu"
    if read_on_host or on_cpu:
        needed = host_bytes_to_read(config) if read_on_host else weight_bytes(config)
        memory = available_host_memory()
        if needed > memory.available:
            raise InsufficientMemoryError(
                f"{source}: loading the weights in {config.dtype} needs about {_size(needed)} of host memory, "
                f"{memory.name} has {_size(memory.available)} available: {advice}"
            )
    if on_cpu:
        return
    experts = expert_bytes(config)
    needed = (weight_bytes(config) - experts) // tensor + experts // (tensor * expert)
    memory = device_memory()
    if needed > memory.available:
        raise InsufficientMemoryError(
            f"{source}: the weights in {config.dtype} need about {_size(needed)} per device, {memory.name} has "
            f"{_size(memory.available)} free: {advice}, or spread them over more devices (--mesh tensor=N)"
        )


def weight_bytes(config: ModelConfig) -> int:
    """The loaded weights' bytes, any family (ModelConfig.weight_bytes; for the others, the
    tensor table's shapes in config.dtype)."""
    if hasattr(config, "weight_bytes"):
        return config.weight_bytes()
    return sum(math.prod(leaf_shape(rule, config)) for rule in rules_for(config)) * config.jnp_dtype.itemsize


def expert_bytes(config: ModelConfig) -> int:
    """The routed experts' share of weight_bytes (0 for a model without them), from the tensor
    table's shapes in config.dtype."""
    experts = [rule for rule in rules_for(config) if "experts" in rule.path]
    return sum(math.prod(leaf_shape(rule, config)) for rule in experts) * config.jnp_dtype.itemsize


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 // 10 else f"{n / 2**20:.1f} MiB"
