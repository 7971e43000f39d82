"""Text <-> token ids through a checkpoint's own Hugging Face fast tokenizer, offline.

LLaDA's tokenizer adds no BOS/EOS on plain text; only its chat template inserts the BOS string
(reference-spec A.5). Loading never touches the network: files are read from the folder only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The files that make up a Hugging Face tokenizer folder (copied along with a checkpoint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be loaded, or a request it cannot serve (e.g. no chat template)."""


def has_tokenizer_files(path: str | Path) -> bool:
    """True when the folder holds at least one of TOKENIZER_FILES."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


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
        if not self.has_chat_template:
            raise TokenizerError("the tokenizer has no chat template; encode the prompt with chat=False")
        messages = [{"role": "user", "content": text}]
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation ({"role", "content"} messages, system turns included)
        rendered by the chat template, ending with the assistant header."""
        if not self.has_chat_template:
            raise TokenizerError("the tokenizer has no chat template")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``text``; with ``chat=True`` the text is one user turn of the chat template.

        Special tokens are added only by the template (its BOS and headers), never by the tokenizer.
        """
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
