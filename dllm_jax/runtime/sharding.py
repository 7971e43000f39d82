"""Decoding over several devices: the mesh and every sharding rule, through jax.sharding only.

A mesh has three axes, chosen by a spec string such as ``"data=2,tensor=2"`` (an axis left
out has size 1):

  data    the slots are split across it. Each device holds its slots' share of the per-slot
          state and of the flat cache (a slot's rows are contiguous, see flat_cache), and the
          per-slot part of a step (model passes, commits, Flash-Verify) runs under
          ``shard_map`` over this axis: each device picks and runs the full passes of its own
          slots, so no K/V row, hidden row or logit ever crosses the axis.
  tensor  Megatron-style tensor parallelism, left to GSPMD: q/k/v and the MLP's gate/up
          kernels are split by output columns (heads, hidden units), attn_out and ff_out by
          input rows, so a block's collectives are the two all-reduces of its rows' hidden
          states (the second one also carries the tracking scores, summed over heads). The
          cache is split by kv heads (its last axis), where k/v put them. DiffusionGemma's layers
          split the same way (q/k/v, the dense MLP's gate/up by columns; o_proj and its
          down_proj by rows), each attention kind's cache by its own kv heads.
  expert  only for a model with routed experts (DiffusionGemma): each layer's experts are
          split across the expert and tensor axes together (EXPERTS: device (e, t) holds
          the experts of block e * tensor + t), everything else is replicated across it. The
          rows of a data shard are on every device of its expert x tensor group, so the routed
          MLP needs no token exchange: each device runs the rows routed to its own experts
          through its grouped GEMMs, and one all-reduce over the group sums the rows' outputs
          (dllm_jax.runtime.expert_sharding). Splitting the experts (not their hidden units)
          over the tensor axis too keeps the checkpoint's fused gate/up layout and uses the
          tensor devices' memory for them; the expert axis adds devices for the experts alone
          (the attention is recomputed on each of its devices), for when the heads do not split
          further. (The alternative, the expert axis as more data parallelism with the tokens
          all-gathered into the routed MLP and reduce-scattered back, is not built.)

The embedding, the norms and the LM head are replicated (DiffusionGemma's tied embedding,
self-conditioning MLP and routers too). The lookup is a gather of a few
rows, and the LM head runs on the candidate rows only (about 1% of a flash_cache step's
FLOPs at LLaDA-8B shapes, 7% of a dual-cache step, whose every recomputed row is a
candidate), while a vocabulary split would add an all-reduce of the embedded rows to every
pass and a distributed softmax and argmax over the candidates' logits to every commit; the
price is two vocab_size x d_model matrices on every device (about 1 GiB each at LLaDA-8B,
bf16; with 8-bit weights the embedding is int8 with a scale per row, half that, and
replicated the same way).

What couples the slots (the request ring, the results ring, the loop condition, which
full-pass variant runs) is small and replicated; GSPMD gathers the few per-slot values it
needs (finished answers, free slots) across the data axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.diffusion_gemma_config import AttentionKind, DiffusionGemmaConfig
from dllm_jax.models.transformer import Weights

DATA = "data"
TENSOR = "tensor"
EXPERT = "expert"
AXES: tuple[str, str, str] = (DATA, TENSOR, EXPERT)

# Specs of the decode state. Inside the data shard_map only the data axis is named: the
# tensor split of the cache and of the weights is GSPMD's (the axis stays automatic there).
SLOTS = P(DATA)  # per-slot arrays [B, ...]
CACHE = P(None, DATA, TENSOR)  # flat cache [n_layers, B * max_len, kv_dim]
CACHE_ROWS = P(None, DATA)  # the same, as seen by the data shard_map
REPLICATED = P()
# Inside the Pallas kernels' shard_map over the tensor axis: the last axis split by heads.
HEADS = P(None, None, TENSOR)  # weights [NL, D, H*Dh], cache [NL, M, KVH*Dh], rows [S, R, H*Dh]
FLAT_HEADS = P(None, TENSOR)  # rows [N, H*Dh]
# A layer's routed experts [E, ...] split along E, expert-major, and (inside the routed MLP's
# shard_map) the spec of that axis.
EXPERTS = (EXPERT, TENSOR)
EXPERT_ROWS = P(EXPERTS)

# The layer stacks of each family ([n_layers, ...] leaves, or a tuple of per-layer trees).
_LAYER_STACKS = ("layers", "sliding_layers", "full_layers")
# Layer kernels [(n_layers,) in, out] split by output columns / by input rows (LLaDA/Dream's
# names, then DiffusionGemma's).
_COLUMN_SPLIT = ("q_proj", "k_proj", "v_proj", "ff_proj", "up_proj", "gate_proj")
_ROW_SPLIT = ("attn_out", "ff_out", "o_proj", "down_proj")


class MeshError(ValueError):
    """A mesh spec or a mesh that cannot run this model or batch; the message says why."""


def parse_mesh(spec: str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "tensor", "expert") mesh from a spec like "data=2,tensor=2" (a missing axis is 1).

    devices: the devices to lay out (default: all of jax.devices()); their number must be
    the product of the axis sizes.
    """
    sizes = dict.fromkeys(AXES, 1)
    seen: set[str] = set()
    for part in spec.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name or not value:
            raise MeshError(f"mesh spec {spec!r}: expected comma-separated axis=size entries, got {part.strip()!r}")
        if name not in sizes:
            raise MeshError(f"mesh spec {spec!r}: unknown axis {name!r} (axes: {', '.join(AXES)})")
        if name in seen:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if not value.isdigit() or int(value) < 1:
            raise MeshError(f"mesh spec {spec!r}: {name}={value!r} is not a positive integer")
        seen.add(name)
        sizes[name] = int(value)
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes[a] for a in AXES)
    if math.prod(shape) != len(devices):
        raise MeshError(
            f"mesh spec {spec!r}: {' x '.join(map(str, shape))} = {math.prod(shape)} devices, "
            f"but {len(devices)} are available"
        )
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def axis_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else mesh.shape[axis]


