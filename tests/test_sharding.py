"""Decoding over a device mesh (conftest gives the CPU four devices): the sharded engine
decodes exactly the single-device tokens, and the weights, cache and slots really are split."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dllm_jax.engine.engine import Engine
from dllm_jax.models.transformer import init_params
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.sharding import MeshError, parse_mesh
from dllm_jax.sampling.params import SamplingParams
from tests.collectives import collectives
from tests.conftest import tiny_config
from tests.engine_checks import FAST_DUAL, FLASH, FLASH_VERIFY, random_prompts

pytestmark = pytest.mark.engine

# the shared loops (two slots: one per data shard) with their request values
DECODES = {
    "flash": (FLASH, SamplingParams(threshold=0.3)),
    "flash_verify": (FLASH_VERIFY, SamplingParams(threshold=0.7, gamma=0.3)),
    "fast_dllm": (FAST_DUAL, SamplingParams(threshold=0.5)),
}
# every method over both axes; each axis alone once (the loops the collectives tests read)
SHARDED = [
    ("data=2,tensor=2", "flash"),
    ("data=2,tensor=2", "flash_verify"),
    ("data=2,tensor=2", "fast_dllm"),
    ("data=2", "flash_verify"),
    ("tensor=2", "flash"),
]


def mesh_of(spec: str):
    sizes = [int(part.split("=")[1]) for part in spec.split(",")]
    return parse_mesh(spec, jax.devices()[: int(np.prod(sizes))])


@pytest.fixture(scope="module")
def prompts():
    return random_prompts()  # five requests for two slots: refills cross the data shards


@pytest.fixture(scope="module")
def engines(lively, lively_engine):
    """One engine per mesh spec (None: the session's single-device engine), built on first use."""
    cfg, params = lively
    made = {None: lively_engine}

    def get(spec: str | None) -> Engine:
        if spec not in made:
            made[spec] = Engine(cfg, params, backend="xla", mesh=None if spec is None else mesh_of(spec))
        return made[spec]

    return get


@pytest.fixture(scope="module")
def single_device(engines, prompts):
    cache = {}

    def get(name: str):
        if name not in cache:
            decode, sampling = DECODES[name]
            cache[name] = engines(None).generate(prompts, sampling, decode_config=decode)
        return cache[name]

    return get


@pytest.mark.parametrize("spec, decode", SHARDED)
@pytest.mark.integration  # full tier: decodes over device meshes
def test_sharded_engine_decodes_the_single_device_tokens(engines, single_device, prompts, spec, decode):
    expected = single_device(decode)
    config, sampling = DECODES[decode]
    out = engines(spec).generate(prompts, sampling, decode_config=config)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in expected.results]
    assert [(r.steps, r.reference_num_tokens, r.accepted_drafts) for r in out.results] == [
        (r.steps, r.reference_num_tokens, r.accepted_drafts) for r in expected.results
    ]
    assert expected.stats.tokens_per_step > 1.1, "the setting should exercise parallel commits"


def _shard_shape(array: jax.Array) -> tuple[int, ...]:
    shapes = {shard.data.shape for shard in array.addressable_shards}
    assert len(shapes) == 1
    return shapes.pop()


