"""The stable text of an answer that a diffusion model fills in out of order.

A step commits tokens anywhere in the answer, never undone. The text that can no longer
change is the decoding of the answer's completed prefix (every position before the first
undecoded one), up to the first end marker (EOS or a stop token id), cut at the first stop
string (dllm_jax.engine.results cuts every answer). StableText turns the commits of each step into append-only text deltas, as OpenAI
streaming clients expect: it holds back a tail that may still become a stop string and an
incomplete UTF-8 character (the tokenizer decodes it as U+FFFD).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from dllm_jax.engine.results import cut_at_stop_strings
from dllm_jax.text.tokenizer import tokens_within

_REPLACEMENT = "\ufffd"


def stable_prefix_length(decoded: Sequence[bool]) -> int:
    """Number of leading True entries: the answer positions that are all decoded.

    In: [T, T, F, T] -> Out: 2.
    """
    for i, d in enumerate(decoded):
        if not d:
            return i
    return len(decoded)


def stop_prefix_holdback(text: str, stops: Iterable[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string.

    In: text "ab##", stops ["###"] -> Out: 2 (the tail "##" may become "###").
    """
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


@dataclasses.dataclass(frozen=True)
class TextDelta:
    """New stable text and, once the answer is complete, why it ended ("stop" / "length")."""

    text: str
    finish_reason: str | None = None


class StableText:
    """Tracks one answer's committed tokens and emits its stable text.

    Args:
      decode: token ids -> text (special tokens dropped).
      gen_length: answer positions G.
      end_ids: token ids that end the answer (EOS, stop token ids): the text stops before them.
      stops: stop strings; the text ends before the first one.
      max_tokens: the answer is complete after this many positions (finish_reason "length").
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        gen_length: int,
        *,
        end_ids: Iterable[int] = (),
        stops: Sequence[str] = (),
        max_tokens: int | None = None,
    ):
        self._decode = decode
        self.gen_length = gen_length
        self._end_ids = frozenset(end_ids)
        self._stops = tuple(stops)
        self._limit = gen_length if max_tokens is None else min(max_tokens, gen_length)
        self.tokens: list[int | None] = [None] * gen_length
        self._prefix = 0  # positions known decoded from the start
        self._decoded = -1  # the prefix length whose text the last advance() decoded
        self.emitted = ""
        self.finish_reason: str | None = None
        self.stopped_by_string = False  # the answer ended at a stop string (the engine does not know)
        self.answer_tokens = 0  # tokens of the stable answer (before its end marker or stop string)

    def commit(self, positions: Iterable[int], token_ids: Iterable[int]) -> None:
        """Records one step's commits (answer positions, 0-based)."""
        for p, t in zip(positions, token_ids, strict=True):
            if 0 <= p < self.gen_length:
                self.tokens[p] = int(t)

    @property
    def eos_position(self) -> int | None:
        """The first committed end marker (EOS or stop id) anywhere in the answer."""
        hits = [i for i, t in enumerate(self.tokens) if t is not None and t in self._end_ids]
        return hits[0] if hits else None

    def advance(self) -> TextDelta:
        """The stable text added since the last call (finish_reason set once complete)."""
        if self.finish_reason is not None:
            return TextDelta("")
        prefix = self._prefix
        while prefix < self._limit and self.tokens[prefix] is not None and self.tokens[prefix] not in self._end_ids:
            prefix += 1
        self._prefix = prefix
        ended = prefix < self._limit and self.tokens[prefix] is not None  # an end marker
        complete = ended or prefix >= self._limit
        if prefix == self._decoded and not complete:
            return TextDelta("")  # the same prefix decodes to the same text: nothing new
        self._decoded = prefix
        kept, text, stopped = cut_at_stop_strings([int(t) for t in self.tokens[:prefix]], self._decode, self._stops)
        reason = None
        if stopped:
            reason = "stop"
            self.stopped_by_string = True
        elif complete:
            reason = "stop" if ended else "length"
        else:
            hold = stop_prefix_holdback(text, self._stops)
            text = text[: len(text) - hold]
            text = text.rstrip(_REPLACEMENT)
        self.answer_tokens = len(kept)
        return self._emit(text, reason)

    def emitted_tokens(self) -> int:
        """The answer's leading tokens whose text is all emitted."""
        ids = [int(t) for t in self.tokens[: self._prefix]]
        return tokens_within(self._decode, ids, len(self.emitted))

    def finish(self, text: str, finish_reason: str) -> TextDelta:
        """The engine's final answer: emits what remains of it (idempotent once finished)."""
        if self.finish_reason is not None:
            return TextDelta("")
        return self._emit(text, finish_reason)

    def _emit(self, text: str, reason: str | None) -> TextDelta:
        # append-only: text that disagrees with what was sent (a tokenizer that rewrites a
        # decoded prefix) is held until it agrees again
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += new
        self.finish_reason = reason
        return TextDelta(new, reason)
