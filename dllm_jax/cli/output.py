"""The --output destination: checked before any work starts, written at the end.

A regular file (or a symbolic link to one) is replaced atomically and keeps its mode and
owner; a new file takes the umask's mode; a device, a FIFO or a stream of the process
(/dev/stdout) is written through (dllm_jax.common.atomic_write says how).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from dllm_jax.common.atomic_write import destination, write_text_atomically


def check_output_path(text: str) -> Path:
    """The path a command will write its output to, once it is known to be writable.

    The folder it goes in must exist (nothing is created but the file). For a file, a probe
    file is created and removed in that folder, which is what the final write does; permission
    bits alone do not say it (root, read-only mounts). A device or stream is not probed.

    Raises:
      ValueError naming the path: empty, an existing folder, in a missing folder or under a
      file, a cycle of links, or not writable.
    """
    if not text or not text.strip():
        raise ValueError("--output: empty path")
    path = Path(text)
    try:
        target = destination(path)
    except OSError as e:
        raise ValueError(f"--output {path}: {e.strerror}") from None
    if target is None:
        return path
    if target.is_dir():
        raise ValueError(f"--output {path}: is a folder, expected a file path")
    parent = target.parent
    if not parent.exists():
        raise ValueError(f"--output {path}: the folder {parent} does not exist (create it first)")
    if not parent.is_dir():
        raise ValueError(f"--output {path}: {parent} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        raise ValueError(f"--output {path}: cannot write in {parent} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def write_output(path: Path, text: str) -> None:
    """Writes the command's output to a path check_output_path accepted.

    Raises:
      OSError whose message names --output and the reason (a full disk, /dev/full).
    """
    sys.stdout.flush()  # the answers printed so far come first when the output is /dev/stdout
    try:
        write_text_atomically(path, text, make_parents=False)
    except OSError as e:
        raise OSError(f"--output {path}: cannot write it ({e.strerror or e})") from None
