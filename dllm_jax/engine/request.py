"""A request on the host: its status, its per-slot values, and the host side of the request ring.

A request is WAITING once added to a session, RUNNING once handed to the device's request
ring (the device installs it in a slot when one frees), and then FINISHED (its result was
collected) or ABORTED. Its per-slot values are its SamplingParams resolved against the compiled
loop (dllm_jax.runtime.slots.SLOT_FIELDS): unset values take the model's defaults (its
generation_config.json) where they apply to the loop, else their own, and every value is checked
to apply to the loop. slot_values is the one place where that happens.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.common.errors import GenerationError
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.slots import ENGINE_VALUES, SLOT_FIELDS, SlotSampling
from dllm_jax.sampling.generation_defaults import GenerationDefaults
from dllm_jax.sampling.params import MAX_SEED, SamplingParams, annealing_problem, knobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # added, not yet in the device's request ring
    RUNNING = "running"  # in the device's ring or in a slot, result not collected
    FINISHED = "finished"  # its result was collected
    ABORTED = "aborted"  # stopped before it finished


@dataclasses.dataclass(eq=False)
class Request:
    """One request of a session.

    order: its add order in the session (the random stream of a request without a seed, and
    GenerationResult.index); slot_values: its per-slot values by SLOT_FIELDS name;
    ring_index: its global index g in the device ring (entry g % capacity), once RUNNING;
    reported_step: the last step whose commits were reported; pushed_iteration: the last loop
    iteration the session had read when the request entered the ring (it starts no earlier).
    """

    request_id: Hashable
    order: int
    prompt_ids: list[int]
    sampling: SamplingParams
    slot_values: dict[str, Any]
    status: RequestStatus = RequestStatus.WAITING
    ring_index: int = -1
    reported_step: int = -1
    pushed_iteration: int = -1

    @property
    def max_new_tokens(self) -> int:
        """Where its answer is cut."""
        return int(self.slot_values["max_new_tokens"])

    @property
    def gen_length(self) -> int:
        """Its canvas: the answer positions it decodes."""
        return int(self.slot_values["gen_length"])


def slot_values(
    sampling: SamplingParams,
    prompt_len: int,
    decode_config: DecodeConfig,
    *,
    cfg: bool,
    max_sequence_length: int,
    order: int,
    where: str,
    base_seed: int | None = None,
    defaults: GenerationDefaults | None = None,
) -> dict[str, Any]:
    """The per-slot values of one request (SLOT_FIELDS names), or GenerationError naming `where`.

    cfg: the loop has the guidance pass; order: the request's add order, and base_seed (None:
    the deprecated DecodeConfig.seed, else 0) the seed: together the random stream of a request
    that sets no seed. defaults: the model's values of the fields the request leaves unset
    (None: none); its max_new_tokens is cut to the request's canvas.
    """
    defaults = GenerationDefaults() if defaults is None else defaults
    problem = sampling.not_applying(decode_config, cfg)  # first: a refused knob is the reason, not its range
    if problem is not None:
        raise GenerationError(f"{where}: {problem}")
    G = decode_config.gen_length
    room = max_sequence_length - prompt_len
    canvas = sampling.gen_length
    if canvas is None:
        canvas = min(G, room)
        if canvas <= 0:
            raise GenerationError(
                f"{where}: the prompt has {prompt_len} tokens, no room for an answer within the model's "
                f"max_sequence_length={max_sequence_length}"
            )
    max_new = sampling.max_new_tokens
    if max_new is None:
        model_max_new = defaults.value("max_new_tokens", decode_config, cfg)
        max_new = canvas if model_max_new is None else min(model_max_new, canvas)
    for name, value in (("gen_length", sampling.gen_length), ("max_new_tokens", sampling.max_new_tokens)):
        if value is None:
            continue
        if value > G:
            raise GenerationError(
                f"{where}: {name}={value} is more than this engine's generation bucket gen_length={G}"
            )
        if value > room:
            raise GenerationError(
                f"{where}: {prompt_len} prompt tokens + {name}={value} = {prompt_len + value} positions, "
                f"more than the model's max_sequence_length={max_sequence_length}"
            )
    if max_new > canvas:
        raise GenerationError(
            f"{where}: max_new_tokens={max_new} is more than the request's gen_length={canvas} (its canvas)"
        )
    recorded = decode_config.max_logprobs
    if sampling.logprobs is not None and recorded is None:
        raise GenerationError(
            f"{where}: logprobs={sampling.logprobs}: this loop records no log-probabilities; compile it with "
            "DecodeConfig(max_logprobs=...) (0 or more alternatives per token)"
        )
    if sampling.logprobs is not None and sampling.logprobs > recorded:
        raise GenerationError(
            f"{where}: logprobs={sampling.logprobs} asks for {sampling.logprobs} alternatives per token; this loop "
            f"records at most {recorded} (DecodeConfig.max_logprobs)"
        )
    values: dict[str, Any] = {}
    resolved: dict[str, Any] = {}
    from_model: list[str] = []  # named in errors: the request did not set them
    for name, spec in knobs().items():
        value = getattr(sampling, name)
        if name == "max_new_tokens":
            value = max_new
        elif name == "gen_length":
            value = canvas
        elif name == "seed" and value is None:
            value = decode_config.base_seed if base_seed is None else base_seed
        elif value is None:
            value = defaults.value(name, decode_config, cfg)
            if value is None:
                value = spec.unset_value(decode_config)
            else:
                from_model.append(name)
        limit = None if spec.compiled_high is None else getattr(decode_config, spec.compiled_high)
        if limit is not None and value > limit:  # None: a loop the value does not apply to
            raise GenerationError(
                f"{where}: {name}={value} is more than the loop holds (DecodeConfig {spec.compiled_high}={limit})"
                + _origin(name, from_model, defaults)
            )
        resolved[name] = value
        values[spec.slot_name or name] = spec.encode(value) if spec.encode is not None else value
    # a request's own pair was checked when it was made; here one of them may be the model's
    problem = annealing_problem(resolved["t_min"], resolved["t_max"])
    if problem is not None:
        origins = "".join(_origin(name, from_model, defaults) for name in ("t_min", "t_max"))
        raise GenerationError(f"{where}: {problem}{origins}")
    derived = {
        "step_limit": decode_config.step_limit(prompt_len, canvas, resolved["max_denoising_steps"]),
        # int32 on the device: a long-running session's add order wraps around
        "stream": order % MAX_SEED if sampling.seed is None else 0,
        "t_span": resolved["t_max"] - resolved["t_min"],
    }
    for produced in ENGINE_VALUES.values():
        for slot_name, _ in produced:
            values[slot_name] = derived[slot_name]
    for slot_name, dtype in SLOT_FIELDS:  # what the ring stores must fit its dtype (never an overflow there)
        _check_fits(slot_name, values[slot_name], dtype, where)
    return values


def _origin(name: str, from_model: list[str], defaults: GenerationDefaults) -> str:
    """The note "; NAME is the model's default, from FILE" for a value the model's generation_config gave."""
    return f"; {name} is the model's default, from {defaults.source}" if name in from_model else ""


