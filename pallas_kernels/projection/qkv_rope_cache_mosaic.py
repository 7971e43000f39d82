"""Fused q/k/v projection + rotate-half RoPE + K/V cache write on Hopper (Pallas Mosaic GPU).

The Mosaic GPU version of ``pallas_kernels.projection.qkv_rope_cache`` (same signature, same reference):
one launch per layer computes ``x @ w`` tile by tile with wgmma from TMA-fed shared memory
(a multi-stage pipeline over the model dimension), adds the biases, rotates q and k in the
float32 accumulator, rounds once, stores q tiles to the q output and scatters k / v rows
straight into their flat cache rows. No q/k/v product touches HBM in float32 and k / v are
never materialised outside the cache.

Tiling. A program owns ``compute_wgs * block_rows`` query rows and one head (``head_dim``
columns) of one projection; the grid is (row tiles, H + 2 * KVH heads). With two compute
warpgroups a third, memory warpgroup streams the x and w tiles through the stages
(plgpu.emit_pipeline_warp_specialized) and both compute warpgroups share each weight tile.
Each warpgroup's accumulator is [block_rows, Dh] float32 in the wgmma register layout;
rotate-half pairs column i with column i + Dh/2 of the same accumulator, two register
slices, so RoPE needs no shuffle. cos / sin of the rows' angles come in as [N, Dh/2] float32
tables (computed by XLA with the reference's own formula; identical across the layers of a
step), read from GMEM into registers: before the pipeline for 64-row warpgroups, chunk by
chunk in the epilogue (64 rows at a time) for taller ones.

Cache write. Hopper's TMA has no row scatter, so each of the program's rows is one
[1, Dh] bulk copy from the rounded tile in shared memory to ``cache[layer, cache_rows[r],
head columns]``, issued asynchronously; the program awaits them before it exits.

FP8 (``qkv_rope_cache_mosaic_fp8``): the same kernel with e4m3 operands (x quantized per row by
its producer, weights per output channel, [out, in] as stored by dllm_jax.models.quantization);
the accumulator is scaled by row scale x column scale in the epilogue, before the biases and
RoPE, as the reference does.

Performance (one H200, LLaDA-8B layer shapes, 128 rows per slot, default tilings,
scripts/gpu/bench_fused_projection.py, 2026-12-02; "xla" = cuBLAS GEMMs + XLA RoPE + the
Pallas row scatter, fp8 with XLA's activation quantization):

  slots   bf16 xla / kernel us   ratio   fp8 xla / kernel us   ratio
  1       46.1 / 46.5            0.99    46.7 / 31.0           1.51
  8       188.4 / 194.6          0.97    125.9 / 142.3         0.89
  32      647.2 / 778.9          0.83    430.4 / 508.9         0.85

(1 slot from the first run, 8 and 32 from the second.) The kernel reaches 530 TFLOP/s bf16
and 810 FP8 at 32 slots against cuBLAS's ~640 and ~960, so backend "auto" keeps the XLA
projections; it wins only where the step is bound by streaming the weights (FP8, one slot).

Requirements: a Hopper GPU (sm_90) and jax >= 0.10.2 (CPU tests: Mosaic GPU's interpreter,
``interpret=True``); head_dim a multiple of 64 (at most 256), d_model a multiple of
block_d, bfloat16 (or float8_e4m3fn) operands.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import as_int32, cdiv, check_shape
from pallas_kernels.projection.qkv_rope_cache import _biases, _check_args, _safe_rows
from pallas_kernels.projection.rope import apply_rope, rope_cos_sin

FP8 = jnp.dtype(jnp.float8_e4m3fn)
# plgpu.load's index argument: required in jax 0.10, deprecated (ref.at[...] instead) in 0.11
_LOAD_TAKES_INDEX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


@dataclasses.dataclass(frozen=True)
class MosaicQKVBlockSizes:
    """Tiling of the Mosaic GPU projection.

    Attributes:
      block_rows: query rows per compute warpgroup, a multiple of 64 (wgmma's M); a program
        owns compute_wgs * block_rows rows.
      block_d: reduction tile over the model dimension (BK), a multiple of 64.
      max_concurrent_steps: pipeline depth (shared-memory stages of the x and w tiles).
      compute_wgs: 1 = one warpgroup issues the copies and the wgmmas (plgpu.emit_pipeline);
        2 = two compute warpgroups share each weight tile, fed by a third, memory
        warpgroup (plgpu.emit_pipeline_warp_specialized).
      wgmma_in_flight: wgmma groups a step leaves running (0 or 1); with 1 a step's tiles are
        released one step later, so the tensor cores work while the next step is issued.
    """

    block_rows: int = 64
    block_d: int = 64
    max_concurrent_steps: int = 4
    compute_wgs: int = 2
    wgmma_in_flight: int = 1

    def __post_init__(self):
        if not isinstance(self.block_rows, int) or self.block_rows <= 0 or self.block_rows % 64:
            raise ValueError(f"block_rows={self.block_rows!r}: expected a positive multiple of 64")
        if not isinstance(self.block_d, int) or self.block_d <= 0 or self.block_d % 64:
            raise ValueError(f"block_d={self.block_d!r}: expected a positive multiple of 64")
        if not isinstance(self.max_concurrent_steps, int) or not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps!r}: expected an int in [2, 8]")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"compute_wgs={self.compute_wgs!r}: expected 1 or 2")
        if self.wgmma_in_flight not in (0, 1) or self.wgmma_in_flight >= self.max_concurrent_steps:
            raise ValueError(f"wgmma_in_flight={self.wgmma_in_flight!r}: expected 0 or 1")

    @property
    def program_rows(self) -> int:
        return self.compute_wgs * self.block_rows


def default_mosaic_block_sizes(dtype, n_rows: int) -> MosaicQKVBlockSizes:
    """The measured best of the tilings tried for N rows (H200, LLaDA-8B shapes, 2026-12-02,
    scripts/gpu/bench_fused_projection.py): 128-byte reduction tiles (the widest TMA swizzle)
    of the operand dtype, two compute warpgroups per program; up to one slot's 128 rows,
    64 rows each, every wgmma awaited at once (bf16 46.5 us, fp8 31.0 us; one warpgroup of 64
    rows, 192 programs: 47.9 / 34.2 us); more rows, 128 rows each with one wgmma group in
    flight (8 / 32 slots: bf16 195 / 779 us, fp8 142 / 509 us; 64 rows awaited at once:
    228 / 912 and 155 / 570 us)."""
    block_d = 128 if jnp.dtype(dtype) == FP8 else 64
    if n_rows <= 128:
        return MosaicQKVBlockSizes(
            block_rows=64, block_d=block_d, max_concurrent_steps=4, compute_wgs=2, wgmma_in_flight=0
        )
    return MosaicQKVBlockSizes(
        block_rows=128, block_d=block_d, max_concurrent_steps=3, compute_wgs=2, wgmma_in_flight=1
    )


def interpret_params():
    """The Mosaic GPU interpreter's parameters (public in jax 0.11, private in 0.10)."""
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _transposed(ref):
    """The [K, N] view of a [N, K] shared-memory tile (the wgmma B operand, K-major)."""
    if "transpose_ref" in vars(plgpu):  # jax 0.10; deprecated in 0.11 in favour of ref.transpose
        return plgpu.transpose_ref(ref, (1, 0))
    return ref.transpose((1, 0))


def _load_gmem(ref, idx, layout, interpreted: bool):
    """ref[idx], from GMEM straight into registers in the given layout (a plain load: the
    wgmma layouts have no optimised GMEM path; these are small per-tile vectors and tables)."""
    if _LOAD_TAKES_INDEX:
        if interpreted:  # jax 0.10's interpreter has no rule for plgpu.load; layouts do not exist there
            return ref[idx]
        return plgpu.load(ref, idx, layout=layout, optimized=False)
    return plgpu.load(ref.at[idx], layout=layout, optimized=False)


def _swizzled(block_cols: int, dtype) -> tuple:
    """Tiling + swizzle transforms of a shared-memory tile with block_cols columns of dtype."""
    row_bytes = block_cols * jnp.dtype(dtype).itemsize
    swizzle = 128 if row_bytes % 128 == 0 else row_bytes
    if swizzle not in (32, 64, 128):
        raise ValueError(f"a tile row of {row_bytes} bytes cannot be swizzled (need a multiple of 32)")
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _kernel(
    *refs,
    fp8: bool,
    per_layer_weights: bool,
    interpreted: bool,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    d_model: int,
    blocks: MosaicQKVBlockSizes,
):
    """One (row tile, head) program; heads are [q heads | k heads | v heads]. per_layer_weights:
    the weights, scales and biases are one layer's ([1, ...]), the layer index is the cache's."""
    refs = iter(refs)
    layer_ref, rows_ref, cos_ref, sin_ref, x_ref = (next(refs) for _ in range(5))
    x_scale_ref = next(refs) if fp8 else None
    w_refs = tuple(next(refs) for _ in range(3))
    w_scale_refs = tuple(next(refs) for _ in range(3)) if fp8 else (None,) * 3
    b_refs = tuple(next(refs) for _ in range(3))
    k_cache_ref, v_cache_ref, q_ref = next(refs), next(refs), next(refs)
    tile_smem = next(refs)  # [wgs, BM, Dh]: each compute warpgroup's rounded tile

    bm, bk, half = blocks.block_rows, blocks.block_d, head_dim // 2
    specialized = blocks.compute_wgs > 1
    row_tile = lax.axis_index("rows")
    head = lax.axis_index("heads")
    layer = layer_ref[0]
    w_layer = 0 if per_layer_weights else layer
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    in_flight = blocks.wgmma_in_flight

    def specs(which: int, local_head):
        w = w_refs[which].at[w_layer]
        if fp8:  # w: [out, in], K-major tiles
            w_spec = plgpu.BlockSpec(
                (head_dim, bk), lambda k: (local_head, k), transforms=_swizzled(bk, w.dtype), delay_release=in_flight
            )
        else:  # w: [in, out]
            w_spec = plgpu.BlockSpec(
                (bk, head_dim),
                lambda k: (k, local_head),
                transforms=_swizzled(head_dim, w.dtype),
                delay_release=in_flight,
            )
        x_spec = plgpu.BlockSpec(
            (blocks.program_rows, bk),
            lambda k: (row_tile, k),
            transforms=_swizzled(bk, x_ref.dtype),
            delay_release=in_flight,
        )
        return [x_spec, w_spec], w

    def load_tables(row0):
        """cos / sin [64, Dh/2] of 64 rows from row0."""
        return tuple(_load_gmem(ref, (pl.ds(row0, 64),), plgpu.Layout.WGMMA, interpreted) for ref in (cos_ref, sin_ref))

    def early_tables(which: int, wg):
        """A 64-row warpgroup's tables, loaded before its pipeline runs (their latency hides
        behind it); taller tiles load theirs chunk by chunk in the epilogue (registers)."""
        return load_tables(row_tile * blocks.program_rows + wg * bm) if which < 2 and bm == 64 else None

    def epilogue(which: int, local_head, acc, tables, wg):
        """Scales, bias, RoPE, rounding and the stores of one warpgroup's [BM, Dh] accumulator,
        in chunks of 64 rows."""
        row0 = row_tile * blocks.program_rows + wg * bm
        cols = pl.ds(local_head * head_dim, head_dim)
        out = (q_ref, k_cache_ref, v_cache_ref)[which]
        tile = tile_smem.at[wg]
        if fp8:
            w_scale = _load_gmem(w_scale_refs[which], (w_layer, cols), col_layout, interpreted)
        bias = _load_gmem(b_refs[which], (w_layer, cols), col_layout, interpreted).astype(jnp.float32)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile's previous copies have read it
        for chunk in range(bm // 64):
            part = acc[chunk * 64 : (chunk + 1) * 64]
            if fp8:
                x_scale = _load_gmem(x_scale_ref, (pl.ds(row0 + chunk * 64, 64),), row_layout, interpreted)
                part = part * lax.broadcast_in_dim(x_scale, part.shape, [0])
                part = part * lax.broadcast_in_dim(w_scale, part.shape, [1])
            part = part + lax.broadcast_in_dim(bias, part.shape, [1])
            first, second = part[:, :half], part[:, half:]
            if which < 2:  # rotate-half RoPE of q and k
                cos, sin = tables if tables is not None else load_tables(row0 + chunk * 64)
                first, second = first * cos - second * sin, second * cos + first * sin
            rows = pl.ds(chunk * 64, 64)
            tile.at[rows, :half][...] = first.astype(out.dtype)
            tile.at[rows, half:][...] = second.astype(out.dtype)
        plgpu.commit_smem()
        if which == 0:
            plgpu.copy_smem_to_gmem(tile, q_ref.at[pl.ds(row0, bm), cols])
        else:
            # Hopper's TMA has no row scatter: one bulk copy per cache row
            @pl.loop(0, bm)
            def _row(r):
                plgpu.copy_smem_to_gmem(tile.at[pl.ds(r, 1)], out.at[layer, pl.ds(rows_ref[row0 + r], 1), cols])

    def project_single(which: int, local_head):
        in_specs, w = specs(which, local_head)
        tables = early_tables(which, 0)

        def accumulate(acc_ref):
            def step(_, x_tile, w_tile):
                plgpu.wgmma(acc_ref, x_tile, _transposed(w_tile) if fp8 else w_tile)
                plgpu.wgmma_wait(in_flight)  # the tiles released by this step are no longer read

            plgpu.emit_pipeline(
                step, grid=(d_model // bk,), in_specs=in_specs, max_concurrent_steps=blocks.max_concurrent_steps
            )(x_ref, w)
            return acc_ref[...]

        epilogue(which, local_head, pl.run_scoped(accumulate, plgpu.ACC((bm, head_dim), jnp.float32)), tables, 0)

    def project_specialized(which: int, local_head):
        in_specs, w = specs(which, local_head)

        def step(_, x_tile, w_tile, acc_ref):
            x_rows = x_tile.at[pl.ds(lax.axis_index("wg") * bm, bm)]
            plgpu.wgmma(acc_ref, x_rows, _transposed(w_tile) if fp8 else w_tile)
            plgpu.wgmma_wait(in_flight)
            return acc_ref

        def compute_context(run_pipeline):
            wg = lax.axis_index("wg")
            tables = early_tables(which, wg)

            def accumulate(acc_ref):
                run_pipeline(acc_ref)
                return acc_ref[...]

            epilogue(which, local_head, pl.run_scoped(accumulate, plgpu.ACC((bm, head_dim), jnp.float32)), tables, wg)

        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(d_model // bk,),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=blocks.compute_wgs,
            max_concurrent_steps=blocks.max_concurrent_steps,
            compute_context=compute_context,
        )(x_ref, w)

    project = project_specialized if specialized else project_single
    pl.when(head < n_heads)(lambda: project(0, head))
    pl.when((head >= n_heads) & (head < n_heads + n_kv_heads))(lambda: project(1, head - n_heads))
    pl.when(head >= n_heads + n_kv_heads)(lambda: project(2, head - n_heads - n_kv_heads))
    plgpu.wait_smem_to_gmem(0)


def supports_fp8(d_model: int, head_dim: int, cache_dtype: Any) -> bool:
    """Whether qkv_rope_cache_mosaic_fp8 takes a model of these widths and cache dtype with its
    default tilings (head_dim a multiple of 64 up to 256, d_model of the 128-column reduction
    tile, bfloat16 caches)."""
    block_d = default_mosaic_block_sizes(FP8, 1).block_d
    return head_dim % 64 == 0 and head_dim <= 256 and d_model % block_d == 0 and jnp.dtype(cache_dtype) == jnp.bfloat16


def _check_mosaic_args(x, head_dim, d_model, blocks):
    if head_dim % 64 or head_dim > 256:
        raise ValueError(f"head_dim={head_dim}: the Mosaic GPU kernel needs a multiple of 64, at most 256")
    if d_model % blocks.block_d:
        raise ValueError(f"block_d={blocks.block_d} must divide d_model = {d_model}")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), FP8):
        raise ValueError(f"x.dtype={x.dtype}: the Mosaic GPU kernel takes bfloat16 or float8_e4m3fn operands")


def _run(
    x,
    x_scale,
    weights,
    w_scales,
    biases,
    positions,
    cache_rows,
    k_cache,
    v_cache,
    layer,
    *,
    n_heads,
    n_kv_heads,
    head_dim,
    rope_theta,
    out_dtype,
    interpret,
    blocks,
):
    """Pads the rows to whole tiles, builds the cos / sin tables and launches the kernel."""
    fp8 = x_scale is not None
    n_rows, d_model = x.shape
    n_cache_rows = k_cache.shape[1]
    positions = as_int32("positions", positions, (n_rows,))
    cache_rows = _safe_rows(as_int32("cache_rows", cache_rows, (n_rows,)), n_cache_rows)
    layer = as_int32("layer", layer, ()).reshape(1)
    padded = cdiv(n_rows, blocks.program_rows) * blocks.program_rows
    pad = padded - n_rows
    if pad:
        # the padding rows write the trash row M-1 and are dropped from q
        x = jnp.pad(x, ((0, pad), (0, 0)))
        positions = jnp.pad(positions, (0, pad))
        cache_rows = jnp.pad(cache_rows, (0, pad), constant_values=n_cache_rows - 1)
        if fp8:
            x_scale = jnp.pad(x_scale, (0, pad), constant_values=1.0)
    cos, sin = rope_cos_sin(positions, head_dim, rope_theta)
    wgs = blocks.compute_wgs
    operands = [layer, cache_rows, cos, sin, x, *([x_scale] if fp8 else []), *weights, *w_scales, *biases]
    k_ref = jax.new_ref(k_cache, memory_space=plgpu.GMEM)
    v_ref = jax.new_ref(v_cache, memory_space=plgpu.GMEM)

    def entry(*refs):
        pl.run_scoped(
            lambda *scratch: _kernel(
                *refs,
                *scratch,
                fp8=fp8,
                per_layer_weights=weights[0].shape[0] == 1,
                interpreted=interpret,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                d_model=d_model,
                blocks=blocks,
            ),
            plgpu.SMEM((wgs, blocks.block_rows, head_dim), out_dtype),
            **(dict(collective_axes="wg") if wgs > 1 else {}),
        )

    threads = dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}
    q = pl.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((padded, n_heads * head_dim), out_dtype),
        mesh=plgpu.Mesh(
            grid=(padded // blocks.program_rows, n_heads + 2 * n_kv_heads), grid_names=("rows", "heads"), **threads
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params() if interpret else False,
        name="qkv_rope_cache_mosaic",
    )(*operands, k_ref, v_ref)
    return q[:n_rows], k_ref[...], v_ref[...]


@functools.partial(
    jax.jit,
    static_argnames=("n_heads", "n_kv_heads", "rope_theta", "interpret", "block_sizes"),
    donate_argnames=("k_cache", "v_cache"),
)
def qkv_rope_cache_mosaic(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    positions: jax.Array,
    cache_rows: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    *,
    n_heads: int,
    n_kv_heads: int,
    rope_theta: float,
    interpret: bool = False,
    block_sizes: MosaicQKVBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``qkv_rope_cache`` (pallas_kernels.projection.qkv_rope_cache) as a Mosaic GPU kernel, bfloat16.

    Args and returns: as ``qkv_rope_cache``: x [N, D] bfloat16; wq [NL, D, H*Dh], wk / wv
    [NL, D, KVH*Dh]; positions, cache_rows int32 [N]; k_cache, v_cache [NL, M, KVH*Dh] bfloat16
    (donated, updated in place); layer int32 scalar; biases (bq, bk, bv) or None. Returns
    (q [N, H*Dh] bfloat16, k_cache, v_cache). interpret runs Mosaic GPU's interpreter (CPU).
    """
    d_model, head_dim = _check_args(x, wq, wk, wv, k_cache, v_cache, n_heads, n_kv_heads)
    blocks = block_sizes or default_mosaic_block_sizes(x.dtype, x.shape[0])
    _check_mosaic_args(x, head_dim, d_model, blocks)
    if x.dtype == FP8:
        raise ValueError("x.dtype=float8_e4m3fn: use qkv_rope_cache_mosaic_fp8 (it takes the scales)")
    if k_cache.dtype != x.dtype:
        raise ValueError(f"k_cache.dtype={k_cache.dtype}: expected x.dtype={x.dtype}")
    return _run(
        x,
        None,
        (wq, wk, wv),
        (),
        _biases(wq, wk, wv, biases),
        positions,
        cache_rows,
        k_cache,
        v_cache,
        layer,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        out_dtype=x.dtype,
        interpret=interpret,
        blocks=blocks,
    )


def _check_fp8_args(x, x_scale, weights, w_scales, k_cache, v_cache, n_heads, n_kv_heads):
    """Shapes / dtypes of the FP8 call; returns (D, Dh)."""
    if x.ndim != 2 or x.dtype != FP8:
        raise ValueError(f"x {x.shape} {x.dtype}: expected float8_e4m3fn [N, D]")
    n_rows, d_model = x.shape
    check_shape("x_scale", x_scale, (n_rows,))
    if x_scale.dtype != jnp.float32:
        raise ValueError(f"x_scale.dtype={x_scale.dtype}: expected float32")
    if not isinstance(n_heads, int) or not isinstance(n_kv_heads, int) or n_heads <= 0 or n_kv_heads <= 0:
        raise ValueError(f"n_heads={n_heads!r}, n_kv_heads={n_kv_heads!r}: expected positive ints")
    wq = weights[0]
    if wq.ndim != 3 or wq.shape[2] != d_model or wq.shape[1] % n_heads:
        raise ValueError(f"wq.shape={wq.shape}: expected [NL, n_heads * head_dim, {d_model}] (qkernel layout)")
    n_layers, head_dim = wq.shape[0], wq.shape[1] // n_heads
    kv_width = n_kv_heads * head_dim
    for name, w, s, width in zip(("wq", "wk", "wv"), weights, w_scales, (wq.shape[1], kv_width, kv_width)):
        check_shape(name, w, (n_layers, width, d_model))
        check_shape(f"{name} scale", s, (n_layers, width))
        if w.dtype != FP8 or s.dtype != jnp.float32:
            raise ValueError(f"{name} {w.dtype} / scale {s.dtype}: expected float8_e4m3fn / float32")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.ndim != 3 or n_layers not in (1, cache.shape[0]) or cache.shape[2] != kv_width:
            layers = "NL" if n_layers == 1 else n_layers
            raise ValueError(f"{name}.shape={cache.shape}: expected [{layers}, M, {kv_width}]")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or k_cache.dtype != jnp.bfloat16:
        raise ValueError(
            f"k_cache {k_cache.shape} {k_cache.dtype} / v_cache {v_cache.shape} {v_cache.dtype}: "
            "expected equal bfloat16 caches"
        )
    return d_model, head_dim


def _fp8_biases(weights, biases, dtype):
    """(bq, bk, bv) [NL, width] in dtype; zeros for a model without q/k/v biases."""
    if biases is None:
        return tuple(jnp.zeros(w.shape[:2], dtype) for w in weights)
    if len(biases) != 3:
        raise ValueError(f"biases: expected (bq, bk, bv), got {len(biases)} arrays")
    for name, b, w in zip(("bq", "bk", "bv"), biases, weights):
        check_shape(name, b, w.shape[:2])
    return tuple(b.astype(dtype) for b in biases)


_FP8_STATIC = ("n_heads", "n_kv_heads", "rope_theta", "interpret", "block_sizes")


@functools.partial(jax.jit, static_argnames=_FP8_STATIC, donate_argnames=("k_cache", "v_cache"))
def qkv_rope_cache_mosaic_fp8(
    x: jax.Array,
    x_scale: jax.Array,
    weights: tuple[jax.Array, jax.Array, jax.Array],
    w_scales: tuple[jax.Array, jax.Array, jax.Array],
    positions: jax.Array,
    cache_rows: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    *,
    n_heads: int,
    n_kv_heads: int,
    rope_theta: float,
    interpret: bool = False,
    block_sizes: MosaicQKVBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The FP8 (W8A8) fused projection: one e4m3 x e4m3 GEMM per tile, scales, biases and
    RoPE in the float32 epilogue, k / v rows into the bfloat16 cache.

    Args:
      x: float8_e4m3fn [N, D] rows quantized per row (x ~= x * x_scale[:, None]), as the
        producer kernel (rms_norm_quantize) writes them.
      x_scale: float32 [N].
      weights: (wq [NL, H*Dh, D], wk, wv [NL, KVH*Dh, D]) float8_e4m3fn qkernels ([out, in],
        dllm_jax.models.quantization's layout), or one layer's ([1, ...]: per-layer weights,
        read whatever the layer index).
      w_scales: (sq [NL, H*Dh], sk, sv [NL, KVH*Dh]) float32 per-output-channel scales (NL as
        the weights').
      positions, cache_rows, layer: as qkv_rope_cache.
      k_cache, v_cache: bfloat16 [NL, M, KVH*Dh] (donated, updated in place).
      biases: (bq, bk, bv) [NL, width] (NL as the weights') or None; added in float32 after the
        scales.
    Returns:
      (q [N, H*Dh] bfloat16, k_cache, v_cache).
    """
    d_model, head_dim = _check_fp8_args(x, x_scale, weights, w_scales, k_cache, v_cache, n_heads, n_kv_heads)
    blocks = block_sizes or default_mosaic_block_sizes(x.dtype, x.shape[0])
    _check_mosaic_args(x, head_dim, d_model, blocks)
    return _run(
        x,
        x_scale,
        tuple(weights),
        tuple(w_scales),
        _fp8_biases(weights, biases, jnp.float32),
        positions,
        cache_rows,
        k_cache,
        v_cache,
        layer,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        out_dtype=k_cache.dtype,
        interpret=interpret,
        blocks=blocks,
    )


@functools.partial(jax.jit, static_argnames=_FP8_STATIC, donate_argnames=("k_cache", "v_cache"))
def qkv_rope_cache_mosaic_fp8_reference(
    x,
    x_scale,
    weights,
    w_scales,
    positions,
    cache_rows,
    k_cache,
    v_cache,
    layer,
    biases=None,
    *,
    n_heads,
    n_kv_heads,
    rope_theta,
    interpret=False,
    block_sizes=None,
):
    """Plain jnp ``qkv_rope_cache_mosaic_fp8``: float8 dots with float32 results, scaled by the
    row and column scales, biased, rotated, rounded once, scattered into the cache rows.
    ``interpret`` and ``block_sizes`` are accepted for signature parity and ignored."""
    del interpret, block_sizes
    _, head_dim = _check_fp8_args(x, x_scale, weights, w_scales, k_cache, v_cache, n_heads, n_kv_heads)
    biases = _fp8_biases(weights, biases, jnp.float32)
    n_rows = x.shape[0]
    positions = as_int32("positions", positions, (n_rows,))
    cache_rows = _safe_rows(as_int32("cache_rows", cache_rows, (n_rows,)), k_cache.shape[1])
    layer = as_int32("layer", layer, ())
    w_layer = 0 if weights[0].shape[0] == 1 else layer
    cos, sin = rope_cos_sin(positions, head_dim, rope_theta)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def project(w, s, b):
        y = lax.dot_general(x, w[w_layer], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return (y * x_scale[:, None] * s[w_layer][None, :] + b[w_layer][None, :]).reshape(n_rows, -1, head_dim)

    (wq, wk, wv), (sq, sk, sv), (bq, bk, bv) = weights, w_scales, biases
    q = apply_rope(project(wq, sq, bq), cos, sin).reshape(n_rows, -1)
    k = apply_rope(project(wk, sk, bk), cos, sin).reshape(n_rows, -1)
    v = project(wv, sv, bv).reshape(n_rows, -1)
    k_cache = k_cache.at[layer, cache_rows].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, cache_rows].set(v.astype(v_cache.dtype))
    return q.astype(k_cache.dtype), k_cache, v_cache
