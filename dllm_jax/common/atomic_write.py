"""Writing a file so that readers see the old contents or the new ones, never half of them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Writes `text` to a temporary file beside `path`, then renames it over `path`.

    The parent folder is created if needed; on any failure the temporary file is removed and
    `path` keeps what it had.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomically(path: str | os.PathLike, data: bytes) -> None:
    """write_text_atomically for bytes (an image, an archive)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
