"""Weight-only 8-bit GEMM for few rows on Hopper: y = x @ (qkernel * scale).T in Mosaic GPU.

x [M, K] bf16 against 8-bit weights qkernel [N, K] (int8, one row per output channel, the
layout of dllm_jax.models.quantization) with float32 scales [N]: each weight byte crosses HBM once,
is converted to bf16 in registers after the shared-memory load, and feeds a bf16 wgmma with
float32 accumulation; the channel's scale multiplies the accumulator once, in the epilogue.

The product is computed transposed, y.T [N, M] = W [N, K] @ x.T: the dequantized weights are
the wgmma's left operand, which Hopper takes from registers (so the converted tile is never
written back to shared memory), and the few rows of x become the wgmma's N side (8..256)
instead of its M side (64 at least). x's [rows, K] tile is read transposed by the wgmma
straight from shared memory. Each CTA has two compute warpgroups, each owning `tile_n`
output channels over the CTA's `tile_m` rows of x, and one memory warpgroup that streams the
[2 tile_n, tile_k] weight and [tile_m, tile_k] activation tiles through
`max_concurrent_steps` shared-memory stages (TMA, warp specialized).

Few rows leave few output tiles: [128, 4096] has 32 tiles of 128 channels for 132 SMs. So
`split_k` splits the reduction over that many work units per tile; each writes its float32
partial product (scaled) to its own plane of a [split_k, ...] output that XLA sums (the sum
fuses into the consumer of the product). The grid is persistent: one CTA per SM walks the
work units, the row tiles that share a weight tile next to each other.

The result leaves the kernel as y.T [N, M] (`transposed_out`) or, stored through a transposed
view of the epilogue's shared-memory tile, as y [M, N].

Requires: M a multiple of tile_m, N of 2 * tile_n, K of tile_k * split_k (`supports`; the
callers fall back to XLA otherwise). Only NVIDIA Hopper GPUs run it; `available()` says
whether the running JAX has the Mosaic GPU API it is written against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import NUM_SMS, check_power_of_two

try:
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _API = all(
        hasattr(plgpu, name)
        for name in (
            "kernel",
            "emit_pipeline_warp_specialized",
            "nd_loop",
            "ACC",
            "wgmma",
            "find_swizzle",
            "copy_smem_to_gmem",
        )
    )
except ImportError:  # pragma: no cover - depends on the installed jaxlib
    _API = False

WEIGHT_DTYPES = (jnp.int8,)
# jax 0.10.2 has the API but its layout inference cannot place the epilogue (the per-channel
# scale's broadcast, the transposing store): "Failed to infer a possible set of layouts"
MIN_JAX = (0, 11)


def available() -> bool:
    """Whether this JAX can build the kernel (lowering it does not need a GPU)."""
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    return _API and version >= MIN_JAX


def on_hopper_gpu() -> bool:
    """Whether the default device is an NVIDIA GPU of compute capability 9.x (wgmma)."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def runs_here() -> bool:
    """Whether the kernel can run here: available() and on_hopper_gpu()."""
    return available() and on_hopper_gpu()


