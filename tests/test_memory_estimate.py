"""The memory estimate of a decode configuration and its check against fake device limits."""

import dataclasses

import jax
import pytest
from conftest import tiny_config

from dllm_jax.models.config import llada_8b_config
from dllm_jax.policies.factory import make_policy
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.decode_loop import DecodeLoop
from dllm_jax.runtime.flat_cache import cache_bytes
from dllm_jax.runtime.kernel_routing import Kernels
from dllm_jax.runtime.memory_estimate import (
    DeviceMemory,
    InsufficientMemoryError,
    check_decode_loop,
    check_memory,
    device_memory,
    estimate_decode_loop,
    estimate_memory,
    fits,
    host_memory,
)

pytestmark = pytest.mark.unit

GIB = 2**30
SHAPE = dict(max_len=256, num_candidates=16, gen_length=64, queue_capacity=64, prompt_width=16)


def estimate(config=None, num_slots=8, **changes):
    return estimate_memory(config or tiny_config(), num_slots=num_slots, **{**SHAPE, **changes})


def test_weights_and_cache_are_what_the_model_and_the_cache_hold():
    cfg = tiny_config()
    e = estimate(cfg, num_slots=8)
    assert e.weights == cfg.num_params() * 4
    assert e.cache == cache_bytes(cfg, 8, 256)
    bf16 = estimate(dataclasses.replace(cfg, dtype="bfloat16"), num_slots=8)
    assert bf16.weights * 2 == e.weights and bf16.cache * 2 == e.cache


def test_terms_grow_with_what_they_depend_on():
    base = estimate(num_slots=8)
    double = estimate(num_slots=16)
    assert double.weights == base.weights
    assert double.cache == 2 * base.cache
    assert double.activations == 2 * base.activations and double.logits == 2 * base.logits
    # XLA attention's [lanes, H, L, L] logits: quadratic in max_len; the Pallas kernel keeps none
    long = estimate(num_slots=8, max_len=512)
    assert long.activations > 2 * base.activations
    pallas = estimate(num_slots=8, max_len=512, dense_attention=False)
    assert pallas.activations == 2 * estimate(num_slots=8, dense_attention=False).activations
    # fewer full-pass lanes, fewer activations; the logits are of every slot anyway
    lanes = estimate(num_slots=8, full_pass_lanes=2)
    assert lanes.activations == base.activations // 4 and lanes.logits == base.logits


def test_a_mesh_splits_the_terms_per_device():
    cfg = llada_8b_config()
    one = estimate(cfg, num_slots=8)
    split = estimate(cfg, num_slots=8, data=2, tensor=4)
    assert split.weights == one.weights // 4
    assert split.cache == one.cache // 8
    assert split.activations < one.activations / 2


def test_llada_8b_numbers_are_plausible():
    e = estimate(llada_8b_config(), num_slots=32, max_len=640, num_candidates=16)
    assert 16.0e9 < e.weights < 16.1e9  # 8.0 B parameters in bf16
    assert e.cache == 2 * 32 * 32 * 640 * 4096 * 2  # 10 GiB
    assert GIB < e.activations < 50 * GIB and e.logits < 2 * GIB


@pytest.mark.parametrize("method", ["flash_cache", "fast_dllm", "llada"])
def test_the_state_terms_match_the_decode_loop_state(method):
    cfg = tiny_config()
    decode = DecodeConfig(method=method, gen_length=64, batch_size=8)
    loop = DecodeLoop(model=cfg, policy=make_policy(decode, cfg, 256), num_slots=8, max_len=256, gen_length=64)
    exact = estimate_decode_loop(loop, queue_capacity=32, prompt_width=16)
    formula = estimate(cfg, num_slots=8, num_candidates=loop.policy.num_candidates, queue_capacity=32)
    assert exact.cache == formula.cache == cache_bytes(cfg, 8, 256)
    assert exact.state <= formula.state < 2 * exact.state  # the formula does not underestimate
    assert (exact.weights, exact.activations, exact.logits) == (formula.weights, formula.activations, formula.logits)
    with_kernels = estimate_decode_loop(
        dataclasses.replace(loop, kernels=Kernels(attention=True)), queue_capacity=32, prompt_width=16
    )
    assert with_kernels.activations < exact.activations


