"""The prompts of a command line: repeated --prompt flags or a JSONL file, checked line by line.

Every record keeps all its fields, so the output line of a request can repeat them (an "id"
comes back with its answer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("dllm_jax.cli.prompts")

# Bounds of a prompts file: a line (one request) and the whole file.
MAX_LINE_BYTES = 16 << 20
MAX_FILE_BYTES = 1 << 30
# Seconds of waiting on a FIFO (or another non-regular file) before saying so.
FIFO_NOTICE_SECONDS = 3.0


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One request: its text, every field of its input line, and where it came from.

    where: "FILE:LINE" or "--prompt N" (1-based), for messages about this request.
    """

    prompt: str
    fields: dict[str, Any]
    where: str


def from_flags(prompts: Sequence[str]) -> list[PromptRecord]:
    return [PromptRecord(p, {"prompt": p}, f"--prompt {n}") for n, p in enumerate(prompts, 1)]


def read_jsonl(path: Path, *, reserved: Iterable[str] = ()) -> list[PromptRecord]:
    """Reads one JSON object with a "prompt" string per line (blank lines skipped).

    The file is read line by line, each line at most MAX_LINE_BYTES and the file at most
    MAX_FILE_BYTES (a device such as /dev/zero, or a large file that is not a prompts file, is
    refused after one line, not read until memory runs out). A FIFO, or another file that is not
    a regular one, may take its time: after FIFO_NOTICE_SECONDS without its end a warning says
    what the command is waiting for.

    reserved: keys the output adds; an input line holding one is an error (it would be lost).

    Raises:
      ValueError "FILE:LINE: ..." for a line that is not such an object (or too long, or not
      UTF-8), or "FILE: ..." for a file that cannot be read, is too large or holds no prompts.
    """
    reserved = set(reserved)
    records = []
    with _waiting_notice(path):
        for n, raw in _lines(path):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            records.append(_record(line, where, reserved))
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def check_reserved(records: Sequence[PromptRecord], reserved: Iterable[str]) -> None:
    """Raises ValueError "WHERE: ..." for the first record holding a reserved key (one the output adds)."""
    reserved = set(reserved)
    for record in records:
        _check_clash(record.fields, record.where, reserved)


def _check_clash(fields: dict[str, Any], where: str, reserved: set[str]) -> None:
    clash = sorted(reserved & fields.keys())
    if clash:
        raise ValueError(
            f"{where}: {', '.join(map(repr, clash))} would be overwritten by the output's field of that name; rename the key"
        )


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line without its end) of the file, within the size bounds."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ValueError(f"{path}: prompts file not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a folder, expected a JSONL prompts file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the prompts file ({e.strerror})") from None
    total = 0
    with f:
        for n in itertools.count(1):
            try:
                line = f.readline(MAX_LINE_BYTES + 2)  # a line of MAX_LINE_BYTES and its "\r\n"
            except OSError as e:
                raise ValueError(f"{path}: cannot read the prompts file ({e.strerror})") from None
            if not line:
                return
            total += len(line)
            if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise ValueError(
                    f"{path}:{n}: a line longer than {MAX_LINE_BYTES >> 20} MiB; expected one JSON object per line"
                )
            if total > MAX_FILE_BYTES:
                raise ValueError(f"{path}: more than {MAX_FILE_BYTES >> 30} GiB of prompts; split the file")
            yield n, line.rstrip(b"\r\n")


@contextlib.contextmanager
def _waiting_notice(path: Path) -> Iterator[None]:
    """Warns once if reading a file that is not a regular one (a FIFO, a terminal) is not over
    after FIFO_NOTICE_SECONDS: opening a FIFO waits for a writer, reading it for the writer's data."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        regular = True  # _lines reports it
    if regular:
        yield
        return
    timer = threading.Timer(
        FIFO_NOTICE_SECONDS,
        log.warning,
        (
            "still waiting for %s: it is not a regular file, and nothing has written its prompts and closed it "
            "yet (Ctrl-C to stop)",
            path,
        ),
    )
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _record(line: str, where: str, reserved: set[str]) -> PromptRecord:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
    if not isinstance(record, dict) or "prompt" not in record:
        raise ValueError(f'{where}: expected an object with a "prompt" string')
    if not isinstance(record["prompt"], str):
        raise ValueError(f'{where}: "prompt" is {type(record["prompt"]).__name__}, expected a string')
    _check_clash(record, where, reserved)
    return PromptRecord(record["prompt"], record, where)


def encode_all(records: Sequence[PromptRecord], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Token ids of every prompt; a prompt that is empty or that ``encode`` rejects (any
    ValueError, e.g. TokenizerError for a lone surrogate) is an error naming where it came from."""
    encoded = []
    for record in records:
        if not record.prompt.strip():
            raise ValueError(f"{record.where}: empty prompt")
        try:
            encoded.append(encode(record.prompt))
        except ValueError as e:
            raise ValueError(f"{record.where}: the tokenizer cannot encode this prompt: {e}") from None
    return encoded
