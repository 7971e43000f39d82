"""The seam between the model's per-layer ops and the Pallas kernels.

The kernels take the full layer-stacked weights and caches plus the layer index, so no
per-layer slice is materialised inside the layer scan. Under a mesh with a tensor axis each
device runs the kernels on its own heads (shard_map over that axis: GSPMD cannot split a
kernel); the data axis is already manual around the whole step (decode_loop).

Backends: "xla" runs every op through XLA (any device); "pallas" runs the fused projection
+ RoPE + cache write and the cache attention as Pallas kernels; "auto" picks per op what
measured fastest on the device (BENCHMARKS.md, H200, LLaDA-8B layer shapes, 1/8/32 slots):
the attention kernel (1.4x-12x faster than XLA's and cuDNN's paths) and the K/V row scatter
(XLA's scatter ran at 0.23 TB/s), but XLA's cuBLAS projections (the fused projection kernel
was 0.5x-0.9x their speed; its Mosaic GPU version, pallas_kernels.projection.qkv_rope_cache_mosaic, bf16 0.99x /
0.97x / 0.83x and FP8 1.51x / 0.89x / 0.85x at 1 / 8 / 32 slots, 2026-12-02), and XLA's
per-row quantization of fp8 models' activations (the producers with the quantization in their
epilogue, Kernels.fp8_producers, and with them the FP8 Mosaic kernel at one slot's sparse step,
measured in the step: 0.998x at 32 slots and 1.037x at 8 of the XLA path's time, H200
2026-12-03, scripts/gpu/fp8_step.py; opt-in); the routed experts' grouped GEMMs
(pallas_kernels.matmul.grouped_matmul: XLA:GPU rewrites jax.lax.ragged_dot into a dense
product with every expert; the kernel ran 9-40x faster at 26B-A4B's 1 and 8 slots' rows, and the
step 23.5 / 74.6 / 260.5 ms against 177.5 / 1305 / out of memory at 1 / 8 / 32 slots, H200
2026-12-03); DiffusionGemma's denoising stage by the canvas sampler kernel
(pallas_kernels.sampling.canvas_sampler: about 4-5 ms of a 32-slot 26B-A4B step by its bytes
against XLA's ~20 ms; measured 11.7 ms on the H200, 1.15x XLA's per slot: compute-bound,
scripts/gpu/canvas_sampler_kernel.py); DiffusionGemma's per-head q/k/v norms and RoPE by
pallas_kernels.norm.head_norm_rope (1.3-1.6x XLA's passes alone; the 26B-A4B step with it and
the one-product gated GEMM 178.6 against 181.2 ms at 32 slots, 55.6 against 55.7 at 8, H100
2026-12-07; 1 slot not measured); on a TPU the
Mosaic version of the attention kernel (never run on a real TPU: tested in interpret mode and
lowered for TPU on the CPU); pure XLA elsewhere
(CPUs, other GPUs), whose attention is chunked over keys (dllm_jax.runtime.chunked_attention).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.common import platform
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.layers import Fp8Producers
from dllm_jax.models.quantization import QuantizedRows
from dllm_jax.runtime.sharding import FLAT_HEADS, HEADS, REPLICATED, TENSOR, axis_size, per_tensor_shard

BACKENDS: tuple[str, ...] = ("auto", "xla", "pallas")

# fp8 models: passes of at most this many query rows run q/k/v + RoPE + the cache write as the
# Mosaic GPU FP8 kernel (pallas_kernels.projection.qkv_rope_cache_mosaic) on the producer's
# quantized rows (with Kernels.fp8_producers, on a Hopper GPU). One H200, LLaDA-8B layer, us per call
# (scripts/gpu/bench_fused_projection.py, 2026-12-02, BENCHMARKS.md); "xla" = cuBLASLt FP8
# GEMMs on pre-quantized rows + XLA's RoPE + the Pallas row scatter, what the fp8 path runs
# with the producers:
#   query rows (slots)   xla     kernel
#   128 (1)              41.5    31.0    the kernel, 1.34x
#   1024 (8)             111.2   142.3   xla
#   4096 (32)            402.6   508.9   xla
# Row counts in between (a 1-slot full pass: 640) were not measured and stay with XLA.
FP8_FUSED_QKV_ROWS = 128


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which per-layer ops run as Pallas kernels (the others run through XLA)."""

    qkv: bool = False
    attention: bool = False
    scatter: bool = False  # the K/V cache write of the XLA projection path
    interpret: bool = False
    mosaic: bool = False  # the attention kernel is the Pallas TPU (Mosaic) one, not the Triton one
    # per-slot top-p/top-k cutoffs by a kernel whose programs skip the rows that do not ask,
    # instead of a sort under a lax.cond (XLA:GPU reads a cond's predicate back to the host
    # at every step); not part of the name
    top_p_top_k: bool = False
    # batch-invariant mode (dllm_jax.runtime.batch_invariance): a row's result does not depend on
    # the other rows of the pass; matmul: its matmuls run as the Pallas kernel (else the jnp
    # reference)
    invariant: bool = False
    matmul: bool = False
    # the routed experts' grouped GEMMs (DiffusionGemma) by the Pallas grouped GEMM instead of
    # jax.lax.ragged_dot; not part of the name
    experts: bool = False
    # DiffusionGemma's denoising stage (argmax, entropy, the inverse-CDF sample, the finite
    # check and the self-conditioning softmax of each canvas row) by the canvas sampler kernel
    # (pallas_kernels.sampling.canvas_sampler: two reads of the LM head's model-dtype output and
    # one write, instead of XLA's float32 copies and about seven passes); not part of the name
    canvas_sampler: bool = False
    # DiffusionGemma's per-head q/k/v RMSNorm and RoPE by one kernel pass
    # (pallas_kernels.norm.head_norm_rope) instead of XLA's three or four; not part of the name
    head_norm: bool = False
    # DiffusionGemma's routed experts' weighted sum, the MoE block's three post-norms, the
    # residual and the layer scalar by one kernel pass (pallas_kernels.norm.moe_residual)
    # instead of XLA's two (with the [T, D] sum written between them); not part of the name
    moe_output: bool = False
    # DiffusionGemma's K/V cache writes by the row-scatter kernel
    # (pallas_kernels.projection.scatter_rows), which skips the rows a pass drops (a denoising
    # pass writes none), instead of XLA's scatter; not part of the name
    canvas_scatter: bool = False
    # fp8 models: each projection's input quantized once, in the epilogue of its producer (the
    # RMSNorms before q/k/v and gate/up, SwiGLU before down: layers.Fp8Producers) instead of
    # by XLA before every GEMM (pass_producers()); changes nothing for other models, so not part
    # of the name
    fp8_producers: bool = False
    # fp8 models with fp8_producers: passes of at most this many query rows run q/k/v + RoPE +
    # the cache write as the Mosaic GPU FP8 kernel where it takes the model (fused_fp8_qkv());
    # 0 = never
    fp8_fused_qkv_rows: int = 0

    def __post_init__(self):
        if not isinstance(self.fp8_fused_qkv_rows, int) or self.fp8_fused_qkv_rows < 0:
            raise ValueError(f"fp8_fused_qkv_rows={self.fp8_fused_qkv_rows!r}: expected an int >= 0")
        if self.fp8_fused_qkv_rows and not self.fp8_producers:
            raise ValueError("fp8_fused_qkv_rows needs fp8_producers (the kernel reads the producer's quantized rows)")

    @property
    def name(self) -> str:
        if self.qkv and self.attention:
            return "pallas"
        ops = (("qkv", self.qkv), ("attention", self.attention), ("scatter", self.scatter), ("matmul", self.matmul))
        used = [name for name, on in ops if on]
        name = "xla+pallas-" + "-".join(used) if used else "xla"
        name = name + "-tpu" if self.mosaic and used else name
        return name + "+invariant" if self.invariant else name


