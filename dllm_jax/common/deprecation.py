"""Deprecated names: kept one release, each use warned once per call site (DeprecationWarning)."""

from __future__ import annotations

import warnings
from typing import Any

from dllm_jax.common.errors import GenerationError


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that `old` is deprecated in favour of `new`."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)


def renamed_argument(new_name: str, new: Any, old_name: str, old: Any, where: str) -> Any:
    """The value of an argument that was renamed: the new one, or the deprecated old one (warned);
    both given is a GenerationError."""
    if old is None:
        return new
    if new is not None:
        raise GenerationError(
            f"{where}: {old_name}= and {new_name}= both given; {old_name}= is the deprecated name of {new_name}="
        )
    warn_renamed(f"{where}({old_name}=...)", f"{new_name}=", stacklevel=4)
    return old
