"""Byte sizes as people write them ("8GiB", "512MiB", "8G") and as people read them."""

from __future__ import annotations

import re

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)
_POWERS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}


def parse_size(text: str | int) -> int:
    """Parse a byte size. Binary units only: on a unified pool "8G" means 8 GiB to everyone who types it."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a size cannot be negative")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size; write it like 8GiB, 512MiB or 1073741824")
    number, unit, _ = match.groups()
    return int(float(number) * _POWERS[unit.upper()])


def format_size(num_bytes: float) -> str:
    """Format bytes for a human: '61.2 GiB', '512 MiB', '4.0 KiB'."""
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit, power in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= power:
            scaled = value / power
            return f"{sign}{scaled:.0f} {unit}" if scaled >= 100 else f"{sign}{scaled:.1f} {unit}"
    return f"{sign}{value:.0f} B"