def resolve_kernels(backend: str | Kernels, interpret: bool = False, batch_invariant: bool = False) -> Kernels:
    """The Kernels a backend name stands for on this machine (a Kernels is taken as given),
    made batch-invariant when asked (``invariant_kernels``)."""
    kernels = _backend_kernels(backend, interpret)
    return invariant_kernels(kernels) if batch_invariant else kernels


def invariant_kernels(kernels: Kernels) -> Kernels:
    """The batch-invariant variant of a kernel choice: the invariant matmul as a Pallas kernel
    wherever the Triton kernels run, the XLA projections with the row-scatter kernel instead of
    the fused projection kernel (whose row tiling follows the row count), and the XLA path's
    attention instead of the Mosaic kernel (not checked for invariance)."""
    triton = (kernels.qkv or kernels.attention or kernels.scatter) and not kernels.mosaic
    return dataclasses.replace(
        kernels,
        invariant=True,
        qkv=False,
        attention=kernels.attention and not kernels.mosaic,
        scatter=kernels.scatter or kernels.qkv,
        mosaic=False,
        matmul=kernels.matmul or triton,
    )


def _backend_kernels(backend: str | Kernels, interpret: bool) -> Kernels:
    if isinstance(backend, Kernels):
        return dataclasses.replace(backend, interpret=backend.interpret or interpret)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend in ("auto", "pallas") and platform.on_tpu():
        # the only kernel with a TPU version
        return Kernels(attention=True, mosaic=True, interpret=interpret)
    if backend == "pallas":
        return Kernels(
            qkv=True,
            attention=True,
            top_p_top_k=True,
            experts=True,
            canvas_sampler=True,
            head_norm=True,
            moe_output=True,
            canvas_scatter=True,
            interpret=interpret,
        )
    if backend == "auto" and platform.on_nvidia_gpu():
        return Kernels(
            attention=True, scatter=True, top_p_top_k=True, experts=True, canvas_sampler=True, head_norm=True
        )
    return Kernels()


