"""How much memory the DiffusionGemma loop needs, and whether the device has it.

The terms of dllm_jax.runtime.memory_estimate.MemoryEstimate, per device, counted as the canvas
loop (dllm_jax.runtime.canvas_loop) materialises them; under a mesh B is the slots of one data
shard and every width split by the tensor axis is the device's share:
  weights      every parameter (the layer stacks, the tied embedding, self-conditioning; 8-bit
               where quantized), the device's share of them under the mesh's parameter specs
               (exact: sharding.bytes_per_device);
  cache        the encoder caches of both attention kinds (exact: the loop's state shapes,
               split over the data and tensor axes);
  activations  one layer of a pass over B slots x L rows: the hidden state's copies, q/k/v
               of the wider kind, the dense MLP and self-conditioning widths, the experts'
               top-k assignments (the gathered rows, gate/up and down products in float32,
               the weighted and unsorted copies: every assignment, also on a device that
               runs a few of the experts, as its grouped GEMMs' buffers are that long), and
               one chunk of the attention's float32 logits and probabilities over the cached
               keys plus the rows' own;
  logits       the denoising stage's [g, L, V] copies for one group of g slots
               (canvas_loop.sampler_group: float32 ones in XLA's stage, model-dtype ones in
               the canvas sampler kernel's) and the soft embeddings [B, L, D];
  state        the rest of the decode state (slots, split over the data axis, and the
               replicated request and result rings; exact).
The pass's activations are dead by the time the sampler's logits live: the larger counts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.diffusion_gemma_config import AttentionKind
from dllm_jax.runtime.canvas_loop import CanvasLoop
from dllm_jax.runtime.chunked_attention import default_block_k
from dllm_jax.runtime.memory_estimate import (
    DeviceMemory,
    InsufficientMemoryError,
    MemoryEstimate,
    _gib,
    _needed,
    device_memory,
    fits,
)
from dllm_jax.runtime.sharding import DATA, TENSOR, axis_size, bytes_per_device, mesh_size
from dllm_jax.runtime.slots import zero_sampling

# Model-dtype copies of the hidden rows alive in a layer: input, normed input, attention
# output, the residual sum.
_HIDDEN_COPIES = 4


def _expert_bytes(d_model: int, expert_hidden: int, itemsize: int) -> int:
    """Bytes per expert assignment: float32 gate/up [2Fe] and down [D] products and the
    weighted and unsorted float32 copies [D] each; the gathered row [D] and the GELU product
    [Fe] in the model dtype."""
    return (2 * expert_hidden + 3 * d_model) * 4 + (d_model + expert_hidden) * itemsize


def estimate_canvas_loop(
    loop: CanvasLoop, *, queue_capacity: int, prompt_width: int, weights: int | None = None
) -> MemoryEstimate:
    """Bytes the loop needs on each of its devices (see the module docstring); weights: the
    weights' bytes per device when known (else counted from the config)."""
    c = loop.model
    itemsize = c.jnp_dtype.itemsize
    data, tensor = axis_size(loop.mesh, DATA), axis_size(loop.mesh, TENSOR)
    B, L, V, D = loop.shard_slots, loop.policy.canvas_length, c.vocab_size, c.d_model
    rows = B * L
    projected = max(c.n_heads * c.head_dim(k) + 2 * c.kv_heads(k) * c.head_dim(k) for k in AttentionKind)
    block_k = min(loop.max_len, default_block_k(B, L, c.n_heads, loop.max_len))
    activations = (
        rows * (_HIDDEN_COPIES * D + (projected + 3 * c.mlp_hidden_size) // tensor) * itemsize
        + rows * c.top_k_experts * _expert_bytes(D, c.expert_hidden_size, itemsize)
        # one chunk of cached keys plus the L own rows: float32 logits and the rounded probabilities
        + B * (c.n_heads // tensor) * L * (block_k + L) * (4 + itemsize)
    )
    logits = loop.sampler_bytes_per_logit * loop.sampler_slots * L * V + rows * D * itemsize
    state = jax.eval_shape(
        loop.init_state,
        jax.ShapeDtypeStruct((queue_capacity, prompt_width), jnp.int32),
        jax.ShapeDtypeStruct((queue_capacity,), jnp.int32),
        jax.eval_shape(lambda: zero_sampling((queue_capacity,))),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    cache, slots = _nbytes(state.cache), _nbytes(state.slots)
    if weights is None:
        weights = bytes_per_device(dg.abstract_params(c), loop.mesh)
    return MemoryEstimate(
        weights=weights,
        cache=cache // (data * tensor),
        activations=activations,
        logits=logits,
        state=_nbytes(state) - cache - slots + slots // data,
    )


def check_canvas_loop(
    loop: CanvasLoop,
    *,
    queue_capacity: int,
    prompt_width: int,
    memory: DeviceMemory | None = None,
    weights_resident: bool = True,
    margin: float = 0.1,
) -> MemoryEstimate:
    """Raises InsufficientMemoryError unless the loop fits `memory` (default: the device's free
    memory, shared by the mesh's devices on the CPU); the message gives the estimate by term
    and the largest slot count that fits (a multiple of the mesh's data axis). Returns the
    estimate when it fits."""
    memory = device_memory(devices=mesh_size(loop.mesh)) if memory is None else memory
    shape = dict(queue_capacity=queue_capacity, prompt_width=prompt_width)
    estimate = estimate_canvas_loop(loop, **shape)
    shape["weights"] = estimate.weights
    data = axis_size(loop.mesh, DATA)

    def fitting(shards: int) -> bool:
        smaller = estimate_canvas_loop(dataclasses.replace(loop, num_slots=shards * data), **shape)
        return fits(smaller, memory, weights_resident=weights_resident, margin=margin)

    if fits(estimate, memory, weights_resident=weights_resident, margin=margin):
        return estimate
    # the estimate grows with the slots: bisect for the most (in units of data) that fit
    low, high = 0, (loop.num_slots - 1) // data
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fitting(mid) else (low, mid - 1)
    advice = (
        f"lower the batch size to {low * data} or less, or the generation length or the longest prompt"
        if low
        else "even one slot does not fit: lower the generation length or the longest prompt, or use bfloat16"
    )
    needed = _needed(estimate, memory, weights_resident)
    raise InsufficientMemoryError(
        f"batch size {loop.num_slots} with {loop.max_len} positions per slot needs about {_gib(needed)} more "
        f"({estimate.describe()}), {memory.name} has {_gib(memory.available)} free: {advice}"
    )


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
