"""$DLLM_MEMORY_AVAILABLE: the free memory per device that memory checks assume instead of
asking the device (read without JAX, so a command line checks it with its other input)."""

from __future__ import annotations

import os
import re

from dllm_jax.common.errors import GenerationError

MEMORY_ENV = "DLLM_MEMORY_AVAILABLE"
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def memory_override() -> int | None:
    """$DLLM_MEMORY_AVAILABLE in bytes (None when unset); the command lines call it with their
    option checks, so a bad value is an error before the model loads."""
    text = os.environ.get(MEMORY_ENV)
    return None if text is None else parse_bytes(text, MEMORY_ENV)


def parse_bytes(text: str, where: str) -> int:
    """'1073741824', '1.5GiB', '512 MB' -> bytes; raises GenerationError naming `where`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise GenerationError(f"{where}={text!r}: expected a number of bytes, e.g. 8GiB or 500000000")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
