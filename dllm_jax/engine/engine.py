"""The engine: prompts in, answers and statistics out, over the jitted decode loop.

``Engine.generate(prompts, sampling, decode_config=DecodeConfig(...))`` tokenizes (the chat
template only with chat=True; ``Engine.chat`` takes message lists), buckets the shapes (prompt
length to a power of two, slots to the request count rounded to a power of two) so that
requests of different lengths and sampling values reuse one compiled loop, runs it through a
GenerationSession in chunks of iterations (no host round trip per step) and returns results
in request order (dllm_jax.engine.results: how answers are cut and tokens counted).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from dllm_jax.common.deprecation import renamed_argument, warn_renamed
from dllm_jax.common.errors import GenerationError
from dllm_jax.common.validate import check_bool, check_int
from dllm_jax.engine.compiled_loop import CompiledLoop
from dllm_jax.engine.loop_call import CallPackings, loop_call
from dllm_jax.engine.request import slot_values
from dllm_jax.engine.results import GenerationOutput, GenerationResult, GenerationStats
from dllm_jax.engine.session import GenerationSession
from dllm_jax.models import diffusion_gemma
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Weights, unstack_layers
from dllm_jax.policies.factory import make_canvas_policy, make_policy
from dllm_jax.runtime import sharding
from dllm_jax.runtime.batch_invariance import check_model as check_invariant_model
from dllm_jax.runtime.canvas_cache import canvas_cache_bytes
from dllm_jax.runtime.canvas_loop import CanvasLoop
from dllm_jax.runtime.canvas_memory import check_canvas_loop, estimate_canvas_loop
from dllm_jax.runtime.compiler_options import default_compiler_options
from dllm_jax.runtime.decode_config import DecodeConfig, DecodeConfigError
from dllm_jax.runtime.decode_loop import DecodeLoop, DecodeState
from dllm_jax.runtime.flat_cache import cache_bytes
from dllm_jax.runtime.kernel_routing import Kernels, resolve_kernels
from dllm_jax.runtime.memory_estimate import check_decode_loop, estimate_decode_loop
from dllm_jax.runtime.slots import zero_sampling
from dllm_jax.sampling.generation_defaults import GENERATION_CONFIG_MODES, GenerationDefaults
from dllm_jax.sampling.params import MAX_SEED, SamplingParams

__all__ = ["CompiledLoop", "Engine", "GenerationOutput", "GenerationResult", "GenerationStats"]

# flash_cache: max_len as the reference computes it (reference-spec B.1); key lengths are
# rounded to 128 within it. Block methods attend to exactly prompt + gen_length positions, so
# their slots need only that plus the trash row, rounded to _ROW_GRANULE (their full passes
# compute every row of a slot, so slack rows are wasted work).
_KEY_TILE = 128
_ROW_GRANULE = 32
_MIN_PROMPT_BUCKET = 16


def _next_power_of_two(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _first_execution(weights: Weights, compiled: CompiledLoop) -> None:
    """Runs a new GPU executable once, for zero iterations over an empty queue, so that its
    first execution's one-time cost (loading its kernels, setting up its GEMMs) comes with the
    compile and not with the first request. On the H200 (LLaDA-8B, 1 slot) the first full pass
    of a fresh loop took 137 ms, and 20 ms after this run (which took 76 ms)."""
    Q, P = compiled.queue_capacity, compiled.prompt_width
    state = compiled.init(jnp.zeros((Q, P), jnp.int32), jnp.zeros((Q,), jnp.int32), zero_sampling((Q,)), jnp.int32(0))
    jax.block_until_ready(compiled.run(weights, state, 0))


class Engine:
    """Holds a model and its compiled decode loops.

    Args:
      config: the model architecture.
      weights: the model's weights (on the device; `params` is its deprecated name).
      tokenizer: a dllm_jax tokenizer (encode/decode), needed for text prompts.
      backend: "auto" (per op, what measured fastest on this device), "xla", "pallas", or a
        dllm_jax.runtime.kernel_routing.Kernels choosing op by op.
      interpret: run Pallas kernels in interpret mode (CPU tests).
      unroll_layers: run the layer loop unrolled over per-layer weight arrays instead of a
        scan over the layer-stacked ones. On the H200 the scan copied every layer's weights
        out of the stack at every step (8.6 ms of a 16 ms step at one slot); unrolled, the
        program is larger (compile time grows) but reads the weights in place. Stacked weights
        are split once here (the caller should drop its stacked copy); weights whose "layers"
        is already a tuple (model.init_params_per_layer) always run unrolled.
      chunk_iterations: loop iterations per device call (progress/timing granularity).
      queue_capacity: entries of the on-device request and result rings (None: max(16, 4 B)).
        The host pushes request g once request g - capacity has been collected.
      full_pass_lanes: batch sizes of the compiled full-pass variants (None: 1, B/4 and B).
        Fewer variants compile faster; (B,) suits batches whose slots refill together.
        With a mesh, B is the slots of one data shard.
      mesh: decode over several devices (dllm_jax.runtime.sharding.parse_mesh): slots split across
        its data axis, weights and cache across its tensor axis, a DiffusionGemma model's
        experts across its expert and tensor axes. The weights are laid out for it here (a
        no-op if they already are).
      batch_invariant: compile every pass so that a slot's rows are computed independently of
        the other slots (dllm_jax.runtime.batch_invariance): a request's answer does not depend on
        the batch it runs in. Run-to-run determinism on GPUs also needs
        batch_invariance.deterministic_xla_flags() in XLA_FLAGS before JAX starts.
      compiler_options: XLA options every loop is compiled with (None: the defaults of
        dllm_jax.runtime.compiler_options, e.g. whole-loop CUDA graphs on NVIDIA GPUs; {}: XLA's).
      generation_defaults: the model's values of the SamplingParams a request leaves unset
        (dllm_jax.sampling.generation_defaults; from_pretrained reads the folder's
        generation_config.json); None: SamplingParams' own defaults.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights = None,
        tokenizer: Any = None,
        *,
        backend: str | Kernels = "auto",
        interpret: bool = False,
        chunk_iterations: int = 64,
        queue_capacity: int | None = None,
        full_pass_lanes: tuple[int, ...] | None = None,
        unroll_layers: bool = False,
        mesh: Mesh | None = None,
        compiler_options: dict[str, Any] | None = None,
        batch_invariant: bool = False,
        generation_defaults: GenerationDefaults | None = None,
        params: Weights = None,
    ):
        weights = renamed_argument("weights", weights, "params", params, "Engine")
        if weights is None:
            raise GenerationError("Engine: weights are required (the model's parameter tree)")
        check_bool("interpret", interpret, GenerationError)
        check_bool("batch_invariant", batch_invariant, GenerationError)
        if compiler_options is not None and not isinstance(compiler_options, dict):
            raise GenerationError(f"compiler_options={compiler_options!r}: expected a dict of XLA options or None")
        self.compiler_options = (
            default_compiler_options(config.quantization) if compiler_options is None else compiler_options
        )
        check_bool("unroll_layers", unroll_layers, GenerationError)
        check_int("chunk_iterations", chunk_iterations, GenerationError, low=1)
        check_int("queue_capacity", queue_capacity, GenerationError, low=1, optional=True)
        if full_pass_lanes is not None:
            if not isinstance(full_pass_lanes, (tuple, list)):
                raise GenerationError(
                    f"full_pass_lanes={full_pass_lanes!r}: expected a tuple of ints (() = only all B slots) or None"
                )
            full_pass_lanes = tuple(
                check_int("full_pass_lanes entry", n, GenerationError, low=1) for n in full_pass_lanes
            )
        if generation_defaults is not None and not isinstance(generation_defaults, GenerationDefaults):
            raise GenerationError(f"generation_defaults={generation_defaults!r}: expected a GenerationDefaults or None")
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.generation_defaults = GenerationDefaults() if generation_defaults is None else generation_defaults
        # DiffusionGemma (block diffusion): its own loop, dllm_jax.runtime.canvas_loop
        self._block_diffusion = config.family == "diffusion_gemma"
        if self._block_diffusion and batch_invariant:
            raise GenerationError("a DiffusionGemma model runs without batch_invariant, for now")
        try:
            self.kernels = resolve_kernels(backend, interpret, batch_invariant)
            if batch_invariant:
                check_invariant_model(config)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        if batch_invariant and self.kernels.matmul and sharding.axis_size(mesh, sharding.TENSOR) > 1:
            raise GenerationError(
                "batch_invariant=True with the Pallas matmul does not shard over a tensor axis; use a data-only mesh"
            )
        self._unroll_layers = unroll_layers
        if unroll_layers:
            self.weights = weights = self._unstacked(weights)
        self.mesh = mesh
        if mesh is not None:
            sharding.check_model(mesh, config)
            self.weights = weights = sharding.place_params(weights, mesh)
        self.chunk_iterations = chunk_iterations
        self.queue_capacity = queue_capacity
        self.full_pass_lanes = full_pass_lanes
        self._executables: dict[tuple, CompiledLoop] = {}

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: str | None = None,
        quantization: str | None = None,
        generation_config: str = "auto",
        **kwargs,
    ) -> Engine:
        """Loads a Hugging Face LLaDA, Dream or DiffusionGemma folder, a converted checkpoint or a
        cached Hub id (dllm_jax.load_model; dtype None: float32 on the CPU, bfloat16 on accelerators;
        quantization: dllm_jax.models.quantization, None = as stored). generation_config: "auto"
        (the folder's generation_config.json gives the defaults of what requests leave unset) or
        "none" (SamplingParams' own defaults)."""
        from dllm_jax.models.loading import load_model

        if generation_config not in GENERATION_CONFIG_MODES:
            raise GenerationError(
                f"generation_config={generation_config!r}: expected one of {', '.join(GENERATION_CONFIG_MODES)}"
            )
        loaded = load_model(path, dtype=dtype, quantization=quantization)
        defaults = (
            GenerationDefaults.from_hf(loaded.generation_config, source=loaded.generation_config_file)
            if generation_config == "auto"
            else None
        )
        return cls(loaded.config, loaded.weights, loaded.tokenizer, generation_defaults=defaults, **kwargs)

    def _unstacked(self, weights: Weights) -> Weights:
        """The weights with each layer stack as a tuple of per-layer trees (unroll_layers)."""
        return diffusion_gemma.unstack_layers(weights) if self._block_diffusion else unstack_layers(weights)

    @property
    def params(self) -> Weights:
        """Deprecated name of `weights`."""
        warn_renamed("Engine.params", "Engine.weights")
        return self.weights

    def swap_weights(self, weights: Weights) -> None:
        """Decodes with `weights` from now on, without recompiling: a tree of the same structure,
        shapes and dtypes as the current one (e.g. a trainer's weights between evaluations).
        Sessions made before keep the weights they were made with.

        Raises GenerationError naming the first leaf that differs.
        """
        if self._unroll_layers:
            weights = self._unstacked(weights)

        (new, new_def), (old, old_def) = (jax.tree_util.tree_flatten_with_path(t) for t in (weights, self.weights))
        if new_def != old_def:
            raise GenerationError("swap_weights: the weights tree has another structure than the engine's")
        for (path, got), (_, want) in zip(new, old):
            got, want = (tuple(got.shape), jnp.dtype(got.dtype)), (tuple(want.shape), jnp.dtype(want.dtype))
            if got != want:
                raise GenerationError(
                    f"swap_weights: {jax.tree_util.keystr(path)} is {got}, the engine's is {want} (shape, dtype)"
                )
        self.weights = sharding.place_params(weights, self.mesh) if self.mesh is not None else weights

    def swap_params(self, params: Weights) -> None:
        """Deprecated name of `swap_weights`."""
        warn_renamed("Engine.swap_params", "Engine.swap_weights")
        self.swap_weights(params)

    @property
    def backend(self) -> str:
        """What runs the per-layer ops: "xla", "pallas" or a mix ("+invariant": batch-invariant)."""
        return self.kernels.name

    @property
    def batch_invariant(self) -> bool:
        return self.kernels.invariant

    @property
    def num_compilations(self) -> int:
        """Decode loops compiled so far (one per static configuration and shape bucket)."""
        return len(self._executables)

    @property
    def default_decode_config(self) -> DecodeConfig:
        """The DecodeConfig of calls that pass none: flash_cache, a generation bucket of
        min(256, max_sequence_length // 2); for DiffusionGemma diffusion_gemma over the canvases
        that hold the model's max_new_tokens (generation_defaults; one canvas without it)."""
        if self._block_diffusion:
            length = self.generation_defaults.canvas_bucket(
                self.config.canvas_length, self.config.max_sequence_length // 2
            )
            return DecodeConfig(method="diffusion_gemma", gen_length=length).for_model(self.config)
        return DecodeConfig(gen_length=max(1, min(256, self.config.max_sequence_length // 2)))

    def resolve(self, decode_config: DecodeConfig | None) -> DecodeConfig:
        """The configuration as it runs on this engine's model (None: the default), with what
        the model decides filled in (DecodeConfig.for_model); raises GenerationError when the
        method does not run this model's family."""
        if decode_config is None:
            return self.default_decode_config
        try:
            return _decode_config(decode_config).for_model(self.config)
        except DecodeConfigError as e:
            raise GenerationError(str(e)) from None

    # ----- inputs ----------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str | Sequence[int]], chat: bool = False) -> list[list[int]]:
        """Token ids of each prompt: text (through the chat template when chat=True) or ids.

        prompts: a list (or tuple) of prompts, each a string or a sequence / 1-D integer array
        of token ids; a 2-D integer array is a list of equal-length id prompts.
        """
        check_bool("chat", chat, GenerationError)
        prompts = _prompt_list(prompts)
        encoded = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise GenerationError(f"prompt {i} is text but the engine has no tokenizer; pass token ids")
                if not prompt.strip():
                    raise GenerationError(f"prompt {i} is empty")
                try:
                    ids = list(self.tokenizer.encode(prompt, chat=chat))
                except (TypeError, UnicodeError) as e:
                    raise GenerationError(f"prompt {i} cannot be encoded ({type(e).__name__}: {e})") from None
            else:
                ids = _token_ids(prompt, f"prompt {i}")
            encoded.append(self._check_ids(ids, f"prompt {i}"))
        return encoded

    def encode_chat(self, conversations: Sequence[Sequence[dict]]) -> list[list[int]]:
        """Token ids of each conversation (a list of {"role", "content"} messages) through the
        tokenizer's chat template, ending with the assistant's header."""
        if self.tokenizer is None:
            raise GenerationError("chat needs a tokenizer (the engine has none)")
        if (
            isinstance(conversations, (str, bytes, dict))
            or not isinstance(conversations, Sequence)
            or not conversations
        ):
            raise GenerationError(
                f"conversations: expected a non-empty list of message lists, got {type(conversations).__name__}"
            )
        encoded = []
        for i, messages in enumerate(conversations):
            where = f"conversation {i}"
            if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
                raise GenerationError(f"{where}: expected a non-empty list of messages, got {type(messages).__name__}")
            for j, m in enumerate(messages):
                if (
                    not isinstance(m, dict)
                    or m.get("role") not in ("system", "user", "assistant")
                    or not isinstance(m.get("content"), str)
                ):
                    raise GenerationError(
                        f'{where} message {j}: expected {{"role": "system"|"user"|"assistant", "content": str}}, got {m!r}'
                    )
            try:
                ids = list(self.tokenizer.apply_chat_template([dict(m) for m in messages]))
            except (TypeError, UnicodeError, ValueError) as e:
                raise GenerationError(f"{where} cannot be encoded ({type(e).__name__}: {e})") from None
            encoded.append(self._check_ids(ids, where))
        return encoded

    def _check_ids(self, ids: list[int], where: str) -> list[int]:
        if not ids:
            raise GenerationError(f"{where} is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise GenerationError(f"{where} has token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
        image = self.config.image_token_id if self._block_diffusion else None
        if image is not None and image in ids:
            raise GenerationError(
                f"{where} holds the image token {image} at {ids.index(image)}: image inputs are not supported "
                "(only the text model is loaded)"
            )
        return ids

    # ----- compiled loops --------------------------------------------------------------------

    def decode_loop(
        self, decode_config: DecodeConfig, max_prompt_len: int, num_slots: int | None = None
    ) -> DecodeLoop | CanvasLoop:
        """The loop for this config, prompt-length bucket (max_len from it) and slot count."""
        decode_config = self.resolve(decode_config)
        num_slots = decode_config.batch_size if num_slots is None else num_slots
        if self.mesh is not None:
            sharding.check_batch(self.mesh, num_slots)
        bucket = _next_power_of_two(max_prompt_len, _MIN_PROMPT_BUCKET)
        if decode_config.method == "diffusion_gemma":
            # the prompt bucket, then whole canvases (the last one is never encoded: no trash row needed)
            generated = decode_config.canvases * decode_config.window
            return CanvasLoop(
                model=self.config,
                policy=make_canvas_policy(decode_config, self.config),
                num_slots=num_slots,
                max_len=-(-(bucket + generated) // _ROW_GRANULE) * _ROW_GRANULE,
                gen_length=generated,
                kernels=self.kernels,
                full_pass_lanes=self.full_pass_lanes,
                mesh=self.mesh,
            )
        if decode_config.method == "flash_cache":
            max_len = ((bucket + decode_config.gen_length + decode_config.window) // _KEY_TILE + 1) * _KEY_TILE
        else:
            max_len = -(-(bucket + decode_config.gen_length + 1) // _ROW_GRANULE) * _ROW_GRANULE
        policy = make_policy(decode_config, self.config, max_len)
        return DecodeLoop(
            model=self.config,
            policy=policy,
            num_slots=num_slots,
            max_len=max_len,
            gen_length=decode_config.gen_length,
            kernels=self.kernels,
            full_pass_lanes=self.full_pass_lanes,
            mesh=self.mesh,
            cfg=decode_config.cfg,
            max_logprobs=decode_config.max_logprobs,
        )

    def slots_for(self, decode_config: DecodeConfig, num_requests: int, longest_prompt: int) -> int:
        """Slots for a call of `num_requests`: at most decode_config.batch_size and at most the
        requests rounded up to a power of two (a multiple of the mesh's data axis), so calls
        of similar sizes share a loop; a loop already compiled for this bucket with more
        slots (up to batch_size) is reused rather than compiling a smaller one."""
        B = decode_config.batch_size
        wanted = min(B, _next_power_of_two(num_requests, 1))
        if self.mesh is not None:
            sharding.check_batch(self.mesh, B)  # the configured size must fit the mesh, whatever a call uses
            data = sharding.axis_size(self.mesh, sharding.DATA)
            wanted = max(wanted, data)
            if wanted % data or wanted > B:
                wanted = B
        width = _next_power_of_two(longest_prompt, _MIN_PROMPT_BUCKET)
        larger = sorted(
            {key[0].num_slots for key in self._executables if key[2] == width and wanted < key[0].num_slots <= B}
        )
        for n in [wanted, *larger]:
            loop = self.decode_loop(decode_config, longest_prompt, n)
            if any(key[0] == loop and key[2] == width for key in self._executables):
                return n
        return wanted

    def compile(self, decode_config: DecodeConfig, longest_prompt: int, num_slots: int | None = None) -> CompiledLoop:
        """The compiled loop for this config, prompt-length bucket and slot count (None:
        decode_config.batch_size); compiled once, then cached.

        Before compiling, the memory the loop needs (cache, state, the largest pass's
        temporaries; the weights are already loaded) is checked against what the device has
        free (dllm_jax.runtime.memory_estimate; $DLLM_MEMORY_AVAILABLE overrides the reading):
        raises InsufficientMemoryError, a GenerationError saying what to lower, before anything of
        the loop is allocated. An engine over abstract weights (jax.ShapeDtypeStruct leaves, e.g.
        scripts/memory_profile.py) only compiles, so its loops are estimated, not checked.
        """
        decode_config = self.resolve(decode_config)
        loop = self.decode_loop(decode_config, longest_prompt, num_slots)
        capacity = self.queue_capacity or max(16, 4 * loop.num_slots)
        width = _next_power_of_two(longest_prompt, _MIN_PROMPT_BUCKET)
        key = (loop, capacity, width)
        if key not in self._executables:
            abstract = any(isinstance(w, jax.ShapeDtypeStruct) for w in jax.tree.leaves(self.weights))
            estimate, check = (
                (estimate_canvas_loop, check_canvas_loop)
                if isinstance(loop, CanvasLoop)
                else (estimate_decode_loop, check_decode_loop)
            )
            memory = (estimate if abstract else check)(loop, queue_capacity=capacity, prompt_width=width)
            start = time.perf_counter()
            prompts = jax.ShapeDtypeStruct((capacity, width), jnp.int32)
            lengths = jax.ShapeDtypeStruct((capacity,), jnp.int32)
            sampling = jax.eval_shape(lambda: zero_sampling((capacity,)))
            count = jax.ShapeDtypeStruct((), jnp.int32)
            state = jax.eval_shape(loop.init_state, prompts, lengths, sampling, count)
            packings = CallPackings.of(state)
            control = jax.ShapeDtypeStruct((packings.control.num_ints,), jnp.int32)
            ring = (
                jax.ShapeDtypeStruct((packings.ring.num_ints,), jnp.int32),
                jax.ShapeDtypeStruct((packings.ring.num_floats,), jnp.float32),
            )
            init_layout, call_layout = self._layouts(state)
            options = self.compiler_options or None
            init = jax.jit(loop.init_state, **init_layout).lower(prompts, lengths, sampling, count).compile(options)
            call = (
                jax.jit(functools.partial(loop_call, loop, packings), donate_argnums=1, **call_layout)
                .lower(self.weights, state, control, *ring)
                .compile(options)
            )
            compiled = CompiledLoop(
                loop, decode_config, capacity, width, init, call, packings, time.perf_counter() - start, memory
            )
            if not abstract and jax.devices()[0].platform == "gpu":
                _first_execution(self.weights, compiled)
            self._executables[key] = compiled
        compiled = self._executables[key]
        # the configuration this call asked for (equal to the compiled one; its deprecated
        # request defaults may differ)
        return dataclasses.replace(compiled, decode_config=decode_config)

    def _layouts(self, state: DecodeState) -> tuple[dict[str, Any], dict[str, Any]]:
        """jit's in/out shardings of init_state and of the loop's call under the mesh (none
        without one): the control, the ring and the report replicated."""
        if self.mesh is None:
            return {}, {}
        state_sharding = sharding.state_shardings(state, self.mesh)
        fixed = sharding.replicated(self.mesh)
        weights = sharding.param_shardings(self.weights, self.mesh)
        init = dict(in_shardings=fixed, out_shardings=state_sharding)
        call = dict(in_shardings=(weights, state_sharding) + (fixed,) * 3, out_shardings=(state_sharding, fixed))
        return init, call

    # ----- generation ------------------------------------------------------------------------

    def session(
        self,
        decode_config: DecodeConfig | None = None,
        *,
        max_prompt_len: int,
        num_slots: int | None = None,
        stream: bool = False,
        decode: DecodeConfig | None = None,
    ) -> GenerationSession:
        """A GenerationSession over a loop compiled for `decode_config` (None: the default), this
        prompt-length bucket and slot count (None: decode_config.batch_size); see
        dllm_jax.engine.session. `decode` is the deprecated name of decode_config."""
        decode_config = renamed_argument("decode_config", decode_config, "decode", decode, "Engine.session")
        decode_config = self.resolve(decode_config)
        check_int("max_prompt_len", max_prompt_len, GenerationError, low=1)
        check_int("num_slots", num_slots, GenerationError, low=1, optional=True)
        check_bool("stream", stream, GenerationError)
        compiled = self.compile(decode_config, max_prompt_len, num_slots=num_slots)
        return GenerationSession(
            compiled,
            self.weights,
            tokenizer=self.tokenizer,
            max_prompt_len=max_prompt_len,
            stream=stream,
            chunk_iterations=self.chunk_iterations,
            defaults=self.generation_defaults,
        )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | DecodeConfig | None = None,
        *,
        decode_config: DecodeConfig | None = None,
        chat: bool = False,
        progress: bool = False,
        seed: int | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        decode: DecodeConfig | None = None,
    ) -> GenerationOutput:
        """Generates an answer for every prompt (text or token ids), results in request order.

        sampling: one SamplingParams for every prompt, or a list of one per prompt (None: the
          defaults). A DecodeConfig here is taken as `decode_config` (the oldest signature).
        decode_config: the compiled configuration (None: `default_decode_config`).
        chat: apply the tokenizer's chat template to text prompts (never applied otherwise).
        seed: the seed of requests whose SamplingParams set none: request i draws stream i of it
          (None: the deprecated DecodeConfig.seed, else 0).
        params, decode: the deprecated names of sampling and decode_config.
        """
        sampling = renamed_argument("sampling", sampling, "params", params, "Engine.generate")
        decode_config = renamed_argument("decode_config", decode_config, "decode", decode, "Engine.generate")
        if isinstance(sampling, DecodeConfig):
            if decode_config is not None:
                raise GenerationError("a DecodeConfig given twice (as sampling and as decode_config=)")
            sampling, decode_config = None, sampling
        encoded = self.encode(prompts, chat)
        return self._generate(encoded, sampling, decode_config, progress, seed)

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        decode_config: DecodeConfig | None = None,
        progress: bool = False,
        seed: int | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        decode: DecodeConfig | None = None,
    ) -> GenerationOutput:
        """Answers each conversation (a list of {"role": "system"|"user"|"assistant",
        "content": str} messages, multi-turn) through the tokenizer's chat template (seed: as in
        generate; params, decode: the deprecated names of sampling and decode_config)."""
        sampling = renamed_argument("sampling", sampling, "params", params, "Engine.chat")
        decode_config = renamed_argument("decode_config", decode_config, "decode", decode, "Engine.chat")
        return self._generate(self.encode_chat(conversations), sampling, decode_config, progress, seed)

    def _generate(
        self, encoded: list[list[int]], sampling, decode_config: DecodeConfig | None, progress: bool, seed: int | None
    ) -> GenerationOutput:
        check_int("seed", seed, GenerationError, low=0, high=MAX_SEED - 1, optional=True)
        decode_config = self.resolve(decode_config)
        per_request = _sampling_list(sampling, len(encoded), decode_config)
        if decode_config.method == "llada" and not decode_config.cfg and any(p.cfg_scale > 0 for p in per_request):
            decode_config = dataclasses.replace(decode_config, cfg=True)  # the guided variant, compiled on demand
        for i, (ids, p) in enumerate(zip(encoded, per_request)):  # every request checked before compiling
            slot_values(
                p,
                len(ids),
                decode_config,
                cfg=decode_config.cfg,
                max_sequence_length=self.config.max_sequence_length,
                order=i,
                where=f"request {i}",
                base_seed=seed,
                defaults=self.generation_defaults,
            )
        longest = max(len(p) for p in encoded)
        compiled_before = self.num_compilations
        compiled = self.compile(decode_config, longest, num_slots=self.slots_for(decode_config, len(encoded), longest))
        compile_seconds = compiled.compile_seconds if self.num_compilations > compiled_before else 0.0
        session = GenerationSession(
            compiled,
            self.weights,
            tokenizer=self.tokenizer,
            max_prompt_len=longest,
            chunk_iterations=self.chunk_iterations,
            seed=seed,
            defaults=self.generation_defaults,
        )
        for i, (ids, p) in enumerate(zip(encoded, per_request)):
            session.add(i, ids, p)
        results: dict[int, GenerationResult] = {}
        bar = tqdm(total=len(encoded), desc=decode_config.method, unit="req", disable=not progress)
        while len(results) < len(encoded):
            for update in session.step():
                if update.result is not None:
                    results[update.request_id] = update.result
            bar.update(len(results) - bar.n)
        bar.close()
        ordered = [results[i] for i in range(len(encoded))]
        loop = compiled.loop
        stats = GenerationStats(
            num_requests=len(encoded),
            reference_num_tokens=sum(r.reference_num_tokens for r in ordered),
            completion_tokens=sum(r.completion_tokens for r in ordered),
            steps=sum(r.steps for r in ordered),
            forward_passes=sum(r.forward_passes for r in ordered),
            iterations=session.timeline[-1][0],
            wall_seconds=session.timeline[-1][1] - session.started_at,
            compile_seconds=compile_seconds,
            cache_bytes=(canvas_cache_bytes if isinstance(loop, CanvasLoop) else cache_bytes)(
                self.config, loop.num_slots, loop.max_len
            ),
        )
        return GenerationOutput(results=ordered, stats=stats)


def _decode_config(decode_config: Any) -> DecodeConfig:
    if not isinstance(decode_config, DecodeConfig):
        raise GenerationError(
            f"decode_config={decode_config!r} ({type(decode_config).__name__}): expected a DecodeConfig or None"
        )
    return decode_config


def _sampling_list(sampling: Any, count: int, decode_config: DecodeConfig) -> list[SamplingParams]:
    """One SamplingParams per request: None (the defaults), one for all, or one each."""
    if sampling is None:
        temperature = decode_config.temperature  # deprecated request default
        return [SamplingParams() if temperature is None else SamplingParams(temperature=temperature)] * count
    if isinstance(sampling, SamplingParams):
        return [sampling] * count
    if isinstance(sampling, (list, tuple)):
        if len(sampling) != count:
            raise GenerationError(
                f"sampling: {len(sampling)} SamplingParams for {count} prompts; expected one per prompt"
            )
        for i, p in enumerate(sampling):
            if not isinstance(p, SamplingParams):
                raise GenerationError(f"sampling[{i}]={p!r} ({type(p).__name__}): expected a SamplingParams")
        return list(sampling)
    raise GenerationError(
        f"sampling={sampling!r} ({type(sampling).__name__}): expected a SamplingParams, a list of them (one per prompt) or None"
    )


def _prompt_list(prompts: Any) -> list[Any]:
    """The prompts as a list; rejects a lone string/bytes/1-D array where a list is expected."""
    if isinstance(prompts, (str, bytes, bytearray)):
        raise GenerationError(
            f"prompts: expected a list of prompts, got a {type(prompts).__name__} (wrap one prompt in a list: [prompt])"
        )
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim != 2:
            raise GenerationError(
                f"prompts: expected a list of prompts or a 2-D array of token ids [N, P], got an array of shape {prompts.shape}"
            )
        prompts = list(np.asarray(prompts))
    if not isinstance(prompts, (list, tuple)):
        raise GenerationError(f"prompts: expected a list of prompts, got {type(prompts).__name__}")
    if not prompts:
        raise GenerationError("no prompts given")
    return list(prompts)


def _token_ids(prompt: Any, where: str) -> list[int]:
    """A prompt of token ids as a list of ints: only integers (no bools, floats or strings)."""
    if isinstance(prompt, (bytes, bytearray)):
        raise GenerationError(f"{where}: bytes are not a prompt; expected a string or a list of token ids")
    if isinstance(prompt, (np.ndarray, jax.Array)):
        if prompt.ndim != 1:
            raise GenerationError(f"{where}: expected a 1-D array of token ids, got shape {prompt.shape}")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise GenerationError(f"{where}: expected integer token ids, got an array of {prompt.dtype}")
        return [int(t) for t in np.asarray(prompt)]
    if not isinstance(prompt, (list, tuple)):
        raise GenerationError(f"{where}: expected a string or a list of token ids, got {type(prompt).__name__}")
    ids = []
    for j, t in enumerate(prompt):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise GenerationError(f"{where} token {j}: {t!r} ({type(t).__name__}) is not an integer token id")
        ids.append(int(t))
    return ids
