"""The --output destination: checked before any work starts, written atomically at the end."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_output_path(text: str) -> Path:
    """The path a command will write its output to, once it is known to be writable.

    Missing parent folders are allowed (they are created when writing) if the nearest existing
    one is a writable folder. A probe file is created and removed there, which is what the
    final write does; permission bits alone do not say it (root, read-only mounts).

    Raises:
      ValueError naming the path: empty, an existing folder, under a file, or not writable.
    """
    if not text or not text.strip():
        raise ValueError("--output: empty path")
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"--output {path}: is a folder, expected a file path")
    parent = path.parent
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--output {path}: {parent} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        raise ValueError(f"--output {path}: cannot write in {parent} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return path