def mesh_size(mesh: Mesh | None) -> int:
    """Devices of the mesh (1 without one)."""
    return 1 if mesh is None else mesh.size


def check_model(mesh: Mesh, config: ModelConfig | DiffusionGemmaConfig) -> None:
    """Raises MeshError unless the model's heads and MLP split evenly across the tensor axis
    and its routed experts across the expert and tensor axes (a model without experts: an
    expert axis of 1)."""
    if tuple(mesh.axis_names) != AXES:
        raise MeshError(f"mesh axes {mesh.axis_names}: expected {AXES} (use parse_mesh)")
    tensor, expert = mesh.shape[TENSOR], mesh.shape[EXPERT]
    if config.family == "diffusion_gemma":
        sizes = {"n_heads": config.n_heads, "mlp_hidden_size": config.mlp_hidden_size}
        for kind in AttentionKind:
            if config.layers_of(kind):
                sizes[f"{kind.name.lower()}_kv_heads"] = config.kv_heads(kind)
        if config.n_experts % (expert * tensor):
            raise MeshError(
                f"n_experts={config.n_experts} is not divisible by the expert x tensor axes ({expert} x {tensor})"
            )
    else:
        sizes = {name: getattr(config, name) for name in ("n_heads", "n_kv_heads", "mlp_hidden_size")}
        if expert > 1:
            raise MeshError(f"the expert axis ({expert}) splits routed experts, and a {config.family} model has none")
    for name, value in sizes.items():
        if value % tensor:
            raise MeshError(f"{name}={value} is not divisible by the tensor axis ({tensor})")


def check_batch(mesh: Mesh, batch_size: int) -> None:
    """Raises MeshError unless the slots split evenly across the data axis."""
    data = mesh.shape[DATA]
    if batch_size % data:
        raise MeshError(f"batch_size={batch_size} is not divisible by the data axis ({data})")


