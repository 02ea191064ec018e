"""Numbers that people and files write, held to a range: the one owner of "a whole number from LOW to HIGH".

Python reads a 400-digit number without complaint and fails later, far from the input: `int(float("9" * 400))`
raises OverflowError, `format_size(10**400)` too (the float conversion), `launch` printed a traceback for
`--budget 999…GiB`, `MAX_JOBS=999…` or `"num_hidden_layers": 999…` in a config.json. Every number sparkwatch takes
from outside (the command line through cli.argtypes, an engine's flags in core.engines.enginecli, MAX_JOBS in
core.launch.launchenv, config.json and GGUF headers in common.sources.checkpoint) passes through here or through
pydantic's bounds (config.settings): out of range is a ValueError whose one line says what was expected. A long value is
shown cut (`shown`), so the line stays one readable line.
"""

from __future__ import annotations

import math
import re

SHOWN_MAX_CHARS = 20
# A digit string longer than this is out of every range here, and is never handed to int(): Python refuses to
# convert more than 4300 digits (sys.int_info.str_digits_check_threshold) with a ValueError of its own wording.
_DIGITS_MAX = 40
_WHOLE_RE = re.compile(r"[+-]?[0-9]+")


def shown(value: object) -> str:
    """`value` as an error line shows it: its repr, cut after SHOWN_MAX_CHARS characters with the full length named
    (`'99999999999999999999…' (400 characters)`, `99999999999999999999… (400 digits)`)."""
    if isinstance(value, str):
        if len(value) <= SHOWN_MAX_CHARS:
            return repr(value)
        return f"{value[:SHOWN_MAX_CHARS]!r}… ({len(value)} characters)"
    text = repr(value)
    if len(text) <= SHOWN_MAX_CHARS:
        return text
    what = "digits" if isinstance(value, int) else "characters"
    return f"{text[:SHOWN_MAX_CHARS]}… ({len(text)} {what})"


def span(low: float, high: float, unit: str = "") -> str:
    tail = f" {unit}" if unit else ""
    if high == math.inf:
        return f"at least {low:g}{tail}"
    return f"{low:g} to {high:g}{tail}"


def within(value: int, low: int, high: int, unit: str = "") -> int:
    """`value` when it lies in [low, high]; else ValueError naming the range."""
    if not low <= value <= high:
        raise ValueError(f"{shown(value)} is out of range: expected {low} to {high}{' ' + unit if unit else ''}")
    return value


def whole(text: str, low: int, high: int, unit: str = "") -> int:
    """A whole number written in ASCII digits (an optional sign), in [low, high]. Raises ValueError."""
    stripped = text.strip()
    if not _WHOLE_RE.fullmatch(stripped):
        raise ValueError(f"{shown(text)} is not a whole number")
    if len(stripped.lstrip("+-")) > _DIGITS_MAX:
        raise ValueError(f"{shown(text)} is out of range: expected {low} to {high}{' ' + unit if unit else ''}")
    return within(int(stripped), low, high, unit)


def real(text: str, low: float, high: float, unit: str = "") -> float:
    """A finite number in [low, high] (float syntax: `0.8`, `1e-3`). Raises ValueError; inf and nan never pass."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{shown(text)} is not a number") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{shown(text)} is out of range: expected {span(low, high, unit)}")
    return value
