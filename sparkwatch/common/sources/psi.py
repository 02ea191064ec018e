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


class PsiReader:
    """<proc_root>/pressure/memory through a kept-open fd (pread at offset 0), for the flight recorder's reads.
    Not thread-safe: one reader per thread."""

    def __init__(self, proc_root: Path) -> None:
        self.path = proc_root / "pressure" / "memory"
        self._fd: int | None = None
        self._absent = False

    def read(self) -> PsiMemory | None:
        """The totals; None where the kernel has no PSI, or the file is unreadable or garbled."""
        if self._absent:
            return None
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._absent = True
                return None
        try:
            return parse_psi(os.pread(self._fd, 4096, 0))
        except (OSError, PsiParseError):
            return None  # EOPNOTSUPP with psi=0, or garbage: this sample goes without

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