def _check_fits(name: str, value: Any, dtype: type, where: str) -> None:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        fits = info.min <= int(value) <= info.max
    elif np.issubdtype(dtype, np.floating):
        fits = bool(np.isfinite(value)) and abs(float(value)) <= float(np.finfo(dtype).max)
    else:
        fits = isinstance(value, (bool, np.bool_))
    if not fits:
        raise GenerationError(f"{where}: {name}={value!r} does not fit the device's {np.dtype(dtype).name}")


class HostRing:
    """The host side of the device's request ring: request g goes to entry g % capacity once
    request g - capacity has been collected (its result entry is free)."""

    def __init__(self, capacity: int, width: int):
        self.tokens = np.zeros((capacity, width), np.int32)
        self.lengths = np.zeros((capacity,), np.int32)
        self.sampling = {name: np.zeros((capacity,), dtype) for name, dtype in SLOT_FIELDS}
        self.free = np.ones((capacity,), bool)

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    def put(self, request: Request) -> None:
        entry = request.ring_index % self.capacity
        self.tokens[entry] = 0
        self.tokens[entry, : len(request.prompt_ids)] = request.prompt_ids
        self.lengths[entry] = len(request.prompt_ids)
        for name, value in request.slot_values.items():
            self.sampling[name][entry] = value
        self.free[entry] = False

    def arrays(self) -> tuple[jax.Array, jax.Array, SlotSampling]:
        sampling = SlotSampling(**{name: jnp.asarray(a) for name, a in self.sampling.items()})
        return jnp.asarray(self.tokens), jnp.asarray(self.lengths), sampling
