"""The decode loop: one jitted ``lax.while_loop`` over a static-shape state, for every policy.

Each iteration advances every active slot by exactly one step:
  1. slots whose next step is a full pass (a new request, a block boundary, or every step of
     LLaDA) run it in a batch of F "lanes", F the smallest of `lane_sizes` that fits them
     (``lax.switch``, so a lone refill does not pay for a full batch);
  2. all other active slots run the policy's sparse pass over the flat cache;
  3. the policy commits tokens from the candidates' logits;
  4. finished slots write their results and are refilled from the request queue, which lives
     on the device: continuous batching without a host round trip.
The queue and the results are rings of Q entries (request g at entry g % Q), so the compiled
loop does not depend on how many requests a call has: the host calls the loop in chunks of
iterations, and between chunks collects finished results and pushes waiting requests.

Per-request values (gen_length, max_new_tokens, temperature, top_p/top_k, seed, threshold,
gamma, cfg_scale, remasking) travel with the request through the ring into its slot
(dllm_jax.runtime.slots.SlotSampling): one compiled loop serves every mix of them. A request whose
logits are not finite, or that runs past its step bound, ends with an error code in its
result while the other slots go on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.logit_alignment import predictor_positions, with_predictor_rows
from dllm_jax.models.transformer import Weights
from dllm_jax.runtime.cached_forward import PassSpec, VerifyKeys, cached_forward
from dllm_jax.runtime.commit_logprobs import record_commit_logprobs
from dllm_jax.runtime.flat_cache import FlatCache, allocate_cache, flat_rows
from dllm_jax.runtime.kernel_routing import Kernels
from dllm_jax.runtime.policy import DecodePolicy
from dllm_jax.runtime.row_drift import drift_layer, kv_change, layer_rows, record_drift
from dllm_jax.runtime.sharding import CACHE_ROWS, DATA, REPLICATED, SLOTS, axis_size, per_data_shard
from dllm_jax.runtime.slots import (
    ERROR_NON_FINITE,
    ERROR_STEP_LIMIT,
    Slots,
    SlotSampling,
    cut_decoded,
    empty_slots,
    install,
    step_rng,
)
from dllm_jax.sampling.samplers import all_finite, filter_min_p, filter_top_p_top_k, guided_logits
from pallas_kernels.sampling.top_p_top_k import apply_cutoff, top_p_top_k_cutoff


@struct.dataclass
class RequestQueue:
    """A ring of prompts: request g (global index) sits at entry g % Q.

    tokens int32 [Q, P_max] (padded), lengths int32 [Q], sampling: SlotSampling [Q]; count:
    requests pushed so far by the host; next: requests installed so far (next < count:
    requests are waiting).
    """

    tokens: jax.Array
    lengths: jax.Array
    sampling: SlotSampling
    count: jax.Array
    next: jax.Array


@struct.dataclass
class Results:
    """A ring of per-request outputs, request g at entry g % Q (done: not yet collected).

    tokens int32 [Q, G]: the canvas after the prompt; request: the global index; error:
    int32 [Q] the slot's ERROR_* code (0: finished normally); commit_step int32 [Q, G] and
    verified bool [Q, G]: Slots.commit_step / verified over the same positions; logprob
    float32 [Q, G], top_ids int32 [Q, G, K], top_logprobs float32 [Q, G, K]: Slots' too.
    """

    tokens: jax.Array
    request: jax.Array
    num_tokens: jax.Array
    steps: jax.Array
    passes: jax.Array
    verify_passes: jax.Array
    accepted: jax.Array
    start_iter: jax.Array
    end_iter: jax.Array
    error: jax.Array
    commit_step: jax.Array
    verified: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    done: jax.Array


@struct.dataclass
class DecodeState:
    slots: Slots
    cache: FlatCache
    queue: RequestQueue
    results: Results
    iteration: jax.Array


def _where_tree(pred: jax.Array, new, old):
    """Per-slot select between two Slots pytrees (pred bool [B])."""

    def pick(a, b):
        return jnp.where(pred.reshape(pred.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree_util.tree_map(pick, new, old)


def empty_results(queue_capacity: int, gen_length: int, max_logprobs: int = 0) -> Results:
    """A results ring of Q = queue_capacity entries of G = gen_length positions (K =
    max_logprobs alternatives per position), none done."""
    Q, G, K = queue_capacity, gen_length, max_logprobs
    zeros = jnp.zeros((Q,), jnp.int32)
    return Results(
        tokens=jnp.zeros((Q, G), jnp.int32),
        request=zeros,
        num_tokens=zeros,
        steps=zeros,
        passes=zeros,
        verify_passes=zeros,
        accepted=zeros,
        start_iter=zeros,
        end_iter=zeros,
        error=zeros,
        commit_step=jnp.full((Q, G), -1, jnp.int32),
        verified=jnp.zeros((Q, G), bool),
        logprob=jnp.zeros((Q, G), jnp.float32),
        top_ids=jnp.zeros((Q, G, K), jnp.int32),
        top_logprobs=jnp.zeros((Q, G, K), jnp.float32),
        done=jnp.zeros((Q,), bool),
    )


def next_requests(free: jax.Array, queue: RequestQueue) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Which free slots (bool [B]) take a waiting request, lowest slot first, in request order:
    (take bool [B], the request's global index int32 [B], its ring entry int32 [B])."""
    request = queue.next + jnp.cumsum(free) - 1
    take = free & (request < queue.count)
    return take, request, request % queue.tokens.shape[0]


