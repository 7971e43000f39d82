"""DiffusionGemma over a device mesh (conftest gives the CPU four devices): the sharded canvas
loop decodes exactly the single-device tokens, the experts live on their expert x tensor
devices, the memory estimate counts one device's share, and meshes the model cannot split are
refused in one line.

A request's answer depends on its seed only, never on its batch (dllm_jax.policies.canvas), so
every layout must give the single-device tokens. The random model is well conditioned (weights
of unit scale, a small self-conditioning output, as tests/diffusion_gemma_checkpoint.py makes
transformers' model) so float32 rounding of the split matmuls does not flip a sample. Its loops
are the cached-canvas variant (a canvas's first step in lanes, then sparse steps; four slots,
two per data shard); the embedded model's are the plain one, run through dllm-generate.
Compiled loops (four, each 20-60 s on two CPU cores): the random model's on one device and on
data=2,tensor=2, the embedded model's on one device and on data=2,expert=2; the other layouts
(expert=4, tensor=4, tensor=2,expert=2) are checked on the routed experts alone, and the
parameter layout of tensor=2,expert=2 without compiling.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dllm_jax.engine.engine import Engine
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.diffusion_gemma_config import DiffusionGemmaConfig
from dllm_jax.models.experts import grouped_expert_mlp
from dllm_jax.models.quantization import quantize_experts
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.expert_sharding import sharded_expert_mlp
from dllm_jax.runtime.sharding import EXPERT_ROWS, REPLICATED, SLOTS, MeshError, parse_mesh, per_data_shard
from dllm_jax.runtime.weights_memory import expert_bytes
from dllm_jax.sampling.params import SamplingParams
from tests.collectives import collectives
from tests.conftest import tiny_config
from tests.diffusion_gemma_small import small_config as shared_small_config

pytestmark = pytest.mark.engine

CANVAS = 4
DECODE = DecodeConfig(method="diffusion_gemma", gen_length=3 * CANVAS, batch_size=4, canvas_rows=2)
# (seed, max_new_tokens, max_denoising_steps, stability_threshold, confidence_threshold)
REQUESTS = ((0, 12, 4, 1, 3.0), (1, 12, 3, 0, 9.0), (2, 7, 4, 2, 9.0), (3, 12, 2, 1, 0.5), (4, 12, 4, 1, 3.0))


def small_config(**overrides) -> DiffusionGemmaConfig:
    """Two layers (sliding, full), 4 query heads over 2 kv heads in both kinds, 4 experts of
    which 2 per token."""
    base = dict(full_kv_heads=2, vocab_size=64, canvas_length=CANVAS, max_sequence_length=128)
    return shared_small_config(**{**base, "pad_token_id": 0, "bos_token_id": 2, "eos_token_ids": (1,), **overrides})


def mesh_of(spec: str):
    sizes = [int(part.split("=")[1]) for part in spec.split(",")]
    return parse_mesh(spec, jax.devices()[: int(np.prod(sizes))])


@pytest.fixture(scope="module")
def model():
    """The config and random weights of unit scale: matrices normal(0, 1/fan_in), embedding
    rows normal(0, 1), self-conditioning's output projection a tenth of that."""
    config = small_config()

    def scaled(path, w):
        name = jax.tree_util.keystr(path)
        if "embed_tokens" in name:
            return w / 0.02
        if w.ndim < 2 or w.shape[-1] == 1:  # norms, scales, layer scalars
            return w
        fan_in = w.shape[-1] if "experts" in name else w.shape[-2]  # experts: [E, out, in]
        w = w / 0.02 / fan_in**0.5
        return w * 0.1 if "self_conditioning" in name and "down_proj" in name else w

    # one program (eagerly, each leaf's draw and scaling would compile on its own)
    init = jax.jit(lambda key: jax.tree_util.tree_map_with_path(scaled, dg.init_params(config, key)))
    return config, init(jax.random.key(0))


@pytest.fixture(scope="module")
def engines(model):
    """One engine per mesh spec (None: one device), built on first use."""
    made = {}

    def get(spec: str | None) -> Engine:
        if spec not in made:
            made[spec] = Engine(*model, backend="xla", mesh=None if spec is None else mesh_of(spec))
        return made[spec]

    return get


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 60, n)] for n in (3, 6, 9, 5, 4)]
    sampling = [
        SamplingParams(
            seed=seed,
            max_new_tokens=max_new,
            max_denoising_steps=steps,
            stability_threshold=stability,
            confidence_threshold=confidence,
        )
        for seed, max_new, steps, stability, confidence in REQUESTS
    ]
    return prompts, sampling


@pytest.fixture(scope="module")
def single_device(engines, requests):
    return engines(None).generate(*requests, decode_config=DECODE)


