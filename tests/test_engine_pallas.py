"""The engine on the Pallas kernels (interpret mode) decodes the same tokens as on XLA."""

import jax
import numpy as np
import pytest

from dllm_jax.engine.engine import Engine
from dllm_jax.models.transformer import init_params
from dllm_jax.runtime.sharding import parse_mesh
from dllm_jax.sampling.params import SamplingParams
from tests.conftest import tiny_config
from tests.cuda_lowering import GPU_AUTO, lower_decode_loop_for_cuda
from tests.engine_checks import FAST_DUAL, FLASH_VERIFY

pytestmark = pytest.mark.engine

FAST_DLLM = FAST_DUAL
SAMPLING = {"flash_cache": SamplingParams(threshold=0.7, gamma=0.3), "fast_dllm": SamplingParams(threshold=0.5)}


def _kernel_sized_model():
    """The lively tiny model with head_dim 32: the kernels' smallest tile is 16 rotary pairs."""
    cfg = tiny_config(d_model=128, mlp_hidden_size=128)
    params = init_params(cfg, jax.random.key(0))
    params["layers"] = jax.tree_util.tree_map(lambda w: w * 8 if w.ndim == 3 else w, params["layers"])
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 20
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, 100, n)) for n in (12, 7, 15, 9, 3)]
    return cfg, params, prompts


@pytest.fixture(scope="module")
def xla_answers():
    """The XLA engine's answers per method, decoded once for the module's comparisons."""
    cfg, params, prompts = _kernel_sized_model()
    engine, answers = Engine(cfg, params, backend="xla"), {}

    def get(decode):
        if decode not in answers:
            answers[decode] = engine.generate(prompts, SAMPLING[decode.method], decode_config=decode)
        return answers[decode]

    return get


# Flash-Verify runs every pass (full, sparse, verify) through the GPU's kernel choice over
# per-layer weights (the unrolled layer loop); Fast-dLLM's block pass runs through the Pallas
# kernels (the layer loop and routing do not depend on the method). Flash-Verify on the Pallas
# kernels: over a mesh below (each device runs them on one kv head of two query heads, the
# grouping of the single-device model) and on one device on the Dream model against the Python
# reference (tests/test_dream_engine.py); the unrolled layer loop with XLA's ops is the GPU
# choice's loop with other ops, each of them checked in the scanned loops.
@pytest.mark.parametrize(
    "decode, variants",
    [(FLASH_VERIFY, ("gpu-auto",)), (FAST_DLLM, ("pallas",))],
    ids=["flash_verify", "fast_dllm_dual"],
)
@pytest.mark.integration  # full tier: the interpreted kernels inside the decode loop
def test_pallas_backends_decode_like_xla(xla_answers, decode, variants):
    cfg, params, prompts = _kernel_sized_model()
    xla = xla_answers(decode)
    assert xla.stats.tokens_per_step > 1.05
    make = {
        "pallas": lambda: Engine(cfg, params, backend="pallas", interpret=True),
        # over per-layer weights (unrolled layer loop)
        "gpu-auto": lambda: Engine(cfg, params, backend=GPU_AUTO, interpret=True, unroll_layers=True),
    }
    for name in variants:
        out = make[name]().generate(prompts, SAMPLING[decode.method], decode_config=decode)
        assert [r.token_ids for r in out.results] == [r.token_ids for r in xla.results], name
        assert [r.steps for r in out.results] == [r.steps for r in xla.results], name


@pytest.mark.parametrize(
    "spec,backend,decode",
    [("data=2,tensor=2", "pallas", FLASH_VERIFY), ("tensor=2", GPU_AUTO, FAST_DLLM)],
    ids=["data2-tensor2-pallas-verify", "tensor2-gpu_auto-fast_dllm"],
)
@pytest.mark.integration  # full tier: the interpreted kernels inside the decode loop
def test_kernels_run_on_each_devices_slots_and_heads(xla_answers, spec, backend, decode):
    """Under a mesh each device runs the kernels on its own slots and heads (shard_map)."""
    cfg, params, prompts = _kernel_sized_model()
    mesh = parse_mesh(spec, jax.devices()[: 4 if "data" in spec else 2])
    xla = xla_answers(decode)
    engine = Engine(cfg, params, backend=backend, interpret=True, unroll_layers=backend == GPU_AUTO, mesh=mesh)
    out = engine.generate(prompts, SAMPLING[decode.method], decode_config=decode)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in xla.results]
    assert [r.steps for r in out.results] == [r.steps for r in xla.results]


@pytest.mark.kernels
@pytest.mark.parametrize("backend", ["pallas", "xla", "gpu-auto"])
def test_decode_loop_lowers_for_cuda_at_llada_8b_shapes(backend):
    """The whole jitted loop (flash_cache + verify) at the real shapes, lowered for CUDA on the CPU:
    a kernel or shape the Triton backend rejects inside the engine fails here."""
    from dllm_jax.models.config import llada_8b_config

    text = lower_decode_loop_for_cuda(llada_8b_config(), backend)
    triton_calls = text.count("__gpu$xla.gpu.triton")
    # distinct kernel instances (each jitted kernel is one function however often it is called):
    # full and sparse pass, projection (pallas) or scatter (gpu-auto) + attention each; verify
    # attention; the top-p/top-k cutoffs
    assert triton_calls == {"pallas": 6, "xla": 0, "gpu-auto": 6}[backend]
    assert ("top_p_top_k_cutoff_reference" in text) == (backend == "xla")
    assert ("scatter_kv_rows" in text) == (backend == "gpu-auto")
