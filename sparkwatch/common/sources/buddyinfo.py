"""Free memory by buddy order: <proc_root>/buddyinfo (world-readable, a few hundred bytes) and the page size."""

from __future__ import annotations

import os
from pathlib import Path

from sparkwatch.core.kernlog import BuddyZone, contiguous_free, parse_buddyinfo


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