@pytest.mark.integration  # full tier: compiles loops over device meshes
def test_weights_cache_and_slots_are_split_as_intended(engines, prompts):
    engine = engines("data=2,tensor=2")
    cfg = engine.config
    NL, D, F, HD = cfg.n_layers, cfg.d_model, cfg.mlp_hidden_size, cfg.n_heads * cfg.head_dim
    layers = engine.weights["layers"]
    for name, spec, local in [
        ("q_proj", P(None, None, "tensor"), (NL, D, HD // 2)),
        ("k_proj", P(None, None, "tensor"), (NL, D, cfg.kv_dim // 2)),
        ("v_proj", P(None, None, "tensor"), (NL, D, cfg.kv_dim // 2)),
        ("attn_out", P(None, "tensor", None), (NL, HD // 2, D)),
        ("ff_proj", P(None, None, "tensor"), (NL, D, F // 2)),
        ("up_proj", P(None, None, "tensor"), (NL, D, F // 2)),
        ("ff_out", P(None, "tensor", None), (NL, F // 2, D)),
    ]:
        kernel = layers[name]["kernel"]
        assert kernel.sharding.spec == spec, name
        assert _shard_shape(kernel) == local, name
    for name in ("wte", "lm_head", "ln_f"):
        for leaf in jax.tree_util.tree_leaves(engine.weights[name]):
            assert leaf.sharding.is_fully_replicated, name
    assert layers["attn_norm"]["weight"].sharding.is_fully_replicated

    decode = DECODES["flash"][0]
    compiled = engine.compile(decode, max(map(len, prompts)))
    B, L = decode.batch_size, compiled.loop.max_len
    state = compiled.initial_state([[0, 0, 0]] * B)
    state = compiled.run(engine.weights, state, 2)
    for cache in (state.cache.k, state.cache.v):
        assert cache.sharding.spec == P(None, "data", "tensor")
        assert _shard_shape(cache) == (NL, B * L // 2, cfg.kv_dim // 2)
    assert state.slots.tokens.sharding.spec == P("data")
    assert _shard_shape(state.slots.tokens) == (B // 2, L)
    assert state.results.tokens.sharding.is_fully_replicated


def test_per_layer_weights_are_split_like_stacked_ones(lively):
    cfg, params = lively
    engine = Engine(cfg, params, backend="xla", unroll_layers=True, mesh=mesh_of("data=2,tensor=2"))
    for layer in engine.weights["layers"]:
        assert layer["q_proj"]["kernel"].sharding.spec == P(None, "tensor")
        assert layer["ff_out"]["kernel"].sharding.spec == P("tensor", None)
        assert layer["ff_norm"]["weight"].sharding.is_fully_replicated


@pytest.mark.integration  # full tier: compiles loops over device meshes
def test_data_shards_exchange_only_bookkeeping(engines, prompts):
    """No K/V, hidden rows or logits cross the data axis: the largest exchange is the
    finished answers [B, G] going to the (replicated) results ring, or the slots' canvas going
    to the call's (replicated) report."""
    decode = DECODES["flash_verify"][0]
    compiled = engines("data=2").compile(decode, max(map(len, prompts)))
    found = collectives(compiled.call.as_text())
    assert found, "the data shards agree on refills and the loop condition"
    canvas = compiled.packings.canvas
    assert max(n for _, n in found) <= max(decode.batch_size * decode.gen_length, canvas.num_ints, canvas.num_floats)


@pytest.mark.integration  # full tier: compiles loops over device meshes
def test_tensor_shards_never_gather_weights_or_cache(engines, prompts):
    """Tensor parallelism needs only all-reduces (of hidden rows and tracking scores)."""
    compiled = engines("tensor=2").compile(DECODES["flash"][0], max(map(len, prompts)))
    kinds = {kind for kind, _ in collectives(compiled.call.as_text())}
    assert kinds == {"all-reduce"}


@pytest.mark.unit
@pytest.mark.parametrize(
    "spec,match",
    [
        ("data=2,pipeline=2", "unknown axis 'pipeline'"),
        ("data=3", "3 devices, but 4 are available"),
        ("data=2,tensor=4", "8 devices, but 4 are available"),
        ("data2", "expected comma-separated axis=size"),
        ("data=0,tensor=4", "not a positive integer"),
        ("tensor=two", "not a positive integer"),
        ("data=2,data=2", "given twice"),
    ],
)
def test_bad_mesh_specs_are_named(spec, match):
    with pytest.raises(MeshError, match=match):
        parse_mesh(spec)


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,spec,match",
    [
        (dict(n_heads=2, n_kv_heads=2), "tensor=4", "n_heads=2 is not divisible by the tensor axis"),
        ({}, "tensor=4", "n_kv_heads=2 is not divisible by the tensor axis"),
        (dict(mlp_hidden_size=97), "data=2,tensor=2", "mlp_hidden_size=97 is not divisible by the tensor axis"),
    ],
)
def test_models_that_do_not_split_are_refused(overrides, spec, match):
    cfg = tiny_config(**overrides)
    with pytest.raises(MeshError, match=match):
        Engine(cfg, init_params(cfg, jax.random.key(0)), backend="xla", mesh=parse_mesh(spec))


def test_batches_that_do_not_split_are_refused(engines):
    decode = DecodeConfig(method="flash_cache", gen_length=16, batch_size=3)
    with pytest.raises(MeshError, match="batch_size=3 is not divisible by the data axis"):
        engines("data=2,tensor=2").generate([[1, 2, 3]], decode)
