"""One choice of a request, from the engine's events to OpenAI response pieces.

A ChoiceRun reads its request's events, feeds each step's commits to StableText and yields
a Piece per step: the new stable text (with the log-probabilities of its tokens, when asked),
the step's canvas change, and the finish reason on the last one. Streaming and non-streaming
responses consume the same pieces, so the concatenated stream is the non-streamed answer by
construction.

The answer ends with the engine's result (its EOS, its max_tokens cut), which carries the
request's counters; only a stop string, which the engine does not see, ends it earlier: the
server then aborts the request and its engine counters are unknown (None).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from dllm_jax.engine.results import GenerationResult, TokenLogprob
from dllm_jax.engine.session import StepCommits
from dllm_jax.serve.errors import APIError
from dllm_jax.serve.metrics import ServerMetrics
from dllm_jax.serve.stable_text import StableText, TextDelta
from dllm_jax.serve.worker import RequestHandle


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one step added to one choice: its text, the log-probabilities of the tokens that
    text completes (when asked), the finish reason on the last piece, and the canvas change."""

    index: int
    text: str
    finish_reason: str | None
    canvas: dict | None  # the "dllm" extension of a chunk, when the canvas is streamed
    logprobs: tuple[TokenLogprob, ...] = ()


def _joined(step: Piece | None, end: Piece) -> Piece:
    """A step's piece followed by the answer's end (its remaining text, finish reason and
    logprobs) as one piece; the end alone without a step piece."""
    if step is None:
        return end
    return Piece(step.index, step.text + end.text, end.finish_reason, step.canvas, step.logprobs + end.logprobs)


@dataclasses.dataclass
class ChoiceStats:
    """Usage and diffusion counters of a finished choice, as the engine counts them
    (docs/counters.md); None where the engine did not report them (a request the server
    ended at a stop string)."""

    prompt_tokens: int
    completion_tokens: int = 0
    steps: int = 0
    forward_passes: int | None = None
    verify_passes: int | None = None
    accepted_drafts: int | None = None
    reference_tokens: int | None = None