@dataclasses.dataclass(frozen=True)
class WeightOnlyConfig:
    """Tiling of the weight-only GEMM.

    Attributes:
      tile_m: rows of x per work unit (the wgmma's N: a multiple of 8, at most 256).
      tile_n: output channels per compute warpgroup (64 or 128; the CTA has two).
      tile_k: reduction step per pipeline stage (64 or 128).
      max_concurrent_steps: shared-memory pipeline stages.
      split_k: work units per output tile, each over K / split_k (float32 partial products).
      transposed_out: return y.T [N, M] from the kernel (XLA transposes it back) instead of
        storing y [M, N] through a transposed shared-memory view. 32-bit results (float32
        partial products with split_k > 1, a float32 out_dtype) are always written as y.T:
        Hopper's transposing shared-memory store (stmatrix.trans) takes 16-bit values only.
    """

    tile_m: int = 128
    tile_n: int = 64
    tile_k: int = 128
    max_concurrent_steps: int = 4
    split_k: int = 1
    transposed_out: bool = False

    def __post_init__(self):
        if not isinstance(self.tile_m, int) or self.tile_m % 8 or not 8 <= self.tile_m <= 256:
            raise ValueError(f"tile_m={self.tile_m!r}: expected a multiple of 8 in [8, 256]")
        if self.tile_n not in (64, 128):
            raise ValueError(f"tile_n={self.tile_n!r}: expected 64 or 128")
        if self.tile_k not in (64, 128):
            raise ValueError(f"tile_k={self.tile_k!r}: expected 64 or 128")
        if not isinstance(self.max_concurrent_steps, int) or not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps!r}: expected an int in [2, 8]")
        check_power_of_two("split_k", self.split_k, 1)
        if not isinstance(self.transposed_out, bool):
            raise ValueError(f"transposed_out={self.transposed_out!r}: expected a bool")

    def kernel_dtype(self, out_dtype: Any) -> jnp.dtype:
        """The dtype the kernel writes: float32 partial products with split_k > 1, else out_dtype."""
        return jnp.dtype(jnp.float32) if self.split_k > 1 else jnp.dtype(out_dtype)

    def writes_transposed(self, out_dtype: Any = jnp.bfloat16) -> bool:
        """Whether the kernel writes y.T (see transposed_out)."""
        return self.transposed_out or self.kernel_dtype(out_dtype).itemsize != 2

    @property
    def name(self) -> str:
        split = f" k/{self.split_k}" if self.split_k > 1 else ""
        out = " T" if self.writes_transposed() else ""
        return f"m{self.tile_m} n2x{self.tile_n} k{self.tile_k} s{self.max_concurrent_steps}{split}{out}"

    def smem_bytes(self, out_dtype: Any = jnp.bfloat16) -> int:
        """Shared memory of the pipeline stages (int8 weights, bf16 x) and the epilogue tiles
        (two per compute warpgroup, in kernel_dtype)."""
        stage = 2 * self.tile_n * self.tile_k + self.tile_m * self.tile_k * 2
        epilogue = 2 * 2 * _epilogue_tile(self.tile_m) * 64 * self.kernel_dtype(out_dtype).itemsize
        return self.max_concurrent_steps * stage + epilogue


# a block's shared memory on Hopper (227 KiB) less the pipeline's barriers
_SMEM_LIMIT = 227 * 1024 - 1024


def _epilogue_tile(tile_m: int) -> int:
    return 64 if tile_m % 64 == 0 else tile_m