@pytest.mark.integration  # full tier: decodes over device meshes
def test_the_sharded_canvas_loop_decodes_the_single_device_tokens(engines, requests, single_device):
    # the slots over data, the heads and the experts over tensor (the experts over the expert
    # axis: the embedded model's test below; over expert and tensor together: the routed
    # experts' test, which runs the same function)
    out = engines("data=2,tensor=2").generate(*requests, decode_config=DECODE)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in single_device.results]
    assert [(r.steps, r.finish_reason) for r in out.results] == [
        (r.steps, r.finish_reason) for r in single_device.results
    ]
    steps = [r.steps for r in single_device.results]
    assert min(steps) < max(steps) and len({len(r.token_ids) for r in single_device.results}) > 1, (
        "the requests should stop at different steps and lengths"
    )


@pytest.mark.integration  # full tier: compiles loops over device meshes
def test_only_hidden_rows_are_summed_across_devices(engines, requests, model):
    """The layers' all-reduces (attention output, MLP, the experts' sums: rows [<= B L, D] of a
    data shard's pass) and the data shards' bookkeeping: no weight, cache row or logit is
    gathered, nothing is sent elsewhere, and the experts' outputs are summed once per row
    (GSPMD alone, with the experts split, sums every routing slot's [B L K, 2F] and [B L K, D]
    products instead)."""
    compiled = engines("data=2,tensor=2").compile(DECODE, max(map(len, requests[0])))
    found = collectives(compiled.call.as_text(), per_array=True)
    assert {kind for kind, _ in found} == {"all-reduce", "all-gather"}
    rows = compiled.loop.shard_slots * CANVAS
    assert max(n for kind, n in found if kind == "all-reduce") == rows * model[0].d_model
    # the finished answers [B, G] going to the (replicated) results ring, and the call's packed
    # canvas report (engine.packing: the host's one transfer of the canvases' changes)
    canvas = compiled.packings.canvas
    bound = max(DECODE.batch_size * DECODE.gen_length, canvas.num_ints, canvas.num_floats)
    assert max(n for kind, n in found if kind == "all-gather") <= bound


def test_each_expert_lives_on_one_device_of_the_expert_x_tensor_group(engines):
    engine = engines("tensor=2,expert=2")
    mesh = engine.mesh
    layers = engine.weights["sliding_layers"]
    for name in ("gate_up_proj", "down_proj"):
        experts = layers["experts"][name]
        assert experts.sharding.spec == P(None, ("expert", "tensor")), name
        # [N, E, ...]: device (e, t) of the 2 x 2 group holds expert 2 e + t, alone
        for shard in experts.addressable_shards:
            coords = {axis: int(i) for axis, i in zip(mesh.axis_names, np.argwhere(mesh.devices == shard.device)[0])}
            first = shard.index[1].start
            assert shard.data.shape[1] == 1 and first == 2 * coords["expert"] + coords["tensor"], name
    for path, spec in [
        (("q_proj", "kernel"), P(None, None, "tensor")),
        (("k_proj", "kernel"), P(None, None, "tensor")),
        (("v_proj", "kernel"), P(None, None, "tensor")),
        (("o_proj", "kernel"), P(None, "tensor", None)),
        (("mlp", "gate_proj", "kernel"), P(None, None, "tensor")),
        (("mlp", "down_proj", "kernel"), P(None, "tensor", None)),
    ]:
        leaf = layers
        for key in path:
            leaf = leaf[key]
        assert leaf.sharding.spec == spec, path
    assert engine.weights["full_layers"]["k_proj"]["kernel"].sharding.spec == P(None, None, "tensor")
    for name in ("router", "input_layernorm"):
        for leaf in jax.tree.leaves(layers[name]):
            assert leaf.sharding.is_fully_replicated, name
    for name in ("embed_tokens", "self_conditioning", "norm"):
        for leaf in jax.tree.leaves(engine.weights[name]):
            assert leaf.sharding.is_fully_replicated, name


@pytest.mark.integration  # full tier: compiles loops over device meshes
def test_the_memory_estimate_is_one_devices_share(engines, requests):
    engine = engines("data=2,tensor=2")
    compiled = engine.compile(DECODE, max(map(len, requests[0])))
    device = jax.devices()[0]

    def on_device(tree) -> int:
        shards = [s for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device]
        return sum(s.data.nbytes for s in shards)

    state = compiled.initial_state(requests[0][:1])
    for cache in jax.tree.leaves(state.cache):
        assert cache.sharding.spec == P(None, "data", "tensor")
    assert state.slots.tokens.sharding.spec == P("data")
    assert compiled.memory.cache == on_device(state.cache)
    assert compiled.memory.weights == on_device(engine.weights)
    full = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.weights))
    assert compiled.memory.weights < full / 1.5  # the layers are split, the embedding is not