def pass_producers(config: ModelConfig, spec) -> Fp8Producers | None:
    """The producers a pass of an fp8 model quantizes its projections' inputs with
    (kernels.fp8_producers), or None (each projection quantizes its input in XLA). Not under a
    tensor axis: there a row's SwiGLU output is split across the devices, and its abs-max with it."""
    if not spec.kernels.fp8_producers or config.quantization != "fp8" or axis_size(spec.mesh, TENSOR) > 1:
        return None
    return Fp8Producers(interpret=spec.kernels.interpret)


def fused_fp8_qkv(config: ModelConfig, spec, n_rows: int) -> bool:
    """Whether a pass of n_rows query rows that writes the cache runs q/k/v + RoPE + the cache
    write as the Mosaic GPU FP8 kernel (fp8_qkv_to_cache): with the producers, at most
    kernels.fp8_fused_qkv_rows rows, a model the kernel takes (bfloat16, head_dim a multiple of 64)."""
    if pass_producers(config, spec) is None or n_rows > spec.kernels.fp8_fused_qkv_rows:
        return False
    from pallas_kernels.projection.qkv_rope_cache_mosaic import supports_fp8

    return supports_fp8(config.d_model, config.head_dim, config.jnp_dtype)


def fp8_qkv_to_cache(config: ModelConfig, spec, weights, x: QuantizedRows, positions, rows, k_cache, v_cache, layer):
    """The fused FP8 projection + RoPE + cache write of the quantized rows x [S, R, D] -> q
    [S, R, H, Dh] and the caches. weights: one layer's params (qkernel [out, in]) or the
    layer-stacked ones ([NL, out, in]: the kernel indexes the layer in place)."""
    from pallas_kernels.projection.qkv_rope_cache_mosaic import qkv_rope_cache_mosaic_fp8

    S, R, D = x.shape
    names = ("q_proj", "k_proj", "v_proj")
    one_layer = weights["q_proj"]["qkernel"].ndim == 2

    def leaves(name):
        leaf = tuple(weights[n][name] for n in names)
        return tuple(w[None] for w in leaf) if one_layer else leaf

    q, k_cache, v_cache = qkv_rope_cache_mosaic_fp8(
        x.rows.reshape(S * R, D),
        x.scale.reshape(S * R),
        leaves("qkernel"),
        leaves("scale"),
        positions.reshape(S * R),
        rows.reshape(S * R),
        k_cache,
        v_cache,
        jnp.int32(layer),
        leaves("bias") if config.qkv_bias else None,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        rope_theta=config.rope_theta,
        interpret=spec.kernels.interpret,
    )
    return q.reshape(S, R, config.n_heads, config.head_dim), k_cache, v_cache


