"""What a finished request returns, and where an answer ends.

An answer ends before the first end token (EOS or one of the request's stop_token_ids) and,
in text, before the first stop string. The engine's results, the sessions' and the server's
streamed text all cut answers with the functions here.

Token accounting (the throughput numerator, `reference_num_tokens`): for flash_cache, the
committed generated positions when the request stops (it stops once every position before the
first committed EOS is decoded), as the published Flash-dLLM code counts; for llada and
fast_dllm, which decode all gen_length positions, the positions up to and including the first
EOS. A request cut at max_new_tokens (shorter than its gen_length) is credited at most
max_new_tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from dllm_jax.runtime.slots import ERROR_MESSAGES
from dllm_jax.text.tokenizer import tokens_within

Decode = Callable[[Sequence[int]], str]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability when it was committed, and the most likely tokens
    of that step (token id, log-probability; most likely first; SamplingParams.logprobs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(token: int, records: dict[str, Any], position: int, count: int) -> TokenLogprob:
    """The TokenLogprob of the token at one answer position, from the per-position records
    (records["logprob"] [G], records["top_ids"] / records["top_logprobs"] [G, K]), with
    `count` alternatives."""
    ids, values = records["top_ids"][position][:count], records["top_logprobs"][position][:count]
    return TokenLogprob(int(token), float(records["logprob"][position]), tuple(zip(map(int, ids), map(float, values))))


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """One request's answer and counters.

    index: the request's position in its generate()/chat() call (add order in a session);
    token_ids: the returned answer's ids (before the first EOS, stop id or stop string); text:
    their decoding, cut before the first stop string (None without a tokenizer);
    finish_reason: "stop" (EOS, a stop id or a stop string ended it), "length" (it used all its
    max_new_tokens) or "error" (see `error`); prompt_tokens, completion_tokens: tokens of the
    prompt and of the returned answer (EOS padding and the stop string's tokens excluded);
    reference_num_tokens: tokens credited as the published code counts them, the throughput
    numerator (see module docstring); steps: decode steps (the first full pass included);
    forward_passes: model passes over this request's rows (main + verify); accepted_drafts:
    drafts accepted by Flash-Verify; seconds: wall time from install to finish, interpolated
    between chunk timestamps; error: what went wrong when finish_reason is "error";
    logprobs: one TokenLogprob per returned token when the request asked (SamplingParams.logprobs),
    else None.
    """

    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reference_num_tokens: int
    steps: int
    forward_passes: int
    verify_passes: int
    accepted_drafts: int
    seconds: float
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """Totals of one generate() call; reference_num_tokens is the throughput numerator."""

    num_requests: int
    reference_num_tokens: int
    completion_tokens: int
    steps: int
    forward_passes: int
    iterations: int
    wall_seconds: float
    compile_seconds: float
    cache_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.reference_num_tokens / self.wall_seconds if self.wall_seconds > 0 else float("nan")

    @property
    def tokens_per_step(self) -> float:
        return self.reference_num_tokens / self.steps if self.steps else float("nan")


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    results: list[GenerationResult]
    stats: GenerationStats


def first_stop(text: str, stops: Iterable[str]) -> int | None:
    """Index of the earliest occurrence of any stop string in text, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def cut_at_end_ids(ids: Sequence[int], end_ids: Iterable[int]) -> tuple[list[int], bool]:
    """The ids before the first end token, and whether one was found."""
    ends = frozenset(end_ids)
    for k, t in enumerate(ids):
        if t in ends:
            return list(ids[:k]), True
    return list(ids), False


def cut_at_stop_strings(ids: Sequence[int], decode: Decode, stops: Sequence[str]) -> tuple[list[int], str, bool]:
    """The ids and text before the first stop string of decode(ids), and whether one was found.
    The ids kept are the most leading ones whose text fits before the cut."""
    text = decode(list(ids))
    cut = first_stop(text, stops)
    if cut is None:
        return list(ids), text, False
    text = text[:cut]
    return list(ids[: tokens_within(decode, list(ids), len(text))]), text, True


def finished_result(
    request: Any,
    row: dict[str, Any],
    timeline: list[tuple[int, float]],
    *,
    eos_ids: tuple[int, ...],
    decode: Decode | None,
) -> GenerationResult:
    """A finished request's GenerationResult from its results-ring row.

    request: a dllm_jax.engine.request.Request; row: the results ring's fields at its entry
    (numpy; the logprob fields only when the request asked for them); timeline: (loop
    iteration, time) at each device call, to interpolate its seconds; eos_ids: the model's
    end ids.
    """
    sampling = request.sampling
    answer = [int(t) for t in row["tokens"][: request.max_new_tokens]]
    ids, stopped = cut_at_end_ids(answer, (*eos_ids, *sampling.stop_token_ids))
    text = None
    if decode is not None:
        ids, text, hit = cut_at_stop_strings(ids, decode, sampling.stop)
        stopped = stopped or hit
    code = int(row["error"])
    iters = np.array([t[0] for t in timeline], np.float64)
    times = np.array([t[1] for t in timeline], np.float64)
    seconds = float(np.interp(row["end_iter"], iters, times) - np.interp(row["start_iter"], iters, times))
    return GenerationResult(
        index=request.order,
        prompt_ids=list(request.prompt_ids),
        token_ids=ids,
        text=text,
        finish_reason="error" if code else "stop" if stopped else "length",
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=len(ids),
        reference_num_tokens=int(row["num_tokens"]),
        steps=int(row["steps"]),
        forward_passes=int(row["passes"] + row["verify_passes"]),
        verify_passes=int(row["verify_passes"]),
        accepted_drafts=int(row["accepted"]),
        seconds=seconds,
        error=ERROR_MESSAGES.get(code, f"error code {code}") if code else None,
        logprobs=None
        if sampling.logprobs is None
        else tuple(token_logprob(t, row, p, sampling.logprobs) for p, t in enumerate(ids)),
    )