@pytest.mark.engine
def test_the_temporaries_bound_what_xla_assigns_to_the_compiled_loop():
    """The estimate of the loop's temporaries against XLA's buffer assignment: not below it,
    and not far above (a check that refused configurations that fit would be wrong too)."""
    from dllm_jax.engine.engine import Engine
    from dllm_jax.models.transformer import init_params

    cfg = tiny_config(vocab_size=1024, mask_token_id=1022, eos_token_id=1023, pad_token_id=1023, bos_token_id=1021)
    engine = Engine(cfg, init_params(cfg, jax.random.key(0)), backend="xla", full_pass_lanes=(8,))
    compiled = engine.compile(DecodeConfig(method="flash_cache", gen_length=64, batch_size=8), 20)
    xla_temp = compiled.call.memory_analysis().temp_size_in_bytes
    e = estimate_decode_loop(compiled.loop, queue_capacity=compiled.queue_capacity, prompt_width=compiled.prompt_width)
    assert xla_temp <= e.temporaries <= 1.5 * xla_temp, (xla_temp, e)


def test_check_decode_loop_refuses_a_loop_too_large_for_the_device():
    cfg = tiny_config()
    decode = DecodeConfig(method="flash_cache", gen_length=64, batch_size=10000)
    loop = DecodeLoop(model=cfg, policy=make_policy(decode, cfg, 256), num_slots=10000, max_len=256, gen_length=64)
    with pytest.raises(
        InsufficientMemoryError,
        match=r"^batch size 10000 with 256 positions per slot needs about .*"
        r"fake:0 has 1.0 GiB free: lower the batch size to \d+ or less",
    ):
        check_decode_loop(loop, queue_capacity=40000, prompt_width=16, memory=DeviceMemory(GIB, "fake:0"))
    small = dataclasses.replace(loop, num_slots=8)
    e = check_decode_loop(small, queue_capacity=32, prompt_width=16, memory=DeviceMemory(GIB, "fake:0"))
    assert e.total < GIB
    # the default reads the real device: the tiny loop fits this machine
    assert check_decode_loop(small, queue_capacity=32, prompt_width=16).total < GIB


def test_a_configuration_that_fits_passes():
    e = check_memory(tiny_config(), DeviceMemory(available=GIB, name="fake:0"), num_slots=8, **SHAPE)
    assert e.total < GIB


def test_too_many_slots_say_which_batch_size_fits():
    cfg = tiny_config()
    memory = DeviceMemory(available=2 * GIB, name="fake:0")
    with pytest.raises(InsufficientMemoryError) as raised:
        check_memory(cfg, memory, num_slots=10000, **SHAPE)
    message = str(raised.value)
    assert "\n" not in message
    assert "batch size 10000" in message and "fake:0 has 2.0 GiB free" in message and "K/V cache" in message
    suggested = int(message.split("lower the batch size to ")[1].split()[0])
    assert 1 <= suggested < 10000
    assert fits(estimate(cfg, suggested), memory, weights_resident=True)
    assert not fits(estimate(cfg, suggested + 1), memory, weights_resident=True)


def test_the_suggestion_is_a_multiple_of_the_data_axis():
    memory = DeviceMemory(available=GIB, name="fake:0")
    with pytest.raises(InsufficientMemoryError, match=r"lower the batch size to (\d+)") as raised:
        check_memory(tiny_config(), memory, num_slots=4096, data=4, **SHAPE)
    assert int(str(raised.value).split("batch size to ")[1].split()[0]) % 4 == 0


