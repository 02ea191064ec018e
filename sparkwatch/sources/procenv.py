"""Per-process facts the telemetry needs beyond stat/cmdline: chosen environ variables and the main thread's wchan.

/proc/<pid>/environ is the environment the process started with (later setenv calls do not show), so one read per
process lifetime is enough: results are cached per (pid, start time). It is readable only for our own processes
(or as root); an unreadable one is "unknown", never a crash and never a guess.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

_ENVIRON_MAX = 1 << 20  # environments of a few hundred KiB exist (CI runners); cut, not read whole forever


def parse_environ(data: bytes, names: Iterable[str]) -> dict[str, str]:
    wanted = {n.encode(): n for n in names}
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq and key in wanted:
            out[wanted[key]] = value.decode(errors="replace")
    return out


class EnvironReader:
    """Reads chosen variables of processes' environments, cached per (pid, start_ticks)."""

    def __init__(self, proc_root: Path, names: Iterable[str]) -> None:
        self.proc_root = str(proc_root)
        self.names = tuple(names)
        self._cache: dict[tuple[int, int], dict[str, str] | None] = {}

    def read(self, pid: int, start_ticks: int) -> dict[str, str] | None:
        key = (pid, start_ticks)
        if key in self._cache:
            return self._cache[key]
        try:
            fd = os.open(f"{self.proc_root}/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
            try:
                chunks = []
                size = 0
                while size < _ENVIRON_MAX:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
            finally:
                os.close(fd)
        except OSError:
            # EACCES (another user, hidepid), ESRCH/ENOENT (gone). An empty read of a live process means the same:
            # a zombie or a kernel thread has no environment to judge.
            self._cache[key] = None
            return None
        data = b"".join(chunks)
        values = parse_environ(data, self.names) if data else None
        self._cache[key] = values
        return values

    def forget_except(self, live: set[tuple[int, int]]) -> None:
        if len(self._cache) > 2 * len(live) + 64:
            self._cache = {k: v for k, v in self._cache.items() if k in live}


def read_wchan(proc_root: Path | str, pid: int) -> str | None:
    """Where the main thread sleeps ("anon_pipe_read", "ep_poll", "0" when running), None if unreadable."""
    try:
        fd = os.open(f"{proc_root}/{pid}/wchan", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 256).decode(errors="replace").strip() or None
    except OSError:
        return None
    finally:
        os.close(fd)
