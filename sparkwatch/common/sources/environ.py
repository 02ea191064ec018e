"""/proc/<pid>/environ: the environment a process started with (MAX_JOBS, RAY_memory_monitor_refresh_ms, and for the
guard a container's launch token: common.launched)."""

from __future__ import annotations

import os
from pathlib import Path

from sparkwatch.common.sources.procs import read_fd

_ENVIRON_MAX = 1 << 20  # environments of a few KiB are normal; a MiB bounds a hostile one


def parse_environ(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def read_environ(proc_root: Path | str, pid: int) -> dict[str, str] | None:
    """The environment, or None when unreadable (another user's process, or it is gone)."""
    try:
        fd = os.open(f"{proc_root}/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return parse_environ(read_fd(fd, _ENVIRON_MAX))
    except OSError:
        return None
    finally:
        os.close(fd)
