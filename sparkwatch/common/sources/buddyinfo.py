"""Free memory by buddy order: <proc_root>/buddyinfo (world-readable, a few hundred bytes) and the page size."""

from __future__ import annotations

import os
from pathlib import Path

from sparkwatch.core.driver.freeblocks import BuddyinfoError, BuddyZone, contiguous_free, parse_buddyinfo


def page_size_bytes() -> int:
    """The kernel's base page size: 4096 on x86 and Ubuntu arm64, 65536 on arm64 kernels built with 64K pages."""
    return os.sysconf("SC_PAGESIZE")


def read_buddyinfo(proc_root: Path) -> tuple[BuddyZone, ...] | None:
    """The zones of <proc_root>/buddyinfo, or None where there is none. Raises BuddyinfoError on garbage."""
    try:
        data = (proc_root / "buddyinfo").read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return parse_buddyinfo(data)


def read_contiguous_free(proc_root: Path, page_size: int) -> tuple[tuple[str, int], ...] | None:
    """(min_block label, bytes free in blocks at least that big), or None where there is no buddyinfo."""
    zones = read_buddyinfo(proc_root)
    if zones is None:
        return None
    return tuple(contiguous_free(zones, page_size).items())


class BuddyinfoReader:
    """<proc_root>/buddyinfo through a kept-open fd (a pread at offset 0 regenerates it, as for meminfo), for the
    flight recorder's once-a-second read: there open and close cost more than the read (bench/RESULTS-recorder.md).
    Not thread-safe: one reader per thread."""

    def __init__(self, proc_root: Path, page_size: int) -> None:
        self.path = proc_root / "buddyinfo"
        self.page_size = page_size
        self._fd: int | None = None
        self._absent = False

    def read(self) -> dict[str, int] | None:
        """{"2MiB": bytes, "64KiB": bytes} free in blocks at least that big; None where unreadable or garbled."""
        if self._absent:
            return None
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._absent = True  # no buddyinfo here (a fixture /proc): not tried again every second
                return None
        try:
            return contiguous_free(parse_buddyinfo(os.pread(self._fd, 1 << 16, 0)), self.page_size)
        except (OSError, BuddyinfoError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
