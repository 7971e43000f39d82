"""The error of the text floor (its own module, so the tokenizer and the chat template share it)."""

from __future__ import annotations


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be loaded, or a request it cannot serve (e.g. no chat template)."""
