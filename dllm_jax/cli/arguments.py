"""argparse pieces shared by the command lines.

The ``type=`` functions check a value's range as well as its type; argparse prefixes their
messages with the flag ("argument --seed: ..."), so the user learns which option was wrong and
what it accepts before anything expensive starts. ``HelpFormatter`` prints each default once.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from dllm_jax.sampling.params import FLOAT32_MAX, INT32_MAX, SamplingParams, flag_knobs

# Seeds go to the device as int32 (jax.random keys are made from them in the compiled loop).
SEED_MAX = 2**31 - 1


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (high None: no upper bound)."""

    def parse(text: str) -> int:
        value = _number(text, int)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: expected an integer {f'in [{low}, {high}]' if high is not None else f'>= {low}'}"
            )
        return value

    parse.__name__ = "integer"  # what argparse names in its own "invalid ... value" message
    return parse


def float_in(low: float, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high] ((low, high] with low_open; high None: no upper bound)."""

    def parse(text: str) -> float:
        value = _number(text, float)
        if value < low or (low_open and value == low) or (high is not None and value > high):
            bound = (
                f"{'(' if low_open else '['}{low:g}, {high:g}]"
                if high is not None
                else f"{'>' if low_open else '>='} {low:g}"
            )
            raise argparse.ArgumentTypeError(
                f"{value:g} is out of range: expected a number {'in ' if high is not None else ''}{bound}"
            )
        return value

    parse.__name__ = "number"
    return parse


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**31 - 1] (it travels to the device as int32)."""
    return int_in(0, SEED_MAX)(text)


def add_knob_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per SamplingParams knob that takes one (--top-p for top_p), its range and
    choices from the knob's declaration, its default SamplingParams' own (None: unset, which
    takes the model's generation_config.json value, else the knob's fallback)."""
    for name, spec in flag_knobs().items():
        default = SamplingParams.__dataclass_fields__[name].default
        flag = "--" + name.replace("_", "-")
        text = spec.help
        if spec.generation_config is not None:
            text += f"; default: the model's generation_config.json {spec.generation_config}, else {spec.fallback}"
        if spec.kind == "choice":
            group.add_argument(flag, dest=name, choices=spec.choices, default=default, help=text)
        elif spec.kind == "int":
            high = INT32_MAX if spec.high is None else int(spec.high)
            group.add_argument(flag, dest=name, type=int_in(int(spec.low), high), default=default, help=text)
        else:
            high = FLOAT32_MAX if spec.high is None else spec.high
            group.add_argument(
                flag, dest=name, type=float_in(spec.low, high, low_open=spec.low_open), default=default, help=text
            )


def knob_values(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams keyword arguments of add_knob_flags' flags."""
    return {name: getattr(args, name) for name in flag_knobs()}


def non_empty(text: str) -> str:
    """A non-empty string (e.g. a stop string)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty string")
    return text


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the default is None, False or [] (the
    help then says what happens) or the help already names it; keeps the description's layout."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = any(action.default is v for v in (None, False, argparse.SUPPRESS)) or action.default == []
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"