def record_results(
    results: Results, finished: jax.Array, request: jax.Array, iteration: jax.Array, **fields
) -> Results:
    """The results ring with the finished slots' requests (request int32 [B]) written: `fields`
    (Results field name -> per-slot values [B, ...]), end_iter and done."""
    Q = results.tokens.shape[0]
    target = jnp.where(finished, request % Q, Q)  # Q is out of range: dropped

    def put(array, values):
        return array.at[target].set(values, mode="drop")

    fields = dict(fields, request=request, end_iter=jnp.broadcast_to(iteration, finished.shape))
    written = {name: put(getattr(results, name), values) for name, values in fields.items()}
    return results.replace(**written, done=put(results.done, jnp.ones_like(finished)))


def run_while_work(
    step: Callable[[DecodeState], DecodeState], state: DecodeState, stop_iteration: jax.Array, host_has_more: jax.Array
) -> DecodeState:
    """``lax.while_loop`` of `step` until no slot is active, `stop_iteration` is reached, or the
    host can feed a free slot (see DecodeLoop.run)."""
    Q = state.queue.tokens.shape[0]

    def keep_going(st: DecodeState):
        host_can_feed = host_has_more & st.results.done[st.queue.count % Q]
        starved = jnp.any(~st.slots.active) & (st.queue.next >= st.queue.count) & host_can_feed
        return jnp.any(st.slots.active) & (st.iteration < stop_iteration) & ~starved

    return jax.lax.while_loop(keep_going, step, state)


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """A compiled-once decode loop for one (policy, slots, max_len, kernels, mesh) combination.

    With a mesh (dllm_jax.runtime.sharding), each data shard steps its own num_slots / data slots
    (model passes, commits, Flash-Verify); the request ring, the results ring and the loop
    condition see all slots.

    cfg: the classifier-free-guidance variant (policies whose every step is a full pass):
    each full pass is run twice, with the prompt and with it masked, and the candidates'
    logits combined per slot with its cfg_scale (slots at 0 take the conditional logits).

    max_logprobs: the most alternatives per committed token a request may ask to be recorded
    (SamplingParams.logprobs; dllm_jax.runtime.commit_logprobs); None: nothing is recorded.
    """

    model: ModelConfig
    policy: DecodePolicy
    num_slots: int
    max_len: int
    gen_length: int
    kernels: Kernels = Kernels()
    full_pass_lanes: tuple[int, ...] | None = None
    mesh: Mesh | None = None
    cfg: bool = False
    max_logprobs: int | None = None

    def __post_init__(self):
        if self.cfg and self.policy.num_sparse_rows != 0:
            raise ValueError("cfg needs a policy whose every step is a full pass (method='llada')")

    @property
    def shard_slots(self) -> int:
        """Slots of one data shard (all of them without a mesh)."""
        return self.num_slots // axis_size(self.mesh, DATA)

    @property
    def lane_sizes(self) -> tuple[int, ...]:
        """Full-pass batch sizes per data shard (each a compiled variant): the given ones plus
        all its B slots; by default 1, B/4 and B, and only B for policies whose every step is
        a full pass."""
        B = self.shard_slots
        if self.policy.num_sparse_rows == 0:
            return (B,)
        if self.full_pass_lanes is not None:
            return tuple(sorted({min(n, B) for n in self.full_pass_lanes} | {B}))
        return tuple(sorted({1, max(1, B // 4), B}))

    @property
    def _spec(self) -> PassSpec:
        return PassSpec(
            max_len=self.max_len,
            kernels=self.kernels,
            score_scale=self.policy.score_scale,
            mesh=self.mesh,
        )

    # ----- state -------------------------------------------------------------------------

    def init_state(
        self, prompts: jax.Array, lengths: jax.Array, sampling: SlotSampling, count: jax.Array
    ) -> DecodeState:
        """Empty slots, a zero cache, the queue; the first requests are installed.

        prompts: int32 [Q, P_max]; lengths: int32 [Q]; sampling: SlotSampling [Q]; count: requests
        pushed (<= Q).
        """
        K = self.max_logprobs or 0
        state = DecodeState(
            slots=empty_slots(self.num_slots, self.max_len, K),
            cache=allocate_cache(self.model, self.num_slots, self.max_len),
            queue=RequestQueue(
                tokens=prompts, lengths=lengths, sampling=sampling, count=jnp.int32(count), next=jnp.int32(0)
            ),
            results=empty_results(prompts.shape[0], self.gen_length, K),
            iteration=jnp.int32(0),
        )
        return self._refill(state)

    def _refill(self, state: DecodeState) -> DecodeState:
        """Installs waiting requests into free slots, lowest slot first, in request order."""
        slots, queue = state.slots, state.queue
        take, request, entry = next_requests(~slots.active, queue)
        lengths = queue.lengths[entry]
        sampling = jax.tree_util.tree_map(lambda a: a[entry], queue.sampling)
        installed = jax.vmap(install, in_axes=(0, 0, 0, 0, 0, 0, None, None, None))(
            slots,
            queue.tokens[entry],
            lengths,
            request,
            sampling,
            self.policy.key_length(lengths, lengths + sampling.gen_length),
            self.model.mask_token_id,
            self.model.eos_token_id,
            state.iteration,
        )
        slots = _where_tree(take, installed, slots)
        return state.replace(slots=slots, queue=queue.replace(next=queue.next + jnp.sum(take)))

    # ----- one iteration -----------------------------------------------------------------

    def _full_pass(self, weights, slots: Slots, cache: FlatCache, run_full: jax.Array, lanes: int, taps: bool = False):
        """Full forward of up to `lanes` slots needing it; returns logits/scores scattered to [B, ...]
        (taps: a debug pass, also the cached_forward taps and "group_slot", each lane's slot)."""
        B, L, C = run_full.shape[0], self.max_len, self.policy.num_candidates
        lane_slot = jnp.nonzero(run_full, size=lanes, fill_value=B)[0].astype(jnp.int32)
        lane_valid = lane_slot < B
        safe_slot = jnp.minimum(lane_slot, B - 1)
        lane = jax.tree_util.tree_map(lambda x: x[safe_slot], slots)
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (lanes, L))
        row_valid = lane_valid[:, None] & (positions < lane.key_len[:, None])
        candidates, candidate_valid = jax.vmap(self.policy.candidates)(lane)
        # row index = position in a full pass: the candidates' predictor rows are positions
        predictors, predictor_valid = predictor_positions(candidates, candidate_valid, self.model.logit_shift)
        score_rows = jax.vmap(lambda c, v: jnp.zeros((L,), bool).at[jnp.where(v, c, L)].set(True, mode="drop"))(
            predictors, predictor_valid
        )
        logits, scores, cache, *pass_taps = cached_forward(
            self.model,
            self._spec,
            weights,
            cache,
            lane.tokens,
            positions,
            row_valid,
            safe_slot,
            lane.key_len,
            predictors,
            score_rows,
            taps=taps,
        )
        if self.cfg:
            # LLaDA's un_x: the prompt positions masked (prompt_index = the initial non-mask tokens)
            unconditional = jnp.where(positions < lane.prompt_len[:, None], self.model.mask_token_id, lane.tokens)
            uncond_logits, _, cache = cached_forward(
                self.model,
                self._spec,
                weights,
                cache,
                unconditional,
                positions,
                row_valid,
                safe_slot,
                lane.key_len,
                candidates,
                score_rows,
            )
            logits = jax.vmap(guided_logits)(logits, uncond_logits, lane.sampling.cfg_scale).astype(logits.dtype)
        V = logits.shape[-1]
        full_logits = jnp.zeros((B, C, V), logits.dtype).at[lane_slot].set(logits, mode="drop")
        full_scores = jnp.zeros((B, L), jnp.float32)
        if scores is not None:
            full_scores = full_scores.at[lane_slot].set(scores, mode="drop")
        if taps:
            return full_logits, full_scores, cache, {**pass_taps[0], "group_slot": lane_slot}
        return full_logits, full_scores, cache

    def _sparse_pass(self, weights, slots: Slots, cache: FlatCache, run_sparse: jax.Array, taps: bool = False):
        """The policy's sparse step for every slot (rows of other slots are invalid): logits,
        scores, the slots' drift (row_drift: updated at the refreshed rows when the policy
        tracks it) and the cache (taps: a debug pass, also the cached_forward taps)."""
        B, L, C = run_sparse.shape[0], self.max_len, self.policy.num_candidates
        positions, row_valid = jax.vmap(self.policy.sparse_rows)(slots)
        if self.model.logit_shift:
            candidates, candidate_valid = jax.vmap(self.policy.candidates)(slots)
            positions, row_valid = with_predictor_rows(
                positions, row_valid, candidates, candidate_valid, self.model.logit_shift
            )
        row_valid = row_valid & run_sparse[:, None]
        tokens = jnp.take_along_axis(slots.tokens, positions, axis=1)
        R = positions.shape[1]
        if self.policy.tracks_drift:
            rows = flat_rows(jnp.arange(B, dtype=jnp.int32), positions, row_valid, L)
            before = layer_rows(cache, drift_layer(self.model), rows)
            # the rows are read before the pass overwrites them in place (not after a copy of the cache)
            before, cache = jax.lax.optimization_barrier((before, cache))
        # the first C query rows predict the candidates (the candidates or their predictor rows)
        candidate_rows = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
        score_rows = row_valid & (jnp.arange(R) < C)[None, :]
        logits, scores, cache, *pass_taps = cached_forward(
            self.model,
            self._spec,
            weights,
            cache,
            tokens,
            positions,
            row_valid,
            None,
            slots.key_len,
            candidate_rows,
            score_rows,
            taps=taps,
        )
        if scores is None:
            scores = jnp.zeros((B, L), jnp.float32)
        drift = slots.drift
        if self.policy.tracks_drift:
            change = kv_change(before, layer_rows(cache, drift_layer(self.model), rows))
            drift = record_drift(drift, positions, row_valid, change)
        return (logits, scores, drift, cache, *pass_taps)

    def _model_passes(self, weights, slots: Slots, cache: FlatCache, run_full, run_sparse, branch, any_sparse):
        """The full-pass variant `branch` (0: none) and the sparse pass (if any_sparse):
        logits [B, C, V], scores [B, L], the slots' drift [B, L] and the cache."""
        B, L, C = run_full.shape[0], self.max_len, self.policy.num_candidates
        V = self.model.vocab_size
        none = (jnp.zeros((B, C, V), self.model.jnp_dtype), jnp.zeros((B, L), jnp.float32))

        branches = [lambda cache: none + (cache,)]
        branches += [lambda cache, n=n: self._full_pass(weights, slots, cache, run_full, n) for n in self.lane_sizes]
        full_logits, full_scores, cache = jax.lax.switch(branch, branches, cache)

        if self.policy.num_sparse_rows == 0:
            return full_logits, full_scores, slots.drift, cache
        sparse_logits, sparse_scores, drift, cache = jax.lax.cond(
            any_sparse,
            lambda cache: self._sparse_pass(weights, slots, cache, run_sparse),
            lambda cache: none + (slots.drift, cache),
            cache,
        )
        pick = run_full[:, None]
        logits = jnp.where(pick[:, :, None], full_logits, sparse_logits)
        scores = jnp.where(pick, full_scores, sparse_scores)
        return logits, scores, drift, cache

    def _step(self, weights, state: DecodeState) -> DecodeState:
        slots = state.slots
        ran = slots.active
        # Decided over all slots, so every device takes the same branches: the full-pass lane
        # count fits the data shard with the most full passes (shard d: slots [d*B, (d+1)*B)).
        run_full = slots.active & slots.needs_full
        n_full = jnp.max(jnp.sum(run_full.reshape(-1, self.shard_slots), axis=1))
        branch = jnp.where(n_full == 0, 0, 1 + jnp.searchsorted(jnp.array(self.lane_sizes), n_full))
        any_sparse = jnp.any(slots.active & ~slots.needs_full)
        step_slots = per_data_shard(
            self._step_slots,
            self.mesh,
            in_specs=(REPLICATED, SLOTS, CACHE_ROWS, REPLICATED, REPLICATED, REPLICATED),
            out_specs=(SLOTS, CACHE_ROWS),
        )
        slots, cache = step_slots(weights, slots, state.cache, branch, any_sparse, jnp.any(ran))

        # a request cut at max_new_tokens is complete once its cut is decoded: later steps could
        # only commit positions after it
        complete = jax.vmap(self.policy.finished)(slots) | jax.vmap(cut_decoded)(slots)
        # the hard bound: a request that is not complete after step_limit steps ends with an error
        over = ran & ~complete & (slots.error == 0) & (slots.steps >= slots.sampling.step_limit)
        slots = slots.replace(error=jnp.where(over, ERROR_STEP_LIMIT, slots.error))
        finished = ran & (complete | (slots.error != 0))
        # A slot that ended on non-finite logits keeps its NaN cache rows: the next request in
        # that slot rewrites rows [0, key_len) in its first full pass before reading them, and
        # every attention path hides the other keys by selection, never as 0 * NaN.
        results = self._record(state.results, slots, finished, state.iteration + 1)
        slots = slots.replace(active=slots.active & ~finished)
        state = state.replace(slots=slots, cache=cache, results=results, iteration=state.iteration + 1)
        return self._refill(state)

    def _step_slots(
        self, weights, slots: Slots, cache: FlatCache, branch, any_sparse, any_ran
    ) -> tuple[Slots, FlatCache]:
        """One step of the active slots (of one data shard under a mesh): model passes, commits
        and Flash-Verify. The branch choices are made over all slots (see _step)."""
        run_full = slots.active & slots.needs_full
        run_sparse = slots.active & ~slots.needs_full
        logits, scores, drift, cache = self._model_passes(
            weights, slots, cache, run_full, run_sparse, branch, any_sparse
        )
        slots = slots.replace(drift=drift)
        _, candidate_valid = jax.vmap(self.policy.candidates)(slots)
        finite = jax.vmap(all_finite)(logits, candidate_valid)
        model_logits = logits
        logits = self._filter(slots, logits)

        rngs = jax.vmap(step_rng)(slots.sampling, slots.steps)
        committed, draft = jax.vmap(self.policy.commit)(slots, logits, scores, rngs)
        if self.policy.verify:
            committed = self._verify(weights, slots, committed, draft, slots.active, any_ran, cache)
        committed = committed.replace(
            steps=committed.steps + 1,
            passes=committed.passes + 1,
            error=jnp.where(finite, committed.error, ERROR_NON_FINITE),
        )
        if self.max_logprobs is not None:
            committed = record_commit_logprobs(self.policy, slots, committed, model_logits)
        return _where_tree(slots.active, committed, slots), cache

    def _filter(self, slots: Slots, logits: jax.Array) -> jax.Array:
        """top_p / top_k, then min_p filtering of the slots that ask for it: logits [B, C, V] ->
        the same, removed entries at float32's lowest value (in logits.dtype). min_p is one
        elementwise pass after a row max (no sort, no conditional: min_p 0 keeps every entry)."""
        p = slots.sampling
        logits = self._filter_top_p_top_k(slots, logits)
        return jax.vmap(filter_min_p)(logits, p.temperature, p.min_p)

    def _filter_top_p_top_k(self, slots: Slots, logits: jax.Array) -> jax.Array:
        """top_p / top_k filtering of the slots that ask for it. With the kernel, rows that do
        not ask cost nothing and no conditional is needed (XLA:GPU would read its predicate back
        to the host at every step); otherwise the sort is skipped by a cond when no slot asks."""
        p = slots.sampling
        wants = slots.active & ((p.top_p < 1.0) | (p.top_k > 0))
        if self.kernels.top_p_top_k:
            B, C, V = logits.shape
            rows = lambda x: jnp.repeat(x, C)  # noqa: E731
            flat = logits.reshape(B * C, V)
            cutoff = top_p_top_k_cutoff(
                flat, rows(p.temperature), rows(p.top_p), rows(p.top_k), rows(wants), interpret=self.kernels.interpret
            )
            out = apply_cutoff(flat, cutoff).astype(logits.dtype).reshape(B, C, V)
            return jnp.where(wants[:, None, None], out, logits)

        def filtered(logits):
            out = jax.vmap(filter_top_p_top_k)(logits, p.temperature, p.top_p, p.top_k).astype(logits.dtype)
            return jnp.where(wants[:, None, None], out, logits)

        return jax.lax.cond(jnp.any(wants), filtered, lambda logits: logits, logits)

    def _verify(self, weights, old: Slots, new: Slots, draft, ran: jax.Array, any_ran, cache: FlatCache) -> Slots:
        """Flash-Verify: a read-only pass over each slot's verify query, then stage-2 commits
        (any_ran: some slot of any data shard ran, so every device runs the pass)."""
        plan = jax.vmap(self.policy.plan_verify)(old, new, draft)
        spec = dataclasses.replace(self._spec, score_scale=None)

        def verify_pass(_):
            logits, _, _ = cached_forward(
                self.model,
                spec,
                weights,
                cache,
                plan.tokens,
                plan.positions,
                plan.row_valid & ran[:, None],
                None,
                new.key_len,
                plan.mask_rows,
                None,
                VerifyKeys(key_exclude=plan.key_exclude, extra_mask=plan.extra_mask),
            )
            return logits

        B, S = plan.mask_rows.shape
        logits = jax.lax.cond(
            any_ran, verify_pass, lambda _: jnp.zeros((B, S, self.model.vocab_size), self.model.jnp_dtype), None
        )
        return jax.vmap(self.policy.verify_commit)(new, plan, logits, draft)

    def _record(self, results: Results, slots: Slots, finished: jax.Array, iteration: jax.Array) -> Results:
        def answer(canvas):
            """The G positions after each slot's prompt, of a per-position array [B, L, ...]."""
            return jax.vmap(lambda t, p: jax.lax.dynamic_slice_in_dim(t, p, self.gen_length, axis=0))(
                canvas, slots.prompt_len
            )

        return record_results(
            results,
            finished,
            slots.request,
            iteration,
            tokens=answer(slots.tokens),
            num_tokens=jnp.minimum(jax.vmap(self.policy.num_tokens)(slots), slots.sampling.max_new_tokens),
            steps=slots.steps,
            passes=slots.passes,
            verify_passes=slots.verify_passes,
            accepted=slots.accepted,
            start_iter=slots.start_iter,
            error=slots.error,
            commit_step=answer(slots.commit_step),
            verified=answer(slots.verified),
            logprob=answer(slots.logprob),
            top_ids=answer(slots.top_ids),
            top_logprobs=answer(slots.top_logprobs),
        )

    # ----- the loop ------------------------------------------------------------------------

    def run(
        self,
        weights: Weights,
        state: DecodeState,
        stop_iteration: jax.Array,
        host_has_more: jax.Array,
    ) -> DecodeState:
        """Steps until all work is done, `stop_iteration` is reached, or the host can feed a free
        slot (jit this, donate state).

        host_has_more: the host holds requests it could not push, each waiting for the results
        entry of the request Q before it. A free slot with an empty device queue stops the loop
        only once that entry holds a finished result (the host collects it and pushes); while
        the blocking request still decodes, the loop keeps stepping the other slots.
        """
        # requests the host pushed since the last call take their free slots first
        state = self._refill(state)
        return run_while_work(lambda st: self._step(weights, st), state, stop_iteration, host_has_more)
