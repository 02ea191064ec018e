"""argparse types shared by the commands: a bad value is a usage error (exit 2) that says what was expected, in one
line (`Parser`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

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


def count(low: int = 0, high: int | None = None) -> Callable[[str], int]:
    """A whole number in [low, high] (`events -n -5` used to be taken, silently)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            span = f"at least {low}" if high is None else f"{low} to {high}"
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number, {span}")
        return value

    return parse


def size(text: str) -> int:
    """A byte size such as 256MiB."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Parser(argparse.ArgumentParser):
    """The `sparkwatch` parser and, through add_subparsers, every command's: a usage error is one line on stderr and
    exit 2, like a config error (argparse's own prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
