"""argparse types shared by the commands: a bad value is a usage error (exit 2) that says what was expected, in one
line (`Parser`). Every number has a range (core.bounded): `--budget 999…GiB` (400 digits) was an OverflowError
traceback, `--settle-timeout 1e300` a wait for ever."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import NoReturn

from sparkwatch.core.bounded import shown
from sparkwatch.core.units import SIZE_MAX_BYTES, format_size, parse_size

# The longest wait any command takes: a week. More is a typo (or 1e300, which time.sleep refused with OverflowError).
SECONDS_MAX = 7 * 86400.0


def seconds(low: float = 0.0, high: float = SECONDS_MAX) -> Callable[[str], float]:
    """A number of seconds in [low, high]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a number of seconds") from None
        if not math.isfinite(value) or not low <= value <= high:
            span = f"at least {low:g}" if high == math.inf else f"{low:g} to {high:g}"
            raise argparse.ArgumentTypeError(f"{shown(text)}: expected {span} seconds")
        return value

    return parse


def count(low: int = 0, high: int | None = None) -> Callable[[str], int]:
    """A whole number in [low, high] (`events -n -5` used to be taken, silently)."""

    def parse(text: str) -> int:
        try:
            value = int(text)  # more than 4300 digits: Python's own ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number") from None
        if value < low or (high is not None and value > high):
            span = f"at least {low}" if high is None else f"{low} to {high}"
            raise argparse.ArgumentTypeError(f"{shown(text)}: expected a whole number, {span}")
        return value

    return parse


def size(text: str) -> int:
    """A byte size such as 256MiB, at most SIZE_MAX_BYTES (1 PiB: anything more is a typo)."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value > SIZE_MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected a size up to {format_size(SIZE_MAX_BYTES)}")
    return value


def size_or(*words: str) -> Callable[[str], int | str]:
    """A byte size larger than 0 (as `size`), or one of `words` (`--budget auto`)."""

    def parse(text: str) -> int | str:
        if text in words:
            return text
        value = size(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{shown(text)}: expected a size larger than 0, or {' or '.join(words)}")
        return value

    return parse


def role_sizes(roles: Sequence[str], *words: str) -> Callable[[str], int | str | dict[str, int | str]]:
    """As size_or, or one per role: `head=70GiB,worker=60GiB` (each role once, each value as size_or takes it)."""
    one = size_or(*words)

    def parse(text: str) -> int | str | dict[str, int | str]:
        if "=" not in text:
            return one(text)
        out: dict[str, int | str] = {}
        for item in text.split(","):
            role, _eq, value = item.partition("=")
            role = role.strip()
            if role not in roles:
                raise argparse.ArgumentTypeError(f"{shown(item)}: expected ROLE=SIZE, ROLE one of {', '.join(roles)}")
            if role in out:
                raise argparse.ArgumentTypeError(f"{role}: given twice")
            out[role] = one(value.strip())
        return out

    return parse


class Parser(argparse.ArgumentParser):
    """The `sparkwatch` parser and, through add_subparsers, every command's: a usage error is one line on stderr and
    exit 2, like a config error (argparse's own prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