def default_config(m: int, n: int, k: int, out_dtype: Any = jnp.bfloat16) -> WeightOnlyConfig:
    """The tiling for [m, k] @ [n, k].T (H200, scripts/gpu/one_request.py --sweep, 2026-12-02).

    Below 512 rows, row tiles of up to 128 and K split until the work units fill the SMs (at
    [128, 4096] x [4096, 4096]: 20.0 us split in 4, 26.8 in 2 or 8, 38.1 unsplit). From 512
    rows on, 256-row tiles: each weight tile is read from L2 half as often (at 1024 rows of
    the same shape 55.6 us against 73.4 with 128-row tiles; the other shapes were not swept
    at 1024 rows). BK 128, the deepest pipeline that fits shared memory.
    """
    tile_m = 256 if m >= 512 and m % 256 == 0 else next((t for t in (128, 64, 32, 16, 8) if m % t == 0), 8)
    tile_n = 64
    tiles = (m // tile_m) * max(1, n // (2 * tile_n))
    split_k = 1
    while tiles * split_k * 2 <= NUM_SMS and k % (128 * split_k * 2) == 0:
        split_k *= 2
    config = WeightOnlyConfig(tile_m=tile_m, tile_n=tile_n, tile_k=128, max_concurrent_steps=4, split_k=split_k)
    while config.smem_bytes(out_dtype) > _SMEM_LIMIT and config.max_concurrent_steps > 2:
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


def supports(m: int, n: int, k: int, config: WeightOnlyConfig | None = None, out_dtype: Any = jnp.bfloat16) -> bool:
    """Whether the kernel takes these shapes with this tiling (default_config when None)."""
    if m < 1 or n < 1 or k < 1:
        return False
    config = config or default_config(m, n, k, out_dtype)
    return (
        m % config.tile_m == 0
        and n % (2 * config.tile_n) == 0
        and k % (config.tile_k * config.split_k) == 0
        and config.smem_bytes(out_dtype) <= _SMEM_LIMIT
    )


def _check(x, qkernel, scale, out_dtype):
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x {x.shape} {x.dtype}: expected bfloat16 [M, K]")
    if qkernel.ndim != 2 or qkernel.dtype not in WEIGHT_DTYPES or qkernel.shape[1] != x.shape[1]:
        raise ValueError(f"qkernel {qkernel.shape} {qkernel.dtype}: expected int8 [N, {x.shape[1]}]")
    if scale.shape != (qkernel.shape[0],) or scale.dtype != jnp.float32:
        raise ValueError(f"scale {scale.shape} {scale.dtype}: expected float32 [{qkernel.shape[0]}]")
    if not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
        raise ValueError(f"out_dtype={out_dtype}: expected a floating dtype")


def _transforms(minor: int, dtype: Any) -> tuple:
    """Tiling + swizzle of a shared-memory tile whose minor dimension has `minor` elements."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _weight_only_call(x, qkernel, scale, config: WeightOnlyConfig, out_dtype):
    """The Mosaic GPU kernel: float32 [split_k, ...] partial products (out_dtype when split_k == 1)."""
    (m, k), n = x.shape, qkernel.shape[0]
    tm, tn, tk, split = config.tile_m, config.tile_n, config.tile_k, config.split_k
    cta_n = 2 * tn
    m_iters, n_iters = m // tm, n // cta_n
    k_part = k // split
    k_iters = k_part // tk
    epi_m, epi_n = _epilogue_tile(tm), 64
    kernel_dtype = config.kernel_dtype(out_dtype)
    transposed = config.writes_transposed(out_dtype)
    w_transforms = _transforms(tk, qkernel.dtype)
    x_transforms = _transforms(tk, x.dtype)
    if transposed:  # epilogue tiles [channels, rows] of y.T
        out_shape = (n, m)
        epi_shape = (epi_n, epi_m)
        out_transforms = _transforms(epi_m, kernel_dtype)
    else:  # epilogue tiles [rows, channels] of y, written through a transposed view
        out_shape = (m, n)
        epi_shape = (epi_m, epi_n)
        out_transforms = _transforms(epi_n, kernel_dtype)
    if split > 1:
        out_shape = (split, *out_shape)

    def body(w_gmem, x_gmem, scale_gmem, out_gmem, out_smem, scale_smem, scale_barrier):
        def pipeline(pipeline_body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                pipeline_body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((cta_n, tk), lambda kk: (0, kk), transforms=w_transforms, memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=x_transforms, memory_space=plgpu.SMEM),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=config.max_concurrent_steps,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(ignore, ignore).get_allocations(w_gmem, x_gmem),
            collective_axes="wg",
        )
        def _scope(allocations):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((n_iters * m_iters * split,), collective_axes="sm")
            def _units(info):
                (unit,) = info.index
                # row tiles that share a weight tile run next to each other (L2 reuse)
                n_idx = unit // (m_iters * split)
                s_idx = (unit // m_iters) % split
                m_idx = unit % m_iters
                rows = pl.ds(m_idx * tm, tm)
                channels = pl.ds(n_idx * cta_n + wg * tn, tn)
                k_slice = pl.ds(s_idx * k_part, k_part)

                def compute_context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tn, tm), jnp.float32))
                    def _acc(acc_ref):
                        plgpu.copy_gmem_to_smem(scale_gmem.at[channels], scale_smem.at[wg], scale_barrier.at[wg])
                        run_pipeline(acc_ref)
                        plgpu.barrier_wait(scale_barrier.at[wg])
                        channel_scale = scale_smem[wg]
                        y_t = (acc_ref[...] * channel_scale[:, None]).astype(kernel_dtype)  # [tn, tm]
                        target = out_gmem.at[s_idx] if split > 1 else out_gmem
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for i in range(tn // epi_n):
                            for j in range(tm // epi_m):
                                slot = (i * (tm // epi_m) + j) % 2
                                tile = y_t[i * epi_n : (i + 1) * epi_n, j * epi_m : (j + 1) * epi_m]
                                c_slice = pl.ds(n_idx * cta_n + wg * tn + i * epi_n, epi_n)
                                r_slice = pl.ds(m_idx * tm + j * epi_m, epi_m)
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                if transposed:
                                    out_smem[wg, slot] = tile
                                    plgpu.commit_smem()
                                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], target.at[c_slice, r_slice])
                                else:
                                    out_smem.at[wg, slot].transpose((1, 0))[...] = tile
                                    plgpu.commit_smem()
                                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], target.at[r_slice, c_slice])

                def mma(_, w_smem, x_smem, acc_ref):
                    w = w_smem[pl.ds(wg * tn, tn)].astype(x.dtype)  # int8 -> bf16 in registers, exact
                    plgpu.wgmma(acc_ref, w, x_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc_ref

                pipeline(mma, compute_context)(
                    w_gmem.at[pl.ds(n_idx * cta_n, cta_n), k_slice],
                    x_gmem.at[rows, k_slice],
                    allocations=allocations,
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, kernel_dtype),
        grid=(NUM_SMS,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            out_smem=plgpu.SMEM((2, 2, *epi_shape), kernel_dtype, transforms=out_transforms),
            scale_smem=plgpu.SMEM((2, tn), jnp.float32),
            scale_barrier=plgpu.Barrier(num_barriers=2),
        ),
    )
    return call(qkernel, x, scale)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def weight_only_matmul(
    x: jax.Array,
    qkernel: jax.Array,
    scale: jax.Array,
    *,
    out_dtype: Any = jnp.bfloat16,
    config: WeightOnlyConfig | None = None,
) -> jax.Array:
    """x [M, K] bf16 @ (qkernel [N, K] int8 * scale [N] float32).T -> [M, N] in out_dtype.

    float32 accumulation; the channel's scale multiplies the accumulator before the one
    rounding to out_dtype (with split_k, the float32 partial products are summed first).
    ValueError for shapes, dtypes or a tiling that do not fit (see `supports`).
    """
    _check(x, qkernel, scale, out_dtype)
    (m, k), n = x.shape, qkernel.shape[0]
    config = config or default_config(m, n, k, out_dtype)
    if not supports(m, n, k, config, out_dtype):
        raise ValueError(
            f"x {x.shape} @ qkernel {qkernel.shape}: tiling {config.name} needs M % {config.tile_m}, "
            f"N % {2 * config.tile_n}, K % {config.tile_k * config.split_k} == 0 and fits shared memory"
        )
    if not available():
        raise ValueError("weight_only_matmul: this JAX has no Mosaic GPU API (jax.experimental.pallas.mosaic_gpu)")
    y = _weight_only_call(x, qkernel, scale, config, out_dtype)
    if config.split_k > 1:
        y = y.sum(0)
    if config.writes_transposed(out_dtype):
        y = y.T
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def weight_only_matmul_reference(
    x: jax.Array,
    qkernel: jax.Array,
    scale: jax.Array,
    *,
    out_dtype: Any = jnp.bfloat16,
    config: WeightOnlyConfig | None = None,
) -> jax.Array:
    """Pure jnp, same signature: the int8 weights converted to x's dtype, float32 accumulation,
    the scale on the accumulator, one rounding."""
    del config
    _check(x, qkernel, scale, out_dtype)
    y = lax.dot_general(x, qkernel.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype)