@pytest.mark.unit
@pytest.mark.parametrize(
    "spec, quantization",
    [
        ("expert=4", "none"),
        ("tensor=4", "none"),
        ("tensor=2,expert=2", "none"),
        ("data=2,expert=2", "none"),
        ("tensor=2,expert=2", "fp8"),
        ("expert=4", "int8-weights"),
    ],
)
def test_the_routed_experts_over_a_mesh_equal_the_grouped_gemms(spec, quantization):
    mesh = mesh_of(spec)
    T, K, E, D, F = 10, 2, 4, 8, 6
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (T, D))
    weights = jax.random.uniform(keys[1], (T, K))
    experts = jax.random.randint(keys[2], (T, K), 0, E)
    gate_up, down = jax.random.normal(keys[3], (E, 2 * F, D)), jax.random.normal(keys[4], (E, D, F))
    if quantization != "none":  # 8-bit experts: {"qkernel", "scale"}, split along E like the plain ones
        gate_up, down = (quantize_experts(w, quantization) for w in (gate_up, down))
    expected = jax.jit(grouped_expert_mlp)(x, weights, experts, gate_up, down)
    placed = [jax.device_put(w, jax.sharding.NamedSharding(mesh, EXPERT_ROWS)) for w in (gate_up, down)]
    routed = sharded_expert_mlp(mesh)
    # each data shard's rows: here two copies of the same rows, run inside the data shard_map
    data = mesh.shape["data"]
    per_shard = per_data_shard(
        lambda x, w, e, gu, dn: routed(x[0], w[0], e[0], gu, dn)[None],
        mesh,
        in_specs=(SLOTS, SLOTS, SLOTS, REPLICATED, REPLICATED),
        out_specs=SLOTS,
    )
    stacked = [np.stack([a] * data) for a in (x, weights, experts)]
    out = jax.jit(per_shard)(*stacked, *placed)
    for shard_out in np.asarray(out):
        np.testing.assert_allclose(shard_out, expected, rtol=1e-6, atol=1e-5)


@pytest.mark.unit
def test_the_weights_check_knows_the_experts_share():
    # dllm-generate's check before loading: a device holds 1/(tensor x expert) of the experts
    config = small_config()
    params = dg.abstract_params(config)
    experts = [params[stack]["experts"] for stack in ("sliding_layers", "full_layers")]
    assert expert_bytes(config) == sum(leaf.size * 4 for leaf in jax.tree.leaves(experts)) > 0
    assert expert_bytes(tiny_config()) == 0


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,spec,match",
    [
        (dict(n_experts=2), "tensor=2,expert=2", r"n_experts=2 is not divisible by the expert x tensor axes \(2 x 2\)"),
        (dict(full_kv_heads=1), "tensor=2", r"full_kv_heads=1 is not divisible by the tensor axis \(2\)"),
        (dict(sliding_kv_heads=1), "tensor=2", r"sliding_kv_heads=1 is not divisible by the tensor axis \(2\)"),
        (dict(n_heads=6, sliding_kv_heads=3, full_kv_heads=3), "tensor=4", "n_heads=6 is not divisible"),
    ],
)
def test_models_that_do_not_split_are_refused(overrides, spec, match):
    config = small_config(**overrides)
    with pytest.raises(MeshError, match=match):
        Engine(config, dg.abstract_params(config), backend="xla", mesh=mesh_of(spec))


@pytest.mark.integration  # full tier: decodes over device meshes
def test_dllm_generate_decodes_the_embedded_model_alike_over_data_and_expert_axes(capsys):
    from dllm_jax.cli.generate import main

    argv = ["--model", "tiny-diffusiongemma", "--prompt", "sort: 3 1 2", "--prompt", "13+5-1-9"]
    argv += ["--batch-size", "2", "--max-new-tokens", "16", "--no-progress", "-q"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    # the model resolves by name and answers each prompt under its header (what
    # tests/test_embedded_diffusion_gemma.py's dllm-generate test checked with one prompt)
    first, second = single.split("### [1] 13+5-1-9\n")
    header = "### [0] sort: 3 1 2\n"
    assert first.startswith(header) and first[len(header) :].strip() and second.strip(), single
    assert main(argv + ["--mesh", "data=2,expert=2"]) == 0
    assert capsys.readouterr().out == single and single.count("### [") == 2
    # its one full-attention kv head does not split over a tensor axis: refused before loading
    assert main(argv + ["--mesh", "tensor=2,expert=2"]) == 2
    assert "full_kv_heads=1 is not divisible by the tensor axis (2)" in capsys.readouterr().err
