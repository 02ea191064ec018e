"""argparse types shared by the commands: a bad value is a usage error (exit 2) that says what was expected."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from sparkwatch.core.units import parse_size


def seconds(low: float = 0.0, high: float = math.inf) -> Callable[[str], float]:
    """A number of seconds in [low, high]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or not low <= value <= high:
            span = f"at least {low:g}" if high == math.inf else f"{low:g} to {high:g}"
            raise argparse.ArgumentTypeError(f"{text!r}: expected {span} seconds")
        return value

    return parse


def size(text: str) -> int:
    """A byte size such as 256MiB."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
