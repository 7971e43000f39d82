"""How much memory a decode configuration needs, and whether the device has it.

Checked before anything is allocated, so ``--batch-size 10000`` is a message that says what to
lower instead of an out-of-memory kill (exit 137, no message, possibly other processes too).

The estimate is per device and deliberately simple: the terms that grow with the batch and the
sequence, each counted as the decode loop materialises it:
  weights      the params' bytes (ModelConfig.weight_bytes: 8-bit where quantized; split over
               the tensor axis);
  cache        the flat K/V cache (dllm_jax.runtime.flat_cache.cache_bytes; split over data and tensor);
  activations  one layer of the largest full pass (layers run one at a time: inference keeps no
               layer's activations for later): ``lanes`` slots x max_len rows of the hidden
               state and q/k/v, the SwiGLU widths (with XLA's attention: of one MLP chunk of
               slots, dllm_jax.runtime.cached_forward.mlp_chunk_groups), plus XLA attention's float32
               logits and probabilities [lanes, heads, max_len, max_len] (the Pallas kernel keeps none);
  logits       the candidate rows of every slot x the vocabulary: the model-dtype copies the loop
               selects between and the float32 copies the sampler makes (noise, softmax);
  state        the rest of the decode state: per-slot arrays (tokens, drafts, flags, scores
               per position) and the request and result rings.
The pass's activations are dead by the time the sampler's logits live, so the larger of the
two counts. Against XLA's own buffer assignment (``compiled.memory_analysis()`` temp bytes of
the compiled loop on the CPU, tiny model, 8-64 slots, all three methods) the larger of the
two was 3-11% above it. XLA's workspace and fragmentation are covered by a margin in the check.

What the device has: ``memory_stats()`` on GPUs and TPUs, the host's available RAM on a CPU
(which reports none). The environment variable DLLM_MEMORY_AVAILABLE (bytes, or a number with
KiB/MiB/GiB/KB/MB/GB) replaces that reading: the free memory per device the check assumes,
for a device whose statistics are missing or wrong, to leave room for another process, or
for tests of the refusal.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from dllm_jax.common.errors import GenerationError
from dllm_jax.common.memory_override import MEMORY_ENV, memory_override, parse_bytes  # noqa: F401 (public here too)
from dllm_jax.models.config import ModelConfig
from dllm_jax.runtime.cached_forward import mlp_chunk_groups
from dllm_jax.runtime.chunked_attention import default_block_k
from dllm_jax.runtime.flat_cache import cache_bytes
from dllm_jax.runtime.sharding import DATA, TENSOR, axis_size, mesh_size
from dllm_jax.runtime.slots import SLOT_FIELDS, zero_sampling

# Model-dtype copies of the hidden state alive in a layer: input, normed input, attention
# output, the residual sum.
_HIDDEN_COPIES = 4
# SwiGLU: gate, up and their product, each [rows, mlp_hidden_size].
_MLP_COPIES = 3
# [B, C, V] logits: the full pass's, the sparse pass's, the empty branch's and the selection.
_LOGITS_COPIES = 4
# float32 [B, C, V] in the sampler: the cast logits, the uniform draw, the Gumbel noise, the
# noisy logits, the softmax.
_SAMPLER_F32_COPIES = 5
# Bytes per (slot, position) of the per-slot arrays: tokens, drafts, scores, commit_step, drift
# and logprob (4 each), decoded, pinned and verified (1 each), rounded up (plus 8 per recorded
# alternative: top_ids, top_logprobs); and per slot for its scalars (counters, bounds and the
# request's SlotSampling).
_SLOT_POSITION_BYTES = 28
_SLOT_BYTES = 256
# 4-byte words per queued request besides its prompt, its SlotSampling and its [G] result rows:
# the prompt length, the result's counters (request, num_tokens, steps, passes, verify_passes,
# accepted, start_iter, end_iter, error) and its done flag.
_REQUEST_WORDS = 11
_GIB = 2**30


class InsufficientMemoryError(GenerationError):
    """A configuration that does not fit the device; the message says what to lower."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device needs, by term (see the module docstring)."""

    weights: int
    cache: int
    activations: int
    logits: int
    state: int

    @property
    def temporaries(self) -> int:
        """The loop's temporaries at their peak: the pass's activations or, after the pass,
        the logits (never both live at once)."""
        return max(self.activations, self.logits)

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.state + self.temporaries

    def describe(self) -> str:
        """e.g. 'weights 14.9 GiB, K/V cache 4.0 GiB, activations 1.2 GiB, logits 0.9 GiB, state 12.0 MiB'
        (the total counts the larger of activations and logits)."""
        terms = [
            ("weights", self.weights),
            ("K/V cache", self.cache),
            ("activations", self.activations),
            ("logits", self.logits),
            ("state", self.state),
        ]
        return ", ".join(f"{name} {_gib(value)}" for name, value in terms)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What a device can still give.

    available: bytes free now (limit minus what is in use).
    name: the device or source, for messages ("gpu:0", "host RAM (cgroup limit)").
    includes_resident: True when ``available`` already excludes what this process holds
      (the weights, once loaded), as memory_stats and MemAvailable do.
    shared_by: devices that draw on this memory (CPU devices of a mesh share the host's RAM).
    """

    available: int
    name: str
    includes_resident: bool = True
    shared_by: int = 1


def estimate_memory(
    config: ModelConfig,
    *,
    num_slots: int,
    max_len: int,
    num_candidates: int,
    gen_length: int,
    queue_capacity: int,
    prompt_width: int,
    full_pass_lanes: int | None = None,
    dense_attention: bool = True,
    data: int = 1,
    tensor: int = 1,
    max_logprobs: int = 0,
) -> MemoryEstimate:
    """Bytes per device for the decode loop of this shape.

    Args:
      config: the model (its dtype is the weights', cache's and activations' dtype).
      num_slots: B, slots decoded together (all devices).
      max_len: L, cache rows per slot.
      num_candidates: C, candidate rows per slot whose logits are computed.
      gen_length, queue_capacity, prompt_width: the result ring [Q, G] and request ring [Q, P].
      full_pass_lanes: slots in the largest full pass per data shard (None: all of the shard's).
      dense_attention: attention through XLA (dllm_jax.runtime.chunked_attention), which materialises
        one chunk of float32 logits [lanes, H, L, block_k] at a time; False for the Pallas
        attention kernel.
      data, tensor: mesh axis sizes (slots split over data, heads and MLP over tensor).
      max_logprobs: alternatives recorded per committed token (DecodeConfig.max_logprobs).
    """
    itemsize = config.jnp_dtype.itemsize
    shard_slots = -(-num_slots // data)
    lanes = shard_slots if full_pass_lanes is None else min(full_pass_lanes, shard_slots)
    rows = lanes * max_len
    heads = -(-config.n_heads // tensor)
    projected = (config.n_heads * config.head_dim + 2 * config.kv_dim) // tensor
    # with XLA's attention, the attention output and MLP of a large pass run in chunks of whole slots
    mlp_rows = (mlp_chunk_groups(lanes, max_len) if dense_attention else lanes) * max_len
    activations = (
        rows * (_HIDDEN_COPIES * config.d_model + projected)
        + mlp_rows * _MLP_COPIES * -(-config.mlp_hidden_size // tensor)
    ) * itemsize
    if dense_attention:
        # one chunk's float32 logits and the probabilities rounded to the model dtype (the
        # online softmax's exp fuses into the rounding)
        block_k = min(max_len, default_block_k(lanes, max_len, heads, max_len))
        activations += lanes * heads * max_len * block_k * (4 + itemsize)
    logit_rows = shard_slots * num_candidates
    return MemoryEstimate(
        weights=config.weight_bytes() // tensor,
        cache=cache_bytes(config, num_slots, max_len) // (data * tensor),
        activations=activations,
        logits=logit_rows * config.vocab_size * (_LOGITS_COPIES * itemsize + _SAMPLER_F32_COPIES * 4),
        state=(
            shard_slots * (max_len * (_SLOT_POSITION_BYTES + 8 * max_logprobs) + _SLOT_BYTES)
            # request ring: prompt and SlotSampling; result ring: tokens, commit_step, logprob,
            # verified, counters, the recorded alternatives
            + queue_capacity
            * (
                (prompt_width + 3 * gen_length + len(SLOT_FIELDS) + _REQUEST_WORDS) * 4
                + gen_length * (1 + 8 * max_logprobs)
            )
        ),
    )


def _loop_shape(loop, queue_capacity: int, prompt_width: int) -> dict:
    """estimate_memory's shape arguments for a dllm_jax.runtime.decode_loop.DecodeLoop."""
    return dict(
        max_len=loop.max_len,
        num_candidates=loop.policy.num_candidates,
        gen_length=loop.gen_length,
        queue_capacity=queue_capacity,
        prompt_width=prompt_width,
        full_pass_lanes=max(loop.lane_sizes),
        dense_attention=not loop.kernels.attention,
        data=axis_size(loop.mesh, DATA),
        tensor=axis_size(loop.mesh, TENSOR),
        max_logprobs=loop.max_logprobs or 0,
    )


def estimate_decode_loop(loop, *, queue_capacity: int, prompt_width: int) -> MemoryEstimate:
    """estimate_memory for a dllm_jax.runtime.decode_loop.DecodeLoop (its model, slots, lengths, lanes,
    policy and kernels), with the queue the engine gives it; the cache and state terms are the
    exact sizes of the loop's initial state (traced with jax.eval_shape: nothing is allocated)."""
    estimate = estimate_memory(loop.model, num_slots=loop.num_slots, **_loop_shape(loop, queue_capacity, prompt_width))
    state = jax.eval_shape(
        loop.init_state,
        jax.ShapeDtypeStruct((queue_capacity, prompt_width), jnp.int32),
        jax.ShapeDtypeStruct((queue_capacity,), jnp.int32),
        jax.eval_shape(lambda: zero_sampling((queue_capacity,))),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    devices = axis_size(loop.mesh, DATA) * axis_size(loop.mesh, TENSOR)
    cache = _nbytes(state.cache) // devices
    rest = _nbytes(state) - _nbytes(state.cache)
    return dataclasses.replace(estimate, cache=cache, state=rest)


def check_decode_loop(
    loop,
    *,
    queue_capacity: int,
    prompt_width: int,
    memory: DeviceMemory | None = None,
    weights_resident: bool = True,
) -> MemoryEstimate:
    """check_memory for a DecodeLoop about to be compiled and run (the call the engine makes
    before allocating its state; a server makes it at start-up for its batch size).

    memory: default device_memory() of the first device, shared by the mesh's devices on the CPU.
    """
    if memory is None:
        memory = device_memory(devices=mesh_size(loop.mesh))
    return check_memory(
        loop.model,
        memory,
        num_slots=loop.num_slots,
        weights_resident=weights_resident,
        **_loop_shape(loop, queue_capacity, prompt_width),
    )


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def device_memory(device: jax.Device | None = None, *, devices: int = 1) -> DeviceMemory:
    """The free memory of ``device`` (default: the first device), for a run on ``devices``
    devices like it (the mesh size).

    GPU / TPU: ``memory_stats()`` bytes_limit - bytes_in_use. CPU (no memory_stats): the host's
    available RAM (MemAvailable in /proc/meminfo, else os.sysconf), or the cgroup's remaining
    limit when that is lower (a container's limit is what the OOM killer enforces).
    $DLLM_MEMORY_AVAILABLE, when set, is the answer instead (per device).
    """
    override = memory_override()
    if override is not None:
        return DeviceMemory(available=override, name=f"${MEMORY_ENV}")
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return DeviceMemory(available=max(free, 0), name=f"{device.platform}:{device.id}")
    return dataclasses.replace(host_memory(), shared_by=devices)


def host_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> DeviceMemory:
    """The host RAM still available to this process (see device_memory)."""
    available, name = _meminfo_available(proc / "meminfo"), "host RAM"
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = None
    limited = _cgroup_available(cgroup)
    if limited is not None and (available is None or limited < available):
        available, name = limited, "host RAM (cgroup limit)"
    if available is None:
        raise InsufficientMemoryError("cannot tell how much memory this machine has (no /proc/meminfo, no sysconf)")
    return DeviceMemory(available=available, name=name)


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available(root: Path) -> int | None:
    """cgroup v2 (memory.max) or v1 (memory/memory.limit_in_bytes) limit minus the usage that
    cannot be reclaimed (page cache of inactive files is given back under pressure)."""
    for limit_file, usage_file, stat_file, inactive in (
        (root / "memory.max", root / "memory.current", root / "memory.stat", "inactive_file"),
        (
            root / "memory" / "memory.limit_in_bytes",
            root / "memory" / "memory.usage_in_bytes",
            root / "memory" / "memory.stat",
            "total_inactive_file",
        ),
    ):
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 2**60:
            return None  # no limit
        reclaimable = 0
        try:
            for line in stat_file.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive:
                    reclaimable = int(value)
        except (OSError, ValueError):
            pass
        return max(int(limit_text) - max(usage - reclaimable, 0), 0)
    return None


def fits(estimate: MemoryEstimate, memory: DeviceMemory, *, weights_resident: bool, margin: float = 0.1) -> bool:
    """Whether what is still to be allocated (the weights too unless ``weights_resident`` and
    already counted by ``memory``), plus ``margin`` of it, fits ``memory.available``."""
    return _needed(estimate, memory, weights_resident) * (1 + margin) <= memory.available


def check_memory(
    config: ModelConfig,
    memory: DeviceMemory,
    *,
    num_slots: int,
    weights_resident: bool = True,
    margin: float = 0.1,
    **shape,
) -> MemoryEstimate:
    """Raises InsufficientMemoryError unless estimate_memory(config, num_slots=..., **shape) fits.

    The message gives the estimate by term, what is available, and the largest batch_size that
    fits at this max_len (or, when even one slot does not, to lower gen_length or the dtype).
    Returns the estimate when it fits.
    """
    estimate = estimate_memory(config, num_slots=num_slots, **shape)
    if fits(estimate, memory, weights_resident=weights_resident, margin=margin):
        return estimate
    data = shape.get("data", 1)
    fitting = _largest_fitting_batch(config, memory, num_slots, data, weights_resident, margin, shape)
    if fitting:
        advice = (
            f"lower the batch size to {fitting} or less, or the generation length or the longest prompt "
            "(the max model length)"
        )
    else:
        advice = (
            "even one slot does not fit: lower the generation length or the longest prompt (the max "
            "model length), use bfloat16 or 8-bit weights, or spread the model over more devices"
        )
    needed = _needed(estimate, memory, weights_resident)
    raise InsufficientMemoryError(
        f"batch size {num_slots} with {shape['max_len']} positions per slot needs about {_gib(needed)} more "
        f"({estimate.describe()}{'; weights already loaded' if weights_resident and memory.includes_resident else ''}), "
        f"{memory.name} has {_gib(memory.available)} free: {advice}"
    )


def _needed(estimate: MemoryEstimate, memory: DeviceMemory, weights_resident: bool) -> int:
    counted = weights_resident and memory.includes_resident
    return (estimate.total - (estimate.weights if counted else 0)) * memory.shared_by


def _largest_fitting_batch(config, memory, num_slots, data, weights_resident, margin, shape) -> int:
    """The largest multiple of ``data`` below num_slots whose estimate fits (0 if none): the
    estimate only grows with the batch, so bisection finds it."""
    low, high = 0, (num_slots - 1) // data  # in units of data
    while low < high:
        mid = (low + high + 1) // 2
        estimate = estimate_memory(config, num_slots=mid * data, **shape)
        if fits(estimate, memory, weights_resident=weights_resident, margin=margin):
            low = mid
        else:
            high = mid - 1
    return low * data


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB" if n >= _GIB // 10 else f"{n / 2**20:.1f} MiB"