def _implementation(kernels: Kernels, kernel: bool) -> str:
    """An op's implementation name ("xla", "pallas" or "interpret": GROUPED_GEMMS,
    CANVAS_ATTENTIONS, canvas_forward.IMPLEMENTATIONS): its kernel where ``kernel``, interpreted where asked."""
    if not kernel:
        return "xla"
    return "interpret" if kernels.interpret else "pallas"


def grouped_gemm(kernels: Kernels) -> str:
    """What runs the routed experts' grouped GEMMs (dllm_jax.models.experts.GROUPED_GEMMS)."""
    return _implementation(kernels, kernels.experts)


def canvas_attention(kernels: Kernels, mesh=None) -> str:
    """What runs DiffusionGemma's canvas attention (dllm_jax.runtime.canvas_attention.
    CANVAS_ATTENTIONS): the Triton cache-attention kernel wherever the Triton attention kernel
    runs (backend "auto" or "pallas" on an NVIDIA GPU), else XLA. Under a tensor axis XLA too:
    the kernel is not wired through per_tensor_shard for DiffusionGemma's caches yet."""
    return _implementation(kernels, kernels.attention and not kernels.mosaic and axis_size(mesh, TENSOR) <= 1)


def head_norm(kernels: Kernels, mesh=None) -> str:
    """What norms DiffusionGemma's q/k/v per head and rotates q and k
    (dllm_jax.runtime.canvas_forward.IMPLEMENTATIONS): the Triton kernel where the routing asks for
    it, else XLA; XLA too under a tensor axis (GSPMD cannot split a kernel over the heads)."""
    return _implementation(kernels, kernels.head_norm and axis_size(mesh, TENSOR) <= 1)


def moe_output(kernels: Kernels) -> str:
    """What ends DiffusionGemma's MoE block, the experts' sum through the residual
    (dllm_jax.runtime.canvas_forward.IMPLEMENTATIONS): the Triton kernel where the routing asks for
    it, else XLA (canvas_forward keeps XLA where a mesh splits the experts)."""
    return _implementation(kernels, kernels.moe_output)


def cache_write(kernels: Kernels, mesh=None) -> str:
    """What writes DiffusionGemma's K/V rows into its cache (dllm_jax.runtime.canvas_forward.
    IMPLEMENTATIONS): the row-scatter kernel where the routing asks for it, else XLA's scatter; XLA
    too under a tensor axis (the cache's columns are split by heads there)."""
    return _implementation(kernels, kernels.canvas_scatter and axis_size(mesh, TENSOR) <= 1)


def pallas_qkv_to_cache(config: ModelConfig, spec, stacked, x, positions, rows, k_cache, v_cache, layer):
    """Fused projection + RoPE + cache write for the rows of all groups: x [S, R, D] -> q [S, R, H, Dh]."""
    from pallas_kernels.projection.qkv_rope_cache import qkv_rope_cache

    S, R, D = x.shape
    tensor = axis_size(spec.mesh, TENSOR)
    # [NL, width] each (Dream's q/k/v biases), split by heads like the weights' columns
    biases = tuple(stacked[name]["bias"] for name in ("q_proj", "k_proj", "v_proj")) if config.qkv_bias else None

    def project(x, wq, wk, wv, positions, rows, k_cache, v_cache, layer, biases):
        return qkv_rope_cache(
            x,
            wq,
            wk,
            wv,
            positions,
            rows,
            k_cache,
            v_cache,
            layer,
            biases,
            n_heads=config.n_heads // tensor,
            n_kv_heads=config.n_kv_heads // tensor,
            rope_theta=config.rope_theta,
            interpret=spec.kernels.interpret,
        )

    project = per_tensor_shard(
        project,
        spec.mesh,
        in_specs=(
            REPLICATED,
            HEADS,
            HEADS,
            HEADS,
            REPLICATED,
            REPLICATED,
            HEADS,
            HEADS,
            REPLICATED,
            None if biases is None else (FLAT_HEADS,) * 3,
        ),
        out_specs=(FLAT_HEADS, HEADS, HEADS),
    )
    q, k_cache, v_cache = project(
        x.reshape(S * R, D),
        stacked["q_proj"]["kernel"],
        stacked["k_proj"]["kernel"],
        stacked["v_proj"]["kernel"],
        positions.reshape(S * R),
        rows.reshape(S * R),
        k_cache,
        v_cache,
        jnp.int32(layer),
        biases,
    )
    return q.reshape(S, R, config.n_heads, config.head_dim), k_cache, v_cache