def test_when_not_even_one_slot_fits_it_says_to_lower_the_length():
    memory = DeviceMemory(available=8 * GIB, name="fake:0", includes_resident=False)
    with pytest.raises(InsufficientMemoryError, match="even one slot does not fit: lower the generation length"):
        check_memory(llada_8b_config(), memory, num_slots=4, weights_resident=False, **{**SHAPE, "max_len": 4096})


def test_resident_weights_are_not_counted_twice():
    cfg = llada_8b_config()
    e = estimate(cfg, num_slots=1)
    just_enough = DeviceMemory(available=int((e.total - e.weights) * 1.2), name="fake:0")
    assert fits(e, just_enough, weights_resident=True)
    assert not fits(e, just_enough, weights_resident=False)
    # a limit that does not subtract what is in use counts the weights either way
    assert not fits(e, dataclasses.replace(just_enough, includes_resident=False), weights_resident=True)


def test_cpu_devices_of_a_mesh_share_the_host_memory():
    e = estimate(num_slots=8)
    memory = DeviceMemory(available=int(e.total * 2), name="host RAM")
    assert fits(e, memory, weights_resident=False)
    assert not fits(e, dataclasses.replace(memory, shared_by=4), weights_resident=False)


class FakeDevice:
    platform, id = "gpu", 3

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_device_memory_reads_memory_stats():
    memory = device_memory(FakeDevice({"bytes_limit": 10 * GIB, "bytes_in_use": 3 * GIB}))
    assert memory == DeviceMemory(available=7 * GIB, name="gpu:3")


@pytest.mark.parametrize("stats", [None, {}, NotImplementedError("no stats")])
def test_without_memory_stats_the_host_memory_is_used(stats):
    memory = device_memory(FakeDevice(stats), devices=4)
    assert memory.name.startswith("host RAM") and memory.available > 0 and memory.shared_by == 4


def test_the_cpu_backend_reports_host_memory():
    memory = device_memory(jax.devices("cpu")[0])
    assert memory.name.startswith("host RAM") and memory.available > 0


def write_meminfo(proc, available_kb):
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kb} kB\n")


@pytest.mark.parametrize(
    "files,available,name",
    [
        ({}, 8 * GIB, "host RAM"),
        ({"memory.max": "max\n", "memory.current": "1000\n"}, 8 * GIB, "host RAM"),
        # a container limit of 4 GiB with 1 GiB used, 0.5 GiB of it reclaimable page cache
        (
            {
                "memory.max": f"{4 * GIB}\n",
                "memory.current": f"{GIB}\n",
                "memory.stat": f"anon 1\ninactive_file {GIB // 2}\n",
            },
            4 * GIB - GIB // 2,
            "host RAM (cgroup limit)",
        ),
        (
            {"memory/memory.limit_in_bytes": f"{2 * GIB}\n", "memory/memory.usage_in_bytes": f"{GIB}\n"},
            GIB,
            "host RAM (cgroup limit)",
        ),
        (
            {"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5\n"},
            8 * GIB,
            "host RAM",
        ),
        # a limit above the available RAM does not raise what is available
        ({"memory.max": f"{64 * GIB}\n", "memory.current": f"{GIB}\n"}, 8 * GIB, "host RAM"),
    ],
    ids=["no cgroup", "v2 unlimited", "v2 limit", "v1 limit", "v1 unlimited", "v2 above RAM"],
)
def test_host_memory_takes_the_lower_of_ram_and_the_cgroup_limit(tmp_path, files, available, name):
    write_meminfo(tmp_path / "proc", 8 * GIB // 1024)
    cgroup = tmp_path / "cgroup"
    for relative, text in files.items():
        (cgroup / relative).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / relative).write_text(text)
    assert host_memory(tmp_path / "proc", cgroup) == DeviceMemory(available=available, name=name)


def test_without_meminfo_sysconf_answers(tmp_path):
    memory = host_memory(tmp_path / "no-proc", tmp_path / "no-cgroup")
    assert memory.name == "host RAM" and memory.available > 0
