"""Fused QKV + RoPE + cache-write kernel: interpret mode against the jnp reference on the CPU,
plus the CUDA (Triton) lowering at LLaDA-8B shapes."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from tolerances import assert_close

from pallas_kernels.projection.qkv_rope_cache import (
    QKVBlockSizes,
    default_qkv_block_sizes,
    qkv_rope_cache,
    qkv_rope_cache_reference,
)

THETA = 500000.0

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]


@dataclasses.dataclass
class Case:
    """Host-side inputs of one call (fresh device arrays per call: the caches are donated)."""

    x: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    positions: np.ndarray
    cache_rows: np.ndarray
    cache: np.ndarray  # [NL, M, KVH*Dh] float32 (NaN rows = never written before)
    dtype: jnp.dtype
    n_heads: int
    n_kv_heads: int

    def args(self, layer: int):
        as_dev = lambda a: jnp.asarray(a, self.dtype)  # noqa: E731
        return (
            as_dev(self.x),
            as_dev(self.wq),
            as_dev(self.wk),
            as_dev(self.wv),
            jnp.asarray(self.positions),
            jnp.asarray(self.cache_rows),
            as_dev(self.cache),
            as_dev(self.cache),
            jnp.int32(layer),
        )

    @property
    def kwargs(self):
        return dict(n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, rope_theta=THETA)


def make_case(
    seed, *, n_rows, d_model, n_heads, n_kv_heads, head_dim, dtype, n_layers=2, n_slots=3, max_len=48, n_padding=3
) -> Case:
    """Rows scattered over every slot of a flat cache (M = slots * max_len + 1), the last
    n_padding rows pointing at the trash row. Half the cache rows hold old finite values, the
    others (and the trash row) NaN, so a stray or missing write shows."""
    rng = np.random.default_rng(seed)
    n_cache_rows = n_slots * max_len + 1
    kv_width = n_kv_heads * head_dim
    weight = lambda width: rng.standard_normal((n_layers, d_model, width)) / np.sqrt(d_model)  # noqa: E731
    rows = rng.choice(n_cache_rows - 1, n_rows - n_padding, replace=False)
    rows = rng.permutation(np.concatenate([rows, np.full(n_padding, n_cache_rows - 1)])).astype(np.int32)
    cache = rng.standard_normal((n_layers, n_cache_rows, kv_width)).astype(np.float32)
    cache[:, rng.random(n_cache_rows) < 0.5] = np.nan
    cache[:, -1] = np.nan
    return Case(
        x=rng.standard_normal((n_rows, d_model)).astype(np.float32),
        wq=weight(n_heads * head_dim),
        wk=weight(kv_width),
        wv=weight(kv_width),
        positions=rng.integers(0, 4096, n_rows).astype(np.int32),
        cache_rows=rows,
        cache=cache,
        dtype=jnp.dtype(dtype),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
    )


def f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32))


def check_against_reference(case: Case, layer: int, block_sizes: QKVBlockSizes | None):
    q, k_cache, v_cache = qkv_rope_cache(*case.args(layer), **case.kwargs, interpret=True, block_sizes=block_sizes)
    q_ref, k_ref, v_ref = qkv_rope_cache_reference(*case.args(layer), **case.kwargs)
    assert q.shape == q_ref.shape and q.dtype == case.dtype
    assert_close(f32(q), f32(q_ref), case.dtype, "q")

    trash = case.cache.shape[1] - 1
    named = case.cache_rows[case.cache_rows != trash]
    # what the cache held before the call, in the cache dtype
    before = f32(jnp.asarray(case.cache, case.dtype))
    touched = np.zeros(case.cache.shape[:2], bool)
    touched[layer, named] = True
    touched[layer, trash] = True
    for name, got, want in (("k_cache", f32(k_cache), f32(k_ref)), ("v_cache", f32(v_cache), f32(v_ref))):
        assert np.isfinite(got[layer, named]).all(), f"{name}: a named row was not written"
        assert_close(got[layer, named], want[layer, named], case.dtype, name)
        assert np.array_equal(got[~touched], before[~touched], equal_nan=True), f"{name}: a row not named changed"


@pytest.mark.parametrize(
    "dtype, n_heads, n_kv_heads, head_dim, d_model, n_rows, blocks",
    [
        # grouped-query heads, rows not a multiple of the row tile, two rotary chunks per head
        ("float32", 4, 2, 64, 64, 40, QKVBlockSizes(16, 16, 32, num_warps=4, num_stages=2)),
        ("bfloat16", 4, 2, 64, 64, 40, QKVBlockSizes(32, 32, 64, num_warps=4, num_stages=2)),
        # equal q and kv heads, several reduction steps, the default tiling
        ("bfloat16", 2, 2, 32, 128, 24, None),
    ],
)
def test_kernel_matches_reference_and_writes_only_named_rows(
    dtype, n_heads, n_kv_heads, head_dim, d_model, n_rows, blocks
):
    case = make_case(
        0, n_rows=n_rows, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype
    )
    check_against_reference(case, layer=1, block_sizes=blocks)


def test_layer_zero_of_three_leaves_the_other_layers_alone():
    case = make_case(
        1, n_rows=16, d_model=64, n_heads=2, n_kv_heads=1, head_dim=64, dtype="float32", n_layers=3, n_padding=0
    )
    check_against_reference(case, layer=0, block_sizes=QKVBlockSizes(16, 32, 64, num_warps=4, num_stages=2))


def test_inside_a_layer_scan_each_layer_writes_its_own_rows():
    """The engine's use: lax.scan over layers, full stacked weights and caches, int32 layer index."""
    case = make_case(2, n_rows=16, d_model=64, n_heads=2, n_kv_heads=2, head_dim=32, dtype="float32", n_padding=1)
    blocks = QKVBlockSizes(16, 16, 32, num_warps=4, num_stages=2)

    def run(fn, interpret):
        x, wq, wk, wv, positions, rows, k_cache, v_cache, _ = case.args(0)
        extra = dict(interpret=True, block_sizes=blocks) if interpret else {}

        def layer_step(caches, layer):
            # a different input per layer, so a wrong layer index shows in the written rows
            q, k, v = fn(x * (layer + 1.0), wq, wk, wv, positions, rows, *caches, layer, **case.kwargs, **extra)
            return (k, v), q

        return jax.jit(lambda c: jax.lax.scan(layer_step, c, jnp.arange(2, dtype=jnp.int32)))((k_cache, v_cache))

    (k, v), qs = run(qkv_rope_cache, True)
    (k_ref, v_ref), qs_ref = run(qkv_rope_cache_reference, False)
    named = case.cache_rows[case.cache_rows != case.cache.shape[1] - 1]
    assert_close(f32(qs), f32(qs_ref), case.dtype, "q")
    for layer in range(2):
        assert_close(f32(k)[layer, named], f32(k_ref)[layer, named], case.dtype, f"k layer {layer}")
        assert_close(f32(v)[layer, named], f32(v_ref)[layer, named], case.dtype, f"v layer {layer}")


