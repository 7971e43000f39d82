"""The prompts of a command line: repeated --prompt flags or a JSONL file, checked line by line.

Every record keeps all its fields, so the output line of a request can repeat them (an "id"
comes back with its answer).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


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

    reserved: keys the output adds; an input line holding one is an error (it would be lost).

    Raises:
      ValueError "FILE:LINE: ..." for a line that is not such an object, or "FILE: ..." for a
      file that cannot be read or holds no prompts.
    """
    reserved = set(reserved)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: prompts file not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a folder, expected a JSONL prompts file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the prompts file ({e.strerror})") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise ValueError(f'{where}: expected an object with a "prompt" string')
        if not isinstance(record["prompt"], str):
            raise ValueError(f'{where}: "prompt" is {type(record["prompt"]).__name__}, expected a string')
        clash = sorted(reserved & record.keys())
        if clash:
            raise ValueError(
                f"{where}: {', '.join(map(repr, clash))} would be overwritten by the output's field of that name; rename the key"
            )
        records.append(PromptRecord(record["prompt"], record, where))
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


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
