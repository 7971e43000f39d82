"""Text <-> token ids through a checkpoint's own Hugging Face fast tokenizer, offline.

LLaDA's tokenizer adds no BOS/EOS on plain text; only its chat template inserts the BOS string
(reference-spec A.5). Loading never touches the network: files are read from the folder only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# The files that make up a Hugging Face tokenizer folder (copied along with a checkpoint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be loaded, or a request it cannot serve (e.g. no chat template)."""


def has_tokenizer_files(path: str | Path) -> bool:
    """True when the folder holds at least one of TOKENIZER_FILES."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def _check_unicode(text: str, what: str) -> None:
    """Raises TokenizerError for text that is not valid Unicode (lone surrogates), which the
    Rust tokenizer rejects with a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(
            f"{what}not valid Unicode text: {e.reason} at character {e.start} ({text[e.start : e.end]!r})"
        ) from None


class Tokenizer:
    """Encodes prompts (optionally through the chat template) and decodes generated ids."""

    def __init__(self, hf_tokenizer: Any):
        """Wraps an already loaded transformers tokenizer; use ``Tokenizer.from_dir`` to load one."""
        self._tok = hf_tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads the tokenizer files of a checkpoint folder, without any network access."""
        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"{path}: tokenizer folder not found")
        from transformers import AutoTokenizer  # imported here: a heavy import only tokenizing needs
        from transformers.utils import logging as hf_logging

        # AutoTokenizer reads config.json and warns that model_type "llada" is unknown to it
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as e:  # transformers raises OSError, ValueError, JSON and tokenizers errors alike
            raise TokenizerError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        return cls(hf_tokenizer)

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence id (LLaDA: ``<|endoftext|>``), or None if the tokenizer defines none."""
        return self._tok.eos_token_id

    @property
    def mask_id(self) -> int | None:
        """The mask token id when the tokenizer declares a mask token, else None (use the model config's)."""
        return self._tok.mask_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def chat_prompt(self, text: str) -> str:
        """The chat template rendered for one user turn, ending with the assistant header."""
        return self.render_chat([{"role": "user", "content": text}])

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The chat template rendered for a conversation, ending with the assistant header.

        messages: [{"role": "system" | "user" | "assistant", "content": str}, ...], in order.
        """
        if not self.has_chat_template:
            raise TokenizerError("the tokenizer has no chat template; encode the prompt with chat=False")
        if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
            raise TokenizerError(
                f"messages: expected a non-empty list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not all(
                isinstance(message.get(k), str) for k in ("role", "content")
            ):
                raise TokenizerError(
                    f"message {i}: expected a dict with 'role' and 'content' strings, got {message!r:.80}"
                )
        try:
            return self._tok.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja2 errors raised by the template itself (raise_exception)
            raise TokenizerError(f"the chat template rejects these messages ({type(e).__name__}: {e})") from None

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation ({"role", "content"} messages, system turns included)
        rendered by the chat template (``render_chat``), ending with the assistant header."""
        text = self.render_chat(messages)
        _check_unicode(text, "messages: ")
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``text``; with ``chat=True`` the text is one user turn of the chat template.

        Special tokens are added only by the template (its BOS and headers), never by the tokenizer.

        Raises:
          TokenizerError for text it cannot encode: not a str, or not valid Unicode (e.g. a lone
          surrogate such as JSON's "\\ud800", or an argument that was not UTF-8).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"expected text (str), got {type(text).__name__}")
        _check_unicode(text, "")
        if chat:
            text = self.chat_prompt(text)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` up to (not including) the first EOS, with special tokens dropped.

        ids: any integer sequence (list, numpy or jax array of shape [T]).
        """
        ids = [int(i) for i in ids]
        if self.eos_id is not None and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode(ids, skip_special_tokens=True)


def tokens_within(decode: Callable[[Sequence[int]], str], ids: Sequence[int], length: int) -> int:
    """The most leading ids whose decoded text fits in `length` characters (what a stop-string
    cut leaves as completion tokens). Decoded prefix lengths grow with the number of ids, so
    this is a binary search: O(log n) decodes."""
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high + 1) // 2
        if len(decode(ids[:mid])) <= length:
            low = mid
        else:
            high = mid - 1
    return low