def test_invalid_arguments_raise_value_error_naming_them():
    case = make_case(3, n_rows=16, d_model=64, n_heads=2, n_kv_heads=2, head_dim=32, dtype="float32")
    args = case.args(0)
    with pytest.raises(ValueError, match="block_rows"):
        QKVBlockSizes(block_rows=48)
    with pytest.raises(ValueError, match="num_warps"):
        QKVBlockSizes(num_warps=3)
    with pytest.raises(ValueError, match="block_pairs"):
        qkv_rope_cache(*args, **case.kwargs, interpret=True, block_sizes=QKVBlockSizes(16, 32, 32))
    with pytest.raises(ValueError, match="wk.dtype"):
        qkv_rope_cache(args[0], args[1], args[2].astype(jnp.bfloat16), *args[3:], **case.kwargs, interpret=True)
    with pytest.raises(ValueError, match="cache_rows"):
        qkv_rope_cache(*args[:5], args[5][:-1], *args[6:], **case.kwargs, interpret=True)
    with pytest.raises(ValueError, match="positions.dtype"):
        qkv_rope_cache(*args[:4], args[4].astype(jnp.float32), *args[5:], **case.kwargs, interpret=True)
    with pytest.raises(ValueError, match="n_kv_heads"):
        qkv_rope_cache(*args, n_heads=2, n_kv_heads=3, rope_theta=THETA, interpret=True)


def test_default_tiling_fills_the_gpu_at_one_slot_and_keeps_whole_heads_at_32():
    columns = 3 * 32 * 128
    one_slot = default_qkv_block_sizes(128, 4096, 128, columns)
    assert one_slot.block_rows == 128 and one_slot.block_pairs == 32  # 192 programs
    assert default_qkv_block_sizes(4096, 4096, 128, columns).block_pairs == 64


@pytest.mark.parametrize("n_rows", [128, 4096])
def test_triton_lowering_at_llada_8b_shapes(n_rows):
    n_layers, d_model, heads, head_dim, n_cache_rows = 32, 4096, 32, 128, 32 * 2048 + 1
    bf16, i32 = jnp.bfloat16, jnp.int32
    spec = jax.ShapeDtypeStruct
    weight = spec((n_layers, d_model, heads * head_dim), bf16)
    cache = spec((n_layers, n_cache_rows, heads * head_dim), bf16)
    text = lower_for_cuda(
        qkv_rope_cache,
        spec((n_rows, d_model), bf16),
        weight,
        weight,
        weight,
        spec((n_rows,), i32),
        spec((n_rows,), i32),
        cache,
        cache,
        spec((), i32),
        n_heads=heads,
        n_kv_heads=heads,
        rope_theta=THETA,
    )
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert 'name = "qkv_rope_cache"' in text
    # both caches are donated and written in place
    assert sorted(re.findall(r"tf.aliasing_output = (\d+)", text)) == ["1", "2"]
