"""Strict checks of option values: bool is not an int, 1.5 is not an int, NaN is not a number.

Each check returns the value (floats as float) or raises `error(message)` with a message that
names the option and what was expected.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(
    name: str,
    value: Any,
    error: Callable[[str], Exception],
    *,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
) -> int | None:
    """An int (not a bool) in [low, high] (bounds inclusive, None = unbounded)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if optional else "an int"
        raise error(f"{name}={_describe(value)}: expected {kind}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise error(
            f"{name}={value}: expected an int in [{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        )
    return value


def check_float(
    name: str,
    value: Any,
    error: Callable[[str], Exception],
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    optional: bool = False,
) -> float | None:
    """A finite real number (int or float, not a bool) in [low, high] ((low, high] with low_open)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "a number or None" if optional else "a number"
        raise error(f"{name}={_describe(value)}: expected {kind}")
    value = float(value)
    if not math.isfinite(value):
        raise error(f"{name}={value}: expected a finite number")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        lo = "-inf" if low is None else low
        raise error(
            f"{name}={value}: expected a number in {'(' if low_open else '['}{lo}, {'inf' if high is None else high}]"
        )
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...], error: Callable[[str], Exception]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise error(f"{name}={_describe(value)}: expected one of {choices}")
    return value


def check_bool(name: str, value: Any, error: Callable[[str], Exception]) -> bool:
    if not isinstance(value, bool):
        raise error(f"{name}={_describe(value)}: expected True or False")
    return value
