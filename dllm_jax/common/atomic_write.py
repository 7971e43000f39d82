"""Writing a file so that readers see the old contents or the new ones, never half of them.

Atomic replacement is for regular files: the text goes to a temporary file beside the target,
which is renamed over it. A symbolic link is followed (its target is replaced, the link stays),
and what is not a regular file is written through, never replaced: a device (``/dev/null``,
``/dev/full``, a terminal), a FIFO or a socket, and the process's own streams
(``/dev/stdout``, ``/dev/fd/N``, ``/proc/self/fd/N``, whatever they point to).

The written file keeps the mode (and, where the process may, the owner) of the file it
replaces; a new file gets the mode the umask gives (0666 & ~umask), as ``open`` would.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

# The kernel's own limit on symbolic links followed in one path.
_MAX_LINKS = 40
_PROC = Path("/proc")


def write_text_atomically(path: str | os.PathLike, text: str, *, make_parents: bool = True) -> None:
    """Writes ``text`` (UTF-8) to ``path``: atomically for a regular file (or a link to one),
    through the file for anything else (see the module docstring).

    make_parents: create missing parent folders of a new file (command lines check their
    output path first and refuse a missing folder instead).

    On any failure the temporary file is removed and a regular file keeps what it had.
    """
    write_bytes_atomically(path, text.encode("utf-8"), make_parents=make_parents)


def write_bytes_atomically(path: str | os.PathLike, data: bytes, *, make_parents: bool = True) -> None:
    """write_text_atomically for bytes (an image, an archive)."""
    target = destination(path)
    if target is None:
        with open(path, "ab") as f:  # append: a stream pointing at a file is not truncated
            f.write(data)
        return
    if make_parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    try:
        previous = os.stat(target)
    except FileNotFoundError:
        previous = None
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            _take_over_mode(f.fileno(), previous)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def destination(path: str | os.PathLike) -> Path | None:
    """The regular file that writing ``path`` replaces: ``path`` with its symbolic links
    followed (a missing file too: it will be created). None when ``path`` is a stream of this
    process (a link into /proc) or exists and is not a regular file or folder (a device, a FIFO,
    a socket): such a path is written through.

    Raises:
      OSError (ELOOP) for a cycle of symbolic links.
    """
    current = Path(os.path.abspath(path))
    for _ in range(_MAX_LINKS):
        folder = Path(os.path.realpath(current.parent))
        if folder == _PROC or _PROC in folder.parents:
            return None
        current = folder / current.name
        if not current.is_symlink():
            break
        current = Path(os.path.normpath(folder / os.readlink(current)))
    else:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
    try:
        mode = os.stat(current).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new file (its folder is the writer's business)
        return current
    return current if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else None


def _take_over_mode(fd: int, previous: os.stat_result | None) -> None:
    """Gives the temporary file the replaced file's owner and mode, or a new file's mode."""
    if previous is None:
        os.fchmod(fd, 0o666 & ~_umask())
        return
    if (previous.st_uid, previous.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.fchown(fd, previous.st_uid, previous.st_gid)
        except PermissionError:  # only root may give a file away; a group we belong to still works
            try:
                os.fchown(fd, -1, previous.st_gid)
            except PermissionError:
                pass
    os.fchmod(fd, stat.S_IMODE(previous.st_mode))  # after chown, which clears set-id bits


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status)."""
    try:
        for line in (_PROC / "self" / "status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
