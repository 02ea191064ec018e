"""Pressure stall information for memory: <proc_root>/pressure/memory.

Only the cumulative `total=` microseconds are kept; Prometheus derives rates from them. A kernel without PSI (built
without CONFIG_PSI, or booted with psi=0) has no file or refuses the read: that is "absent", not an error.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparkwatch.core.model import PsiMemory


class PsiParseError(ValueError):
    pass


def parse_psi(data: bytes) -> PsiMemory:
    totals: dict[str, int] = {}
    for line in data.splitlines():
        kind, _, rest = line.partition(b" ")
        for part in rest.split():
            key, eq, value = part.partition(b"=")
            if key == b"total" and eq:
                if not value.isdigit():
                    raise PsiParseError(f"pressure/memory: garbled total in {line[:80]!r}")
                totals[kind.decode(errors="replace")] = int(value)
    if "some" not in totals:
        raise PsiParseError(f"pressure/memory: no 'some' line ({len(data)} bytes)")
    return PsiMemory(some_us=totals["some"], full_us=totals.get("full"))


def read_psi(proc_root: Path) -> PsiMemory | None:
    """The memory PSI totals, or None where the kernel has none. Raises PsiParseError on garbage."""
    try:
        fd = os.open(proc_root / "pressure" / "memory", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None  # EOPNOTSUPP: psi=0 on the kernel command line
    finally:
        os.close(fd)
    return parse_psi(data)