def param_specs(params: Weights) -> Weights:
    """A PartitionSpec per parameter, for any family's tree (dllm_jax.models' docstring,
    dllm_jax.models.diffusion_gemma's): its layer stacks stacked ([n_layers, in, out] kernels)
    or per layer (a tuple of [in, out] kernels). Outside the layer stacks all is replicated."""

    def spec(path, leaf) -> P:
        keys = [getattr(k, "key", None) for k in path]
        if keys[0] not in _LAYER_STACKS:
            return REPLICATED
        stacked = not any(isinstance(k, jax.tree_util.SequenceKey) for k in path)
        if "experts" in keys:  # [(NL,) E, ...]
            return P(*(None,) * stacked, EXPERTS)
        module, name = keys[-2], keys[-1]
        if name in ("scale", "bias"):  # [(NL,) out] of a quantized kernel or a bias: split with the output columns
            return P(*(None,) * (leaf.ndim - 1), TENSOR) if module in _COLUMN_SPLIT else REPLICATED
        lead = (None,) * (leaf.ndim - 2)
        # kernel is [in, out]; a quantized qkernel is [out, in]
        column, row = (P(*lead, None, TENSOR), P(*lead, TENSOR, None))
        if name == "qkernel":
            column, row = row, column
        if module in _COLUMN_SPLIT:
            return column
        if module in _ROW_SPLIT:
            return row
        return REPLICATED

    return jax.tree_util.tree_map_with_path(spec, params)


def bytes_per_device(params: Weights, mesh: Mesh | None) -> int:
    """Bytes of the (possibly abstract) parameters one device holds under param_specs."""
    if mesh is None:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))

    def share(leaf, spec: P) -> int:
        axes = [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
        return leaf.size * leaf.dtype.itemsize // math.prod(mesh.shape[a] for a in axes)

    return sum(jax.tree.leaves(jax.tree.map(share, params, param_specs(params))))


def param_shardings(params: Weights, mesh: Mesh) -> Weights:
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(params))


def place_params(params: Weights, mesh: Mesh) -> Weights:
    """The parameters laid out for the mesh (a no-op for leaves already laid out so)."""
    return jax.device_put(params, param_shardings(params, mesh))


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """Shardings of a DecodeState (or its shape): slots and cache split, rings replicated."""

    def every(tree, spec: P):
        return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, spec), tree)

    return state.replace(
        slots=every(state.slots, SLOTS),
        cache=every(state.cache, CACHE),
        queue=every(state.queue, REPLICATED),
        results=every(state.results, REPLICATED),
        iteration=NamedSharding(mesh, REPLICATED),
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, REPLICATED)


def per_data_shard(fn: Callable, mesh: Mesh | None, in_specs: tuple, out_specs: Any) -> Callable:
    """fn run by each data shard on its own slots (shard_map, manual over the data axis only).

    Specs name the data axis only (SLOTS, CACHE_ROWS, REPLICATED); the tensor and expert axes
    stay automatic inside. Without a mesh, or with one data shard, fn itself: GSPMD alone suffices.
    The bodies use no collective of their own over the data axis, so the varying-manual-axes
    check is off (it would ask every fresh zero array of a scan carry to be marked varying).
    """
    if axis_size(mesh, DATA) == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=False)


def per_tensor_shard(fn: Callable, mesh: Mesh | None, in_specs: tuple, out_specs: Any) -> Callable:
    """fn run by each device on its own heads (shard_map over the tensor axis), for the Pallas
    kernels, which GSPMD cannot split. Without a tensor axis, fn itself.

    Meant for the model passes, which run inside per_data_shard: with several data shards,
    the data axis is already manual there, and the nested shard_map must be told so.
    """
    if axis_size(mesh, TENSOR) == 1:
        return fn
    return _inside_data_shard(fn, mesh, {TENSOR}, in_specs, out_specs)


def per_expert_shard(fn: Callable, mesh: Mesh | None, in_specs: tuple, out_specs: Any) -> Callable:
    """fn run by each device of the expert x tensor group on its own experts (shard_map over
    both axes; specs name EXPERTS), inside the model passes like per_tensor_shard. Without
    either axis, fn itself."""
    if axis_size(mesh, TENSOR) * axis_size(mesh, EXPERT) == 1:
        return fn
    return _inside_data_shard(fn, mesh, {TENSOR, EXPERT}, in_specs, out_specs)


def _inside_data_shard(fn: Callable, mesh: Mesh, axes: set[str], in_specs: tuple, out_specs: Any) -> Callable:
    """shard_map of fn over `axes`, with the data axis manual already when it has several shards."""
    if mesh.shape[DATA] > 1:
        mesh = mesh.abstract_mesh.update_axis_types({DATA: AxisType.Manual})
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axes, check_vma=False)