class ChoiceRun:
    """Args: handle of the submitted request; text: its StableText; index: the choice index;
    token_text: one token id -> its text (for canvas commits); canvas: stream the canvas;
    logprobs: the request asked for log-probabilities; deadline: time.monotonic() after which
    waiting stops (the worker expires it first)."""

    def __init__(
        self,
        handle: RequestHandle,
        text: StableText,
        index: int,
        *,
        token_text: Callable[[int], str],
        canvas: bool,
        deadline: float,
        metrics: ServerMetrics,
        logprobs: bool = False,
    ):
        self.handle = handle
        self.text = text
        self.index = index
        self.token_text = token_text
        self.canvas = canvas
        self.deadline = deadline
        self.metrics = metrics
        self.logprobs = logprobs
        self.stats = ChoiceStats(prompt_tokens=len(handle.work.prompt_ids))
        self.finish_reason: str | None = None
        self.first_text_at: float | None = None
        self._logprob_at: dict[int, TokenLogprob] = {}  # answer position -> its record
        self._tokens_reported = 0  # answer tokens whose logprobs a piece carried

    async def pieces(self) -> AsyncIterator[tuple[Piece, float]]:
        """Pieces with the perf_counter time their commits reached the host; raises APIError."""
        # the worker expires the request at its deadline; this bound is for a stuck worker
        self.handle.expire_waits_at(self.deadline + 5.0)
        try:
            while self.finish_reason is None:
                event = await self.handle.next_event()
                if event is None:
                    raise APIError(504, "the request's deadline passed before it finished", code="deadline_exceeded")
                if event.error is not None:
                    raise event.error
                # with the final answer in the same event, the answer ends with it (and its counters)
                ends_here = event.result is not None
                last = None  # the event's latest piece, sent once the next is known: the last joins the end
                for commits in event.commits:
                    piece = self._step(commits, event.result)
                    if piece is not None:
                        if last is not None:
                            yield last, event.received
                        last = piece
                    if self.finish_reason is not None:  # ended at a stop string: free the slot now
                        self.handle.close()
                        if last is not None:
                            yield last, event.received
                        return
                if ends_here:
                    # the last step and the end in one chunk: when every slot ends at the same
                    # step, each stream's end is one chunk for the event loop to send, not two
                    yield _joined(last, self._final(event.result)), event.received
                elif last is not None:
                    yield last, event.received
        finally:
            self.handle.close()

    def _step(self, commits: StepCommits, final: GenerationResult | None) -> Piece | None:
        """One step's piece; `final`, the engine's result when it comes in the same event."""
        self.text.commit(commits.positions, commits.tokens)
        if commits.logprobs is not None:
            self._logprob_at.update(zip(commits.positions, commits.logprobs))
        # the engine's final text emits the rest of the answer right after: decoding the prefix
        # here as well would be the same text twice, on the event loop (all slots often end at
        # one step, and each stream's end waits for the streams before it)
        delta = TextDelta("") if final is not None and final.text is not None else self.text.advance()
        # the answer ends here only at a stop string; otherwise its end comes with the engine's
        # result, so that the request's counters are the engine's
        if final is not None or not self.text.stopped_by_string:
            delta = dataclasses.replace(delta, finish_reason=None)
        step = commits.step + 1  # StepCommits.step counts from 0; the request's steps from 1
        self.stats.steps = step
        canvas = None
        if self.canvas:
            canvas = {
                "step": step,
                "gen_length": self.text.gen_length,
                "commits": [
                    {"position": p, "token_id": t, "text": self.token_text(t), "verified": v}
                    for p, t, v in zip(commits.positions, commits.tokens, commits.verified)
                ],
                "eos_position": self.text.eos_position,
            }
        logprobs = self._new_logprobs(self.text.emitted_tokens()) if self.logprobs and delta.text else ()
        if delta.finish_reason is not None:
            self._finished(delta.finish_reason, self.text.answer_tokens)
        self._saw_text(delta.text)
        if canvas is None and not delta.text and delta.finish_reason is None:
            return None
        return Piece(self.index, delta.text, delta.finish_reason, canvas, logprobs)

    def _final(self, final: GenerationResult) -> Piece:
        if final.error is not None:
            self.metrics.errors.labels("engine_request").inc()
            raise APIError(500, f"generation failed: {final.error}", code="generation_failed")
        text = final.text if final.text is not None else ""
        delta = self.text.finish(text, final.finish_reason)
        logprobs = ()
        if self.logprobs and final.logprobs is not None:
            self._logprob_at.update(enumerate(final.logprobs))
            logprobs = self._new_logprobs(len(final.logprobs))
        self.stats.steps = final.steps
        self.stats.forward_passes = final.forward_passes
        self.stats.verify_passes = final.verify_passes
        self.stats.accepted_drafts = final.accepted_drafts
        self.stats.reference_tokens = final.reference_num_tokens
        self._finished(final.finish_reason, final.completion_tokens)
        self._saw_text(delta.text)
        return Piece(self.index, delta.text, final.finish_reason, None, logprobs)

    def _new_logprobs(self, tokens: int) -> tuple[TokenLogprob, ...]:
        """The records of answer tokens [reported, tokens), now reported."""
        start, self._tokens_reported = self._tokens_reported, max(tokens, self._tokens_reported)
        return tuple(self._logprob_at[p] for p in range(start, tokens))

    def _saw_text(self, text: str) -> None:
        if text and self.first_text_at is None:
            self.first_text_at = time.monotonic()
            self.metrics.first_text_seconds.observe(self.first_text_at - self.handle.arrived)

    def _finished(self, reason: str, completion_tokens: int) -> None:
        self.finish_reason = reason
        self.stats.completion_tokens = completion_tokens
        # counted after the chunks the same step woke: all slots often end at one step, and each
        # stream's last chunk would wait for the counting of the streams before it
        asyncio.get_running_loop().call_soon(self._count_answer, reason, completion_tokens, time.monotonic())

    def _count_answer(self, reason: str, completion_tokens: int, at: float) -> None:
        m = self.metrics
        m.requests.labels(reason).inc()
        m.tokens_generated.inc(completion_tokens)
        m.prompt_tokens.inc(self.stats.prompt_tokens)
        m.steps.inc(self.stats.steps)
        if self.stats.steps and self.stats.reference_tokens is not None:
            m.tokens_per_step.observe(self.stats.reference_tokens / self.stats.steps)
        m.answer_seconds.observe(at - self.handle.arrived)


def usage(stats: list[ChoiceStats]) -> dict:
    prompt = sum(s.prompt_tokens for s in stats)
    completion = sum(s.completion_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def diffusion_stats(stats: list[ChoiceStats]) -> dict:
    """The response's "dllm" object, summed over its choices (docs/counters.md): steps,
    forward passes, verify passes, accepted drafts, reference tokens and tokens per step
    (reference tokens / steps, as Engine.generate's GenerationStats and dllm-generate count)."""

    def total(name: str) -> int | None:
        values = [getattr(s, name) for s in stats]
        return None if any(v is None for v in values) else sum(values)

    steps = sum(s.steps for s in stats)
    reference = total("reference_tokens")
    return {
        "steps": steps,
        "forward_passes": total("forward_passes"),
        "verify_passes": total("verify_passes"),
        "accepted_drafts": total("accepted_drafts"),
        "reference_tokens": reference,
        "tokens_per_step": reference / steps if steps and reference is not None else None,
    }
