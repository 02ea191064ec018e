"""A cgroup v2 group's memory.current: what the kernel charges it (RSS, page cache, kernel memory; on a GB10 not the
CUDA allocations: Blackwellboy/model-serving-minefield#57). One small read; None where there is none to read."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def read_memory_current(cgroup: str | None, root: Path = CGROUP_ROOT) -> int | None:
    """memory.current of the group at `cgroup` (its path as /proc/PID/cgroup's `0::` line gives it)."""
    if not cgroup:
        return None
    try:
        fd = os.open(root / cgroup.lstrip("/") / "memory.current", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return int(os.read(fd, 64).strip())
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
