"""Errors of the generation API (one place, so every layer can raise them without cycles)."""

from __future__ import annotations


class GenerationError(ValueError):
    """Bad input to generation; the message names the argument or request and the problem."""


class SamplingParamsError(GenerationError):
    """An invalid per-request generation parameter; the message names the field."""