def pallas_scatter_kv(spec, k_cache, v_cache, k, v, rows, layer):
    """Writes k, v [S, R, KVH, Dh] to their cache rows [S, R] of `layer`."""
    from pallas_kernels.projection.scatter_rows import scatter_kv_rows

    def scatter(k_cache, v_cache, k, v, rows, layer):
        return scatter_kv_rows(k_cache, v_cache, k, v, rows, layer, interpret=spec.kernels.interpret)

    scatter = per_tensor_shard(
        scatter,
        spec.mesh,
        in_specs=(HEADS, HEADS, FLAT_HEADS, FLAT_HEADS, REPLICATED, REPLICATED),
        out_specs=(HEADS, HEADS),
    )
    n = rows.size
    return scatter(k_cache, v_cache, k.reshape(n, -1), v.reshape(n, -1), rows.reshape(n), jnp.int32(layer))


def pallas_layer_attention(
    config: ModelConfig, spec, q, k_cache, v_cache, layer, group_slot, key_len, score_rows, verify, extra_kv
):
    """Attention of each group's rows over its slot's cache rows (plus verify's in-query keys)."""
    if spec.kernels.mosaic:
        from pallas_kernels.attention.cache_attention_tpu import cache_attention_tpu as cache_attention
    else:
        from pallas_kernels.attention.cache_attention import cache_attention

    S, R = q.shape[:2]
    tensor = axis_size(spec.mesh, TENSOR)
    slots = group_slot if group_slot is not None else jnp.arange(S, dtype=jnp.int32)
    if score_rows is None:
        score_rows = jnp.zeros((S, R), bool)
    key_exclude = extra = None
    if verify is not None:
        k_extra, v_extra = extra_kv
        key_exclude = verify.key_exclude
        extra = (k_extra.reshape(S, R, -1), v_extra.reshape(S, R, -1), verify.extra_mask)

    block_sizes = None
    if spec.kernels.invariant:
        from pallas_kernels.attention.cache_attention import default_attention_block_sizes

        # the default key split count grows when few groups leave SMs idle: fix it at 1
        block_sizes = dataclasses.replace(
            default_attention_block_sizes(S, R, config.n_heads // tensor, config.n_kv_heads // tensor, spec.max_len),
            num_splits=1,
        )

    def attend(q, k_cache, v_cache, layer, slots, key_len, score_rows, key_exclude, extra):
        out, scores = cache_attention(
            q,
            k_cache,
            v_cache,
            layer,
            slots,
            key_len,
            score_rows,
            n_heads=config.n_heads // tensor,
            n_kv_heads=config.n_kv_heads // tensor,
            max_len=spec.max_len,
            key_exclude=key_exclude,
            extra=extra,
            interpret=spec.kernels.interpret,
            block_sizes=block_sizes,
        )
        # each device summed the scores over its own heads
        return out, (jax.lax.psum(scores, TENSOR) if tensor > 1 else scores)

    extra_specs = None if extra is None else (HEADS, HEADS, REPLICATED)
    attend = per_tensor_shard(
        attend,
        spec.mesh,
        in_specs=(HEADS, HEADS, HEADS) + (REPLICATED,) * 5 + (extra_specs,),
        out_specs=(HEADS, REPLICATED),
    )
    out, scores = attend(
        q.reshape(S, R, -1), k_cache, v_cache, jnp.int32(layer), slots, key_len, score_rows, key_exclude, extra
    )
    return out, (scores if spec.score_scale is not None else None)
