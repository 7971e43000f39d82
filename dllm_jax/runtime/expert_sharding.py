"""DiffusionGemma's routed experts over a mesh: each device runs the rows routed to its own experts.

Under a mesh with an expert or tensor axis, each layer's experts are split across the two
axes together (dllm_jax.runtime.sharding.EXPERTS: device (e, t) of a data shard holds the
E / (expert x tensor) experts of block e * tensor + t). Every device of the data shard has all
of the shard's rows and their routing (the router is replicated), so no row is sent anywhere:
each device sorts the rows' assignments, runs those to its own block through the grouped GEMMs
(experts.routed_sum) and adds nothing for the others, and one all-reduce (psum) over the
expert x tensor group, in float32, sums each row's terms before the rounding to the model
dtype, as experts.grouped_expert_mlp rounds its own sum.

Example (4 experts, expert=2, tensor=1, top-2): a row routed to experts 1 and 2 gets w1 * f1(x)
from device 0 (experts 0-1) and w2 * f2(x) from device 1 (experts 2-3); the psum adds them.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from dllm_jax.models.experts import ExpertMLP, expert_mlp_with, num_experts, routed_sum
from dllm_jax.runtime.sharding import EXPERT, EXPERT_ROWS, EXPERTS, REPLICATED, TENSOR, axis_size, per_expert_shard


def experts_split(mesh: Mesh | None) -> bool:
    """Whether the mesh splits each layer's experts over devices (an expert or tensor axis)."""
    return axis_size(mesh, EXPERT) * axis_size(mesh, TENSOR) > 1


def sharded_expert_mlp(mesh: Mesh | None, grouped_gemm: str = "xla") -> ExpertMLP | None:
    """experts.grouped_expert_mlp under `mesh` (same signature and result: x [T, D], weights
    float32 [T, K], experts int32 [T, K], gate_up [E, 2F, D], down [E, D, F] split along E ->
    [T, D] in x's dtype, replicated; 8-bit expert weights likewise), its grouped GEMMs run
    with `grouped_gemm` (experts.GROUPED_GEMMS); None when neither the mesh splits an expert
    nor a kernel is asked for (the model's own)."""
    if not experts_split(mesh):
        return expert_mlp_with(grouped_gemm)

    def own_experts(x, weights, experts, gate_up, down):
        first = jax.lax.axis_index(EXPERTS) * num_experts(gate_up)
        routed = routed_sum(x, weights, experts, gate_up, down, first, grouped_gemm=grouped_gemm)
        return jax.lax.psum(routed, EXPERTS).astype(x.dtype)

    in_specs = (REPLICATED, REPLICATED, REPLICATED, EXPERT_ROWS, EXPERT_ROWS)
    return per_expert_shard(own_experts, mesh, in_specs=in_specs, out_specs=REPLICATED)
