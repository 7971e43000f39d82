"""The converter's output folder: checked before anything is read, built in a temporary sibling,
published by one rename.

The output appears complete or not at all. Every error names the output path as the caller
gave it (``--out``), never the temporary sibling.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from dllm_jax.models.checkpoint.errors import ConversionError


def check_output_folder(out: str | Path) -> Path:
    """The absolute path of a valid output folder, or a ConversionError naming ``out``.

    Valid: a new name (or an existing empty folder, which the result replaces) in an existing,
    writable folder. Orbax needs absolute paths, so a relative ``out`` is resolved against the
    current directory here.
    """
    if not str(out).strip():
        raise ConversionError("the output folder path is empty")
    path = Path(os.path.abspath(out))
    if not path.name or path == path.parent:
        raise ConversionError(f"{out}: not a new folder name")
    parent = path.parent
    if os.path.lexists(path):
        if path.is_symlink():
            raise ConversionError(f"{out}: is a symbolic link, expected a new folder")
        if not path.is_dir():
            raise ConversionError(f"{out}: exists and is not a folder")
        if any(path.iterdir()):
            raise ConversionError(f"{out}: output folder already exists")
    elif not parent.exists():
        raise ConversionError(f"{out}: the parent folder {parent} does not exist")
    elif not parent.is_dir():
        raise ConversionError(f"{out}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConversionError(f"{out}: the parent folder {parent} is not writable")
    return path


def make_temporary(path: Path, label: str | Path) -> Path:
    """Creates the hidden sibling ``.NAME.tmp-XXXXXXXX`` the output is built in.

    mkdir, not tempfile.mkdtemp (which makes the folder private to the user), so the published
    folder gets the umask's mode. A failure is a ConversionError naming ``label`` (the
    output path as the caller gave it).
    """
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
    except OSError as e:
        raise ConversionError(f"{label}: cannot create the output folder ({e.strerror or e})") from None
    return tmp


def publish(tmp: Path, path: Path, label: str | Path) -> None:
    """Renames the finished ``tmp`` to ``path``: atomic, and it refuses to replace anything but
    an empty folder, so a folder that appeared meanwhile is never overwritten."""
    try:
        os.rename(tmp, path)
    except OSError as e:
        raise ConversionError(
            f"{label}: cannot publish the output folder ({e.strerror or e}); did something else create it meanwhile?"
        ) from None


def remove(tmp: Path) -> None:
    """Removes a temporary output folder, whatever it holds."""
    shutil.rmtree(tmp, ignore_errors=True)
