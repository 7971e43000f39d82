"""Reading a file that came with a model folder: bounded in size, every problem one error naming the file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_text(path: str | Path, *, max_bytes: int, error: Callable[[str], Exception]) -> str:
    """The UTF-8 text of ``path``, of which at most ``max_bytes`` are read (a larger file, or a
    device that never ends, is an error, not a read until memory runs out).

    Raises:
      error(message) naming ``path``: missing, unreadable, too large or not UTF-8.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise error(f"{path}: larger than {max_bytes / 2**20:g} MiB, too large for this file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json(path: str | Path, *, max_bytes: int, error: Callable[[str], Exception]) -> Any:
    """The parsed JSON of ``path`` (read as read_text reads it).

    Raises:
      error(message) naming ``path``: read_text's problems, not JSON, or nested too deeply for
      the parser.
    """
    text = read_text(path, max_bytes=max_bytes, error=error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None
