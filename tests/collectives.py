"""The collectives of a compiled program, read from its HLO text (the sharding tests' check of
what crosses devices)."""

from __future__ import annotations

import re

import numpy as np


def collectives(hlo: str, per_array: bool = False) -> list[tuple[str, int]]:
    """(kind, elements moved) of every collective in an HLO module's text; per_array: one entry
    per array of a collective that XLA combined from several (a tuple result)."""
    found = []
    pattern = r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
    for result_type, kind in re.findall(pattern, hlo):
        sizes = [int(np.prod([int(d) for d in s.split(",") if d])) for s in re.findall(r"\[([\d,]*)\]", result_type)]
        found += [(kind, n) for n in sizes] if per_array else [(kind, sum(sizes))]
    return found
