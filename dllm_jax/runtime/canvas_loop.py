"""The decode loop of block diffusion (DiffusionGemma): one jitted ``lax.while_loop`` over the slots.

The same loop as dllm_jax.runtime.decode_loop (its request ring, results ring, refill and
stopping rule, so GenerationSession drives both alike), with the canvas policy's step. Each
iteration advances every active slot by one pass of L rows (L = the canvas length):
  1. the policy names each slot's rows (dllm_jax.runtime.canvas_policy): a chunk of its prompt
     or its finished canvas to encode, or its canvas to denoise;
  2. one model pass over all of them (dllm_jax.runtime.canvas_forward): the encoder rows write
     the flat cache, the canvas rows read it;
  3. the canvas slots' logits (the tied LM head over their L rows) go through the policy's
     denoising step, and their softmax becomes the next step's self-conditioning input; the
     vocabulary-wide tensors of this stage are made for ``sampler_slots`` slots at a time
     (``lax.map`` over groups of slots), so they stay within SAMPLER_BUDGET_BYTES; with
     Kernels.canvas_sampler (``kernel_sampler``) the canvas sampler kernel computes the step's
     statistics and the softmax from the LM head's model-dtype output instead (the policy's
     ``step_inputs`` and ``denoise_with``);
  4. encoded slots move on (the next prompt chunk, or the next canvas);
  5. finished slots write their results and are refilled from the on-device request ring.
Per-request values (t_min, t_max, entropy_bound, max_denoising_steps, stability_threshold,
confidence_threshold, seed, max_new_tokens) are per-slot state (SlotSampling): every mix of
them shares one compiled loop.

With Flash-Cache on the canvas (the policy's cached_rows), step 2 is two passes, as the
decode loop's: the slots whose pass is a full one (an encoding, a canvas's first step) in a
batch of F "lanes", F the smallest of ``lane_sizes`` that fits them (``lax.switch``), and the
other denoising slots' sparse pass over cached_rows canvas rows each (dllm_jax.policies.canvas
picks them); both write the canvas rows' K/V into the cache rows past the encoded ones, and
the denoising stage reads every canvas row's last-layer output, fresh or kept.

With a mesh (dllm_jax.runtime.sharding), steps 2 and 3 and the slots' moves run per data shard
(shard_map over the data axis: each shard passes and denoises its own num_slots / data slots,
its lanes and sampler groups counted within it), the tensor axis split the layers and the
cache as GSPMD does for LLaDA, and the routed experts run on their expert x tensor devices
(dllm_jax.runtime.expert_sharding). Which passes run (the lane variant, the sparse pass, the
denoising stage) is decided over all slots, so every device takes the same branches; the
rings, the stopping rule and the refill see all slots, as in DecodeLoop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.diffusion_gemma_config import DiffusionGemmaConfig
from dllm_jax.runtime.canvas_cache import allocate_canvas_cache
from dllm_jax.runtime.canvas_forward import canvas_forward
from dllm_jax.runtime.canvas_policy import CanvasDecodePolicy, StepStatistics
from dllm_jax.runtime.canvas_slots import DENOISE, CanvasSlots, empty_canvas_slots, install_canvas_request
from dllm_jax.runtime.decode_loop import (
    DecodeState,
    RequestQueue,
    Results,
    _where_tree,
    empty_results,
    next_requests,
    record_results,
    run_while_work,
)
from dllm_jax.runtime.kernel_routing import (
    Kernels,
    cache_write,
    canvas_attention,
    grouped_gemm,
    head_norm,
    moe_output,
)
from dllm_jax.runtime.sharding import (
    CACHE_ROWS,
    DATA,
    EXPERT,
    REPLICATED,
    SLOTS,
    TENSOR,
    axis_size,
    per_data_shard,
)
from dllm_jax.runtime.slots import ERROR_NON_FINITE, ERROR_STEP_LIMIT, SlotSampling
from pallas_kernels.sampling.canvas_sampler import canvas_sampler

# Most bytes of the [slots, L, V] tensors of the denoising stage alive at once. In XLA's
# stage they are float32: the logits, the processed logits, their log-softmax and its exponent
# (the entropy), the sample's exponent and the softmax of the self-conditioning input
# (SAMPLER_F32_COPIES of them); at the 26B-A4B shape one slot's copy is 256 x 262144 x 4 bytes
# = 256 MiB, 1.5 GiB per slot, so groups of one slot. The canvas sampler kernel's stage holds
# KERNEL_SAMPLER_COPIES in the model dtype (the LM head's output and the probabilities): 256
# MiB per slot in bfloat16, so groups of 8 slots.
SAMPLER_BUDGET_BYTES = 2 << 30
SAMPLER_F32_COPIES = 6
KERNEL_SAMPLER_COPIES = 2


def sampler_group(num_slots: int, canvas_length: int, vocab_size: int, bytes_per_logit: int) -> int:
    """Slots per group of the denoising stage: the largest divisor of num_slots whose
    temporaries (bytes_per_logit for each of a slot's canvas_length x vocab_size logits) fit
    SAMPLER_BUDGET_BYTES (at least one)."""
    per_slot = bytes_per_logit * canvas_length * vocab_size
    fitting = [g for g in range(1, num_slots + 1) if num_slots % g == 0 and g * per_slot <= SAMPLER_BUDGET_BYTES]
    return max(fitting, default=1)


@dataclasses.dataclass(frozen=True)
class CanvasLoop:
    """A compiled-once block-diffusion loop for one (policy, slots, max_len) combination.

    gen_length: the results ring's width, the most canvases of a request times L.
    full_pass_lanes: with cached canvas rows, the batch sizes of the full pass's compiled
      variants besides all B slots of a data shard (None: 1 and B/4), as DecodeLoop's.
    mesh: decode over its devices (see the module doc; None: one device).
    """

    model: DiffusionGemmaConfig
    policy: CanvasDecodePolicy
    num_slots: int
    max_len: int
    gen_length: int
    kernels: Kernels = Kernels()
    full_pass_lanes: tuple[int, ...] | None = None
    mesh: Mesh | None = None
    cfg: bool = False  # no guidance pass (GenerationSession reads it)

    def __post_init__(self):
        if self.gen_length % self.policy.canvas_length:
            raise ValueError(f"gen_length={self.gen_length}: expected whole canvases of {self.policy.canvas_length}")

    @property
    def shard_slots(self) -> int:
        """Slots of one data shard (all of them without a mesh)."""
        return self.num_slots // axis_size(self.mesh, DATA)

    @property
    def lane_sizes(self) -> tuple[int, ...]:
        """The full pass's batch sizes per data shard with cached canvas rows (else the one
        pass of all its B slots)."""
        B = self.shard_slots
        if self.policy.cached_rows is None:
            return (B,)
        if self.full_pass_lanes is not None:
            return tuple(sorted({min(n, B) for n in self.full_pass_lanes} | {B}))
        return tuple(sorted({1, max(1, B // 4), B}))

    @property
    def sampler_bytes_per_logit(self) -> int:
        """Bytes the denoising stage holds per logit of a group: SAMPLER_F32_COPIES float32
        copies in XLA's stage, KERNEL_SAMPLER_COPIES in the model dtype in the kernel's."""
        if self.kernel_sampler:
            return KERNEL_SAMPLER_COPIES * self.model.jnp_dtype.itemsize
        return SAMPLER_F32_COPIES * 4

    @property
    def sampler_slots(self) -> int:
        """Slots per group of a data shard's denoising stage."""
        return sampler_group(
            self.shard_slots, self.policy.canvas_length, self.model.vocab_size, self.sampler_bytes_per_logit
        )

    @property
    def _kernel_choices(self) -> dict:
        """canvas_forward's kernel choices (the kernel routing's): the routed experts'
        grouped GEMMs, the attention, the per-head norms, the MoE block's end and the cache
        writes."""
        return {
            "grouped_gemm": grouped_gemm(self.kernels),
            "attention": canvas_attention(self.kernels, self.mesh),
            "head_norm": head_norm(self.kernels, self.mesh),
            "moe_output": moe_output(self.kernels),
            "cache_write": cache_write(self.kernels, self.mesh),
        }

    # ----- state -------------------------------------------------------------------------

    def init_state(
        self, prompts: jax.Array, lengths: jax.Array, sampling: SlotSampling, count: jax.Array
    ) -> DecodeState:
        """Empty slots, a zero cache, the queue; the first requests are installed (see DecodeLoop)."""
        state = DecodeState(
            slots=empty_canvas_slots(
                self.num_slots,
                self.max_len,
                self.policy.canvas_length,
                self.policy.max_stability,
                self.model.d_model,
                self.model.jnp_dtype,
            ),
            cache=allocate_canvas_cache(self.model, self.num_slots, self.max_len),
            queue=RequestQueue(
                tokens=prompts, lengths=lengths, sampling=sampling, count=jnp.int32(count), next=jnp.int32(0)
            ),
            results=empty_results(prompts.shape[0], self.gen_length),
            iteration=jnp.int32(0),
        )
        return self._refill(state)

    def _refill(self, state: DecodeState) -> DecodeState:
        """Installs waiting requests into free slots, lowest slot first, in request order."""
        slots, queue = state.slots, state.queue
        take, request, entry = next_requests(~slots.active, queue)
        sampling = jax.tree_util.tree_map(lambda a: a[entry], queue.sampling)
        installed = jax.vmap(install_canvas_request, in_axes=(0, 0, 0, 0, 0, None))(
            slots, queue.tokens[entry], queue.lengths[entry], request, sampling, state.iteration
        )
        slots = _where_tree(take, installed, slots)
        return state.replace(slots=slots, queue=queue.replace(next=queue.next + jnp.sum(take)))

    # ----- one iteration -----------------------------------------------------------------

    @property
    def kernel_sampler(self) -> bool:
        """Whether the denoising stage runs the canvas sampler kernel (Kernels.canvas_sampler),
        which needs every device to hold whole rows of logits: not under a tensor or expert axis
        (GSPMD cannot split a kernel)."""
        return self.kernels.canvas_sampler and axis_size(self.mesh, TENSOR) * axis_size(self.mesh, EXPERT) == 1

    def _denoise(self, weights, slots: CanvasSlots, hidden: jax.Array) -> tuple[CanvasSlots, jax.Array]:
        """Every slot's denoising step from its pass's last hidden rows [B, L, D], in groups of
        sampler_slots slots: the slots (with the new soft embeddings) and whether each one's
        logits were finite, bool [B]. B: the slots of one data shard."""
        B, g = self.shard_slots, self.sampler_slots
        config = self.model

        def group(args):
            slots_g, hidden_g = args
            if self.kernel_sampler:
                return self._denoise_by_kernel(weights, slots_g, hidden_g)
            # float32 [g, L, V]
            logits = dg.final_logits(config, weights, hidden_g)
            finite = jnp.all(jnp.isfinite(logits), axis=(1, 2))
            stepped, processed = jax.vmap(self.policy.denoise)(slots_g, logits)
            soft = dg.soft_embeddings(config, weights, processed.astype(config.jnp_dtype))
            return stepped.replace(soft=soft.astype(config.jnp_dtype)), finite

        if g == B:
            return group((slots, hidden))
        grouped = jax.tree_util.tree_map(lambda x: x.reshape((B // g, g) + x.shape[1:]), (slots, hidden))
        out = jax.lax.map(group, grouped)
        return jax.tree_util.tree_map(lambda x: x.reshape((B,) + x.shape[2:]), out)

    def _denoise_by_kernel(self, weights, slots: CanvasSlots, hidden: jax.Array) -> tuple[CanvasSlots, jax.Array]:
        """_denoise's group of g slots by the canvas sampler kernel: the LM head writes the
        model dtype, the kernel computes the policy's statistics and the self-conditioning
        probabilities from it (the same math as the XLA path, summed in another order)."""
        config = self.model
        g, L = hidden.shape[:2]
        # [g, L, V] in the model dtype, before the soft-cap
        logits = dg.head_logits(config, weights, hidden, float32_result=False)
        # float32 [g] and [g, L]
        temperature, uniform = jax.vmap(self.policy.step_inputs)(slots)
        out = canvas_sampler(
            logits.reshape(g * L, -1),
            jnp.repeat(temperature, L),
            uniform.reshape(g * L),
            softcap=config.final_logit_softcap,
            interpret=self.kernels.interpret,
        )
        per_slot = lambda x: x.reshape((g, L) + x.shape[1:])  # noqa: E731
        statistics = StepStatistics(
            argmax=per_slot(out.argmax), entropy=per_slot(out.entropy), drawn=per_slot(out.sample)
        )
        stepped = jax.vmap(self.policy.denoise_with)(slots, statistics)
        soft = dg.embed_probabilities(config, weights, per_slot(out.probs))
        return stepped.replace(soft=soft.astype(config.jnp_dtype)), jnp.all(per_slot(out.finite), axis=1)

    def _cached_passes(
        self, weights, slots: CanvasSlots, cache, branch: jax.Array, any_sparse: jax.Array
    ) -> tuple[CanvasSlots, jax.Array, object]:
        """The full pass (in lanes: variant ``branch``, 0 none) and the sparse pass (if
        any_sparse) of a loop with cached canvas rows: the slots with their canvas rows'
        last-layer outputs and scores updated, every slot's canvas hidden rows [B, L, D], and
        the cache. B: the slots of one data shard."""
        B, L, D = self.shard_slots, self.policy.canvas_length, self.model.d_model
        dtype = self.model.jnp_dtype
        run = dict(max_len=self.max_len, canvas_length=L, with_scores=True, mesh=self.mesh, **self._kernel_choices)
        full = slots.active & jax.vmap(self.policy.needs_full)(slots)
        sparse = slots.active & ~full
        nothing = (jnp.zeros((B, L, D), dtype), jnp.zeros((B, self.max_len), jnp.float32))

        def full_pass(cache, lanes: int):
            lane_slot = jnp.nonzero(full, size=lanes, fill_value=B)[0].astype(jnp.int32)
            safe = jnp.minimum(lane_slot, B - 1)
            lane = jax.tree_util.tree_map(lambda x: x[safe], slots)
            rows = jax.vmap(self.policy.rows)(lane)
            rows = rows.replace(valid=rows.valid & (lane_slot < B)[:, None])
            hidden, cache, scores = canvas_forward(self.model, weights, cache, rows, group_slot=safe, **run)
            hidden = jnp.zeros((B, L, D), dtype).at[lane_slot].set(hidden, mode="drop")
            return hidden, jnp.zeros((B, self.max_len), jnp.float32).at[lane_slot].set(scores, mode="drop"), cache

        branches = [lambda cache: nothing + (cache,)]
        branches += [lambda cache, n=n: full_pass(cache, n) for n in self.lane_sizes]
        full_hidden, full_scores, cache = jax.lax.switch(branch, branches, cache)

        def sparse_pass(cache):
            rows, offsets = jax.vmap(self.policy.sparse_rows)(slots)
            rows = rows.replace(valid=rows.valid & sparse[:, None])
            hidden, cache, scores = canvas_forward(self.model, weights, cache, rows, **run)
            kept = jax.vmap(lambda kept, h, o: kept.at[o].set(h))(slots.hidden, hidden, offsets)
            return kept, scores, cache

        sparse_hidden, sparse_scores, cache = jax.lax.cond(
            any_sparse, sparse_pass, lambda cache: (slots.hidden,) + nothing[1:] + (cache,), cache
        )
        hidden = jnp.where(full[:, None, None], full_hidden, sparse_hidden)
        # the scores of the canvas rows, [B, L]
        scores = jnp.where(full[:, None], full_scores, sparse_scores)
        scores = jax.vmap(lambda s, start: jax.lax.dynamic_slice(s, (start,), (L,)))(scores, slots.start)
        ran = full | sparse
        slots = slots.replace(
            hidden=jnp.where(ran[:, None, None], hidden, slots.hidden),
            scores=jnp.where(ran[:, None], scores, slots.scores),
        )
        return slots, hidden, cache

    def _step(self, weights, state: DecodeState) -> DecodeState:
        slots = state.slots
        ran = slots.active
        # Decided over all slots, so every device takes the same branches: the full-pass lane
        # count fits the data shard with the most full passes (shard d: slots [d*B, (d+1)*B)).
        branch, any_sparse = jnp.int32(0), jnp.bool_(False)
        if self.policy.cached_rows is not None:
            full = ran & jax.vmap(self.policy.needs_full)(slots)
            n_full = jnp.max(jnp.sum(full.reshape(-1, self.shard_slots), axis=1))
            branch = jnp.where(n_full == 0, 0, 1 + jnp.searchsorted(jnp.array(self.lane_sizes), n_full))
            any_sparse = jnp.any(ran & ~full)
        any_decoding = jnp.any(ran & (slots.phase == DENOISE))
        step_slots = per_data_shard(
            self._step_slots,
            self.mesh,
            in_specs=(REPLICATED, SLOTS, CACHE_ROWS, REPLICATED, REPLICATED, REPLICATED),
            out_specs=(SLOTS, CACHE_ROWS),
        )
        slots, cache = step_slots(weights, slots, state.cache, branch, any_sparse, any_decoding)

        complete = jax.vmap(self.policy.finished)(slots)
        # the hard bound: a request that is not complete after step_limit passes ends with an error
        over = ran & ~complete & (slots.error == 0) & (slots.passes >= slots.sampling.step_limit)
        slots = slots.replace(error=jnp.where(over, ERROR_STEP_LIMIT, slots.error))
        finished = ran & (complete | (slots.error != 0))
        results = self._record(state.results, slots, finished, state.iteration + 1)
        slots = slots.replace(active=slots.active & ~finished)
        state = state.replace(slots=slots, cache=cache, results=results, iteration=state.iteration + 1)
        return self._refill(state)

    def _step_slots(
        self, weights, slots: CanvasSlots, cache, branch: jax.Array, any_sparse: jax.Array, any_decoding: jax.Array
    ) -> tuple[CanvasSlots, object]:
        """One pass and move of the active slots (of one data shard under a mesh); the branch
        choices are made over all slots (see _step)."""
        ran = slots.active
        if self.policy.cached_rows is None:
            rows = jax.vmap(self.policy.rows)(slots)
            hidden, cache = canvas_forward(
                self.model, weights, cache, rows, max_len=self.max_len, mesh=self.mesh, **self._kernel_choices
            )
        else:
            slots, hidden, cache = self._cached_passes(weights, slots, cache, branch, any_sparse)
        decoding = ran & (slots.phase == DENOISE)
        denoised, finite = jax.lax.cond(
            any_decoding,
            lambda: self._denoise(weights, slots, hidden),
            lambda: (slots, jnp.ones((self.shard_slots,), bool)),
        )
        encoded = jax.vmap(self.policy.after_encoding)(slots)
        moved = _where_tree(decoding, denoised, encoded)
        moved = moved.replace(
            steps=moved.steps + decoding.astype(jnp.int32),
            passes=moved.passes + 1,
            error=jnp.where(decoding & ~finite, ERROR_NON_FINITE, moved.error),
        )
        return _where_tree(ran, moved, slots), cache

    def _record(self, results: Results, slots: CanvasSlots, finished: jax.Array, iteration: jax.Array) -> Results:
        def answer(sequence):
            return jax.vmap(lambda t, p: jax.lax.dynamic_slice(t, (p,), (self.gen_length,)))(sequence, slots.prompt_len)

        return record_results(
            results,
            finished,
            slots.request,
            iteration,
            tokens=answer(slots.tokens),
            num_tokens=jax.vmap(self.policy.num_tokens)(slots),
            steps=slots.steps,
            passes=slots.passes,
            verify_passes=slots.verify_passes,
            accepted=slots.accepted,
            start_iter=slots.start_iter,
            error=slots.error,
            commit_step=answer(slots.commit_step),
            verified=answer(slots.verified),
        )

    # ----- the loop ------------------------------------------------------------------------

    def run(self, weights, state: DecodeState, stop_iteration: jax.Array, host_has_more: jax.Array) -> DecodeState:
        """Steps until all work is done, `stop_iteration` is reached, or the host can feed a free
        slot (jit this, donate state); see DecodeLoop.run."""
        state = self._refill(state)
        return run_while_work(lambda st: self._step(weights, st), state, stop_iteration, host_has_more)
