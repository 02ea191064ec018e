"""Byte sizes as people write them ("8GiB", "512MiB", "8G") and as people read them."""

from __future__ import annotations

import math
import re

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB
# Any size above this is a typo ("8TiB" for "8GiB"): the largest machines today have a few TiB of memory. The bound of
# every size a person writes (config.settings ByteSize, cli.argtypes.size).
SIZE_MAX_BYTES = 1 << 50  # 1 PiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
# Binary units only. "8G" stays 8 GiB because that is how the tools an owner sets memory with next to sparkwatch read
# it: systemd (MemoryMax=8G: "K, M, G, or T … with the base 1024", systemd.resource-control(5)) and docker
# (--memory 8g: docker/go-units size.go, RAMInBytes). Kubernetes reads "8G" as 10^9 but "8Gi" as 2^30, so "8Gi" is
# accepted too. "B" names bytes (what a script that computes a byte count appends).
_UNITS = {
    "b": 1,
    "k": KiB,
    "ki": KiB,
    "kib": KiB,
    "m": MiB,
    "mi": MiB,
    "mib": MiB,
    "g": GiB,
    "gi": GiB,
    "gib": GiB,
    "t": TiB,
    "ti": TiB,
    "tib": TiB,
}
# Decimal-looking units are refused, never read silently as binary (the old parser took "8 GB" for 8 GiB): SI says
# 8 GB is 8x10^9 bytes, docker's RAMInBytes reads "8GB" as 8x2^30, so whichever we picked would surprise someone by 7 %
# on a floor (a 2 GiB floor written "2GB" would be 1.86 GiB read as decimal). An error that says both ways costs a
# minute once.
_DECIMAL = {"kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB"}
_DECIMAL_POWERS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """Parse a byte size a person wrote: a number and a binary unit (8GiB, 512MiB, 8G, 4096B). Raises ValueError
    with one line that says how to write it: a bare number (no unit; 0 alone is the same in every unit) and decimal
    units (8GB, 8 MB, 8kB) are refused.

    The sizes sparkwatch's own processes hand each other are plain byte counts and never come through here
    (config.settings reads them from the wire form as integers)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size; write it like 8GiB or 512MiB")
    number, unit = match.groups()
    key = unit.lower()
    if not unit and float(number) == 0:
        return 0  # nothing is nothing in every unit: `--margin 0`
    if not unit:
        raise ValueError(f"{number} has no unit; write {number}GiB or {number}MiB (or {number}B for bytes)")
    if key in _DECIMAL:
        binary = _DECIMAL[key]
        decimal = int(float(number) * _DECIMAL_POWERS[key])
        raise ValueError(
            f"{text.strip()!r}: {unit} is ambiguous (decimal for some tools, binary for others); write "
            f"{number}{binary} for binary, or {decimal}B for the decimal bytes"
        )
    if key not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write it like 8GiB or 512MiB (units: B, KiB, MiB, GiB, TiB)")
    value = float(number) * _UNITS[key]
    if not math.isfinite(value):  # 400 digits: float() gives inf, and int(inf) raised OverflowError
        raise ValueError(f"{number[:20]}… ({len(number)} digits) is too large to be a size")  # core.bounded.shown
    return int(value)


def format_size(num_bytes: float) -> str:
    """Format bytes for a human: '61.2 GiB', '512 MiB', '4.0 KiB'."""
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit, power in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= power:
            scaled = value / power
            return f"{sign}{scaled:.0f} {unit}" if scaled >= 100 else f"{sign}{scaled:.1f} {unit}"
    return f"{sign}{value:.0f} B"
