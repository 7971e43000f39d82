"""The engine: prompts in, answers and statistics out, over the jitted decode loop.

``Engine.generate(prompts, DecodeConfig(...))`` tokenizes (applying the chat template when
asked), buckets the shapes (prompt length to a power of two, request count to a power of
two) so that requests of different lengths in a bucket reuse one compiled loop, runs the loop
in chunks of iterations (a progress bar and timings between chunks, no host round trip per
step), and returns results in request order.

Token accounting (the throughput numerator): for flash_cache, the committed generated
positions when the request stops (it stops once every position before the first committed
EOS is decoded), as the published Flash-dLLM code counts; for llada and fast_dllm, which
decode all gen_length positions, the positions up to and including the first EOS.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from dllm_jax import sharding
from dllm_jax.config import ModelConfig
from dllm_jax.decode_config import DecodeConfig
from dllm_jax.decode_loop import DecodeLoop, DecodeState
from dllm_jax.flat_cache import cache_bytes
from dllm_jax.kernel_backend import Kernels, resolve_kernels
from dllm_jax.models import Params, unstack_layers
from dllm_jax.policies import make_policy

# flash_cache: max_len as the reference computes it (reference-spec B.1); key lengths are
# rounded to 128 within it. Block methods attend to exactly prompt + gen_length positions, so
# their slots need only that plus the trash row, rounded to _ROW_GRANULE (their full passes
# compute every row of a slot, so slack rows are wasted work).
_KEY_TILE = 128
_ROW_GRANULE = 32
_MIN_PROMPT_BUCKET = 16


class GenerationError(ValueError):
    """Bad input to generate(); the message names the request and the problem."""


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """One request's answer and counters.

    token_ids: generated ids before the first EOS; text: their decoding (None without a
    tokenizer); num_tokens: tokens credited for throughput (see module docstring);
    steps: decode steps (the first full pass included); forward_passes: model passes over
    this request's rows (main + verify); accepted_drafts: drafts accepted by Flash-Verify;
    seconds: wall time from install to finish, interpolated between chunk timestamps.
    """

    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    num_tokens: int
    steps: int
    forward_passes: int
    verify_passes: int
    accepted_drafts: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    num_requests: int
    num_tokens: int
    steps: int
    forward_passes: int
    iterations: int
    wall_seconds: float
    compile_seconds: float
    cache_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.wall_seconds if self.wall_seconds > 0 else float("nan")

    @property
    def tokens_per_step(self) -> float:
        return self.num_tokens / self.steps if self.steps else float("nan")


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    results: list[GenerationResult]
    stats: GenerationStats


def _next_power_of_two(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class CompiledLoop:
    """A decode loop compiled for one config and shape bucket.

    init(prompts int32 [queue_capacity, prompt_width], lengths int32 [queue_capacity],
    count) -> DecodeState; run(params, state, knobs, seed, stop_iteration, host_has_more)
    -> DecodeState (state donated). See DecodeLoop.
    """

    loop: DecodeLoop
    queue_capacity: int
    prompt_width: int
    init: Any
    run: Any
    compile_seconds: float


class Engine:
    """Holds a model and its compiled decode loops.

    Args:
      config: the model architecture.
      params: its parameter tree (on the device).
      tokenizer: a dllm_jax tokenizer (encode/decode), needed for text prompts.
      backend: "auto" (per op, what measured fastest on this device), "xla", "pallas", or a
        dllm_jax.kernel_backend.Kernels choosing op by op.
      interpret: run Pallas kernels in interpret mode (CPU tests).
      unroll_layers: run the layer loop unrolled over per-layer weight arrays instead of a
        scan over the layer-stacked ones. On the H200 the scan copied every layer's weights
        out of the stack at every step (8.6 ms of a 16 ms step at one slot); unrolled, the
        program is larger (compile time grows) but reads the weights in place. Stacked params
        are split once here (the caller should drop its stacked copy); params whose "layers"
        is already a tuple (model.init_params_per_layer) always run unrolled.
      chunk_iterations: loop iterations per device call (progress/timing granularity).
      queue_capacity: entries of the on-device request and result rings (None: max(16, 4 B)).
        The host pushes request g once request g - capacity has been collected.
      full_pass_lanes: batch sizes of the compiled full-pass variants (None: 1, B/4 and B).
        Fewer variants compile faster; (B,) suits batches whose slots refill together.
        With a mesh, B is the slots of one data shard.
      mesh: decode over several devices (dllm_jax.sharding.parse_mesh): slots split across
        its data axis, weights and cache across its tensor axis. The params are laid out
        for it here (a no-op if they already are).
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        tokenizer: Any = None,
        *,
        backend: str | Kernels = "auto",
        interpret: bool = False,
        chunk_iterations: int = 64,
        queue_capacity: int | None = None,
        full_pass_lanes: tuple[int, ...] | None = None,
        unroll_layers: bool = False,
        mesh: Mesh | None = None,
    ):
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        try:
            self.kernels = resolve_kernels(backend, interpret)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        if unroll_layers:
            self.params = params = unstack_layers(params)
        self.mesh = mesh
        if mesh is not None:
            sharding.check_model(mesh, config)
            self.params = params = sharding.place_params(params, mesh)
        if queue_capacity is not None and (not isinstance(queue_capacity, int) or queue_capacity < 1):
            raise GenerationError(f"queue_capacity={queue_capacity!r}: expected an int >= 1")
        self.chunk_iterations = chunk_iterations
        self.queue_capacity = queue_capacity
        self.full_pass_lanes = full_pass_lanes
        self._executables: dict[tuple, CompiledLoop] = {}

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "bfloat16", **kwargs) -> Engine:
        """Loads a Hugging Face LLaDA folder or a converted checkpoint (dllm_jax.load_model)."""
        from dllm_jax.loading import load_model

        loaded = load_model(path, dtype=dtype)
        return cls(loaded.config, loaded.params, loaded.tokenizer, **kwargs)

    @property
    def backend(self) -> str:
        """What runs the per-layer ops: "xla", "pallas" or a mix."""
        return self.kernels.name

    @property
    def num_compilations(self) -> int:
        """Decode loops compiled so far (one per static configuration and shape bucket)."""
        return len(self._executables)

    # ----- inputs ----------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str | Sequence[int]], chat: bool | None) -> list[list[int]]:
        encoded = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise GenerationError(f"prompt {i} is text but the engine has no tokenizer; pass token ids")
                if not prompt.strip():
                    raise GenerationError(f"prompt {i} is empty")
                use_chat = self.tokenizer.has_chat_template if chat is None else chat
                ids = list(self.tokenizer.encode(prompt, chat=use_chat))
            else:
                ids = [int(t) for t in prompt]
            if not ids:
                raise GenerationError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise GenerationError(f"prompt {i} has token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
            encoded.append(ids)
        return encoded

    def _check_lengths(self, encoded: list[list[int]], decode: DecodeConfig) -> None:
        limit = self.config.max_sequence_length
        for i, ids in enumerate(encoded):
            if len(ids) + decode.gen_length > limit:
                raise GenerationError(
                    f"prompt {i} has {len(ids)} tokens; with gen_length={decode.gen_length} that is "
                    f"{len(ids) + decode.gen_length} positions, more than the model's max_sequence_length={limit}"
                )

    # ----- compiled loops --------------------------------------------------------------------

    def decode_loop(self, decode: DecodeConfig, max_prompt_len: int) -> DecodeLoop:
        """The loop for this config and prompt-length bucket (max_len from the bucket)."""
        if self.mesh is not None:
            sharding.check_batch(self.mesh, decode.batch_size)
        bucket = _next_power_of_two(max_prompt_len, _MIN_PROMPT_BUCKET)
        if decode.method == "flash_cache":
            max_len = ((bucket + decode.gen_length + decode.window) // _KEY_TILE + 1) * _KEY_TILE
        else:
            max_len = -(-(bucket + decode.gen_length + 1) // _ROW_GRANULE) * _ROW_GRANULE
        policy = make_policy(decode, self.config, max_len)
        return DecodeLoop(
            model=self.config,
            policy=policy,
            num_slots=decode.batch_size,
            max_len=max_len,
            gen_length=decode.gen_length,
            kernels=self.kernels,
            full_pass_lanes=self.full_pass_lanes,
            mesh=self.mesh,
        )

    def compile(self, decode: DecodeConfig, longest_prompt: int) -> CompiledLoop:
        """The compiled loop for this config and prompt-length bucket (compiled once, then cached)."""
        loop = self.decode_loop(decode, longest_prompt)
        capacity = self.queue_capacity or max(16, 4 * decode.batch_size)
        width = _next_power_of_two(longest_prompt, _MIN_PROMPT_BUCKET)
        key = (loop, capacity, width)
        if key not in self._executables:
            start = time.perf_counter()
            prompts = jax.ShapeDtypeStruct((capacity, width), jnp.int32)
            lengths = jax.ShapeDtypeStruct((capacity,), jnp.int32)
            count = jax.ShapeDtypeStruct((), jnp.int32)
            state = jax.eval_shape(loop.init_state, prompts, lengths, count)
            knobs = jax.eval_shape(decode.knobs)
            scalar = jax.ShapeDtypeStruct((), jnp.int32)
            flag = jax.ShapeDtypeStruct((), jnp.bool_)
            init_layout, run_layout = self._layouts(state)
            init = jax.jit(loop.init_state, **init_layout).lower(prompts, lengths, count).compile()
            run = (
                jax.jit(loop.run, donate_argnums=1, **run_layout)
                .lower(self.params, state, knobs, scalar, scalar, flag)
                .compile()
            )
            self._executables[key] = CompiledLoop(loop, capacity, width, init, run, time.perf_counter() - start)
        return self._executables[key]

    def _layouts(self, state: DecodeState) -> tuple[dict[str, Any], dict[str, Any]]:
        """jit's in/out shardings of init_state and run under the mesh (none without one)."""
        if self.mesh is None:
            return {}, {}
        state_sharding = sharding.state_shardings(state, self.mesh)
        fixed = sharding.replicated(self.mesh)
        params = sharding.param_shardings(self.params, self.mesh)
        init = dict(in_shardings=fixed, out_shardings=state_sharding)
        run = dict(in_shardings=(params, state_sharding) + (fixed,) * 4, out_shardings=state_sharding)
        return init, run

    # ----- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        decode: DecodeConfig,
        *,
        chat: bool | None = None,
        progress: bool = False,
    ) -> GenerationOutput:
        """Generates an answer for every prompt (text or token ids), results in request order.

        chat: apply the tokenizer's chat template to text prompts (None: when it has one).
        """
        if not prompts:
            raise GenerationError("no prompts given")
        encoded = self.encode(prompts, chat)
        self._check_lengths(encoded, decode)
        longest = max(len(p) for p in encoded)
        compiled_before = self.num_compilations
        compiled = self.compile(decode, longest)
        compile_seconds = compiled.compile_seconds if self.num_compilations > compiled_before else 0.0
        init, run, loop = compiled.init, compiled.run, compiled.loop
        queue = _HostQueue(encoded, capacity=compiled.queue_capacity, width=compiled.prompt_width)
        knobs = decode.knobs()
        seed = jnp.int32(decode.seed)
        tokens, lengths = queue.arrays()

        start = time.perf_counter()
        state: DecodeState = init(tokens, lengths, jnp.int32(queue.pushed))
        timeline = [(0, start)]
        rows: dict[int, dict[str, Any]] = {}
        bar = tqdm(total=len(encoded), desc=decode.method, unit="req", disable=not progress)
        while len(rows) < len(encoded):
            stop = timeline[-1][0] + self.chunk_iterations
            state = run(self.params, state, knobs, seed, jnp.int32(stop), jnp.bool_(queue.pushed < len(encoded)))
            results, iteration = jax.device_get((state.results, state.iteration))
            stepped = int(iteration) > timeline[-1][0]
            timeline.append((int(iteration), time.perf_counter()))
            finished = np.nonzero(results.done)[0]
            for entry in finished:
                rows[int(results.request[entry])] = {f.name: getattr(results, f.name)[entry] for f in dataclasses.fields(results)}
                queue.collected(int(results.request[entry]))
            if len(finished):
                state = state.replace(results=state.results.replace(done=jnp.zeros_like(state.results.done)))
            if queue.push():
                tokens, lengths = queue.arrays()
                state = state.replace(queue=state.queue.replace(tokens=tokens, lengths=lengths, count=jnp.int32(queue.pushed)))
            elif not len(finished) and not stepped:
                raise RuntimeError(
                    f"decode loop stalled with {len(encoded) - len(rows)} requests unfinished "
                    f"(no step, no result, nothing to push at iteration {int(iteration)})"
                )
            bar.update(len(rows) - bar.n)
        bar.close()
        wall = timeline[-1][1] - start
        results = self._results(rows, encoded, timeline)
        stats = GenerationStats(
            num_requests=len(encoded),
            num_tokens=sum(r.num_tokens for r in results),
            steps=sum(r.steps for r in results),
            forward_passes=sum(r.forward_passes for r in results),
            iterations=timeline[-1][0],
            wall_seconds=wall,
            compile_seconds=compile_seconds,
            cache_bytes=cache_bytes(self.config, loop.num_slots, loop.max_len),
        )
        return GenerationOutput(results=results, stats=stats)

    def _results(self, rows: dict[int, dict[str, Any]], encoded, timeline) -> list[GenerationResult]:
        iters = np.array([t[0] for t in timeline], np.float64)
        times = np.array([t[1] for t in timeline], np.float64)
        eos = self.config.eos_token_id
        results = []
        for i, prompt in enumerate(encoded):
            r = rows[i]
            tokens = [int(t) for t in r["tokens"]]
            ids = tokens[: tokens.index(eos)] if eos in tokens else tokens
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
            seconds = float(np.interp(r["end_iter"], iters, times) - np.interp(r["start_iter"], iters, times))
            results.append(
                GenerationResult(
                    index=i,
                    prompt_ids=list(prompt),
                    token_ids=ids,
                    text=text,
                    num_tokens=int(r["num_tokens"]),
                    steps=int(r["steps"]),
                    forward_passes=int(r["passes"] + r["verify_passes"]),
                    verify_passes=int(r["verify_passes"]),
                    accepted_drafts=int(r["accepted"]),
                    seconds=seconds,
                )
            )
        return results


class _HostQueue:
    """The host side of the request ring: request g goes to entry g % capacity once request
    g - capacity has been collected (its result row is free)."""

    def __init__(self, encoded: list[list[int]], capacity: int, width: int):
        self.encoded = encoded
        self.tokens = np.zeros((capacity, width), np.int32)
        self.lengths = np.zeros((capacity,), np.int32)
        self.done = [False] * len(encoded)
        self.pushed = 0
        self.push()

    def push(self) -> bool:
        """Pushes every request that fits; True if any was pushed."""
        capacity = self.tokens.shape[0]
        before = self.pushed
        while self.pushed < len(self.encoded) and (self.pushed < capacity or self.done[self.pushed - capacity]):
            entry, ids = self.pushed % capacity, self.encoded[self.pushed]
            self.tokens[entry] = 0
            self.tokens[entry, : len(ids)] = ids
            self.lengths[entry] = len(ids)
            self.pushed += 1
        return self.pushed > before

    def collected(self, request: int) -> None:
        self.done[request] = True

    def arrays(self) -> tuple[jax.Array, jax.Array]:
        return jnp.asarray(self.tokens), jnp.asarray(self.lengths)
