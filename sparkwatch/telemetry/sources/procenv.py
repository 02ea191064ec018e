"""Per-process facts the telemetry needs beyond stat/cmdline: chosen environ variables and the main thread's wchan.

/proc/<pid>/environ is the environment the process started with (later setenv calls do not show), so one read per
process lifetime is enough: results are cached per (pid, start time). It is readable only for our own processes
(or as root); an unreadable one is "unknown", never a crash and never a guess.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from sparkwatch.common.sources.environ import read_environ
from sparkwatch.core.livecache import LiveCache
from sparkwatch.core.model import Proc


class EnvironReader:
    """Reads chosen variables of processes' environments, cached per (pid, start_ticks)."""

    def __init__(self, proc_root: Path, names: Iterable[str]) -> None:
        self.proc_root = proc_root
        self.names = tuple(names)
        self._cache: LiveCache[tuple[int, int], dict[str, str] | None] = LiveCache()

    def read(self, pid: int, start_ticks: int) -> dict[str, str] | None:
        key = (pid, start_ticks)
        if key in self._cache:
            return self._cache.get(key)
        env = read_environ(self.proc_root, pid)
        # None: EACCES (another user, hidepid) or gone. Empty: a zombie or kernel thread has no environment to judge
        # (a live process started with `env -i` has at least what its runtime sets, and is rare enough to call unknown).
        values = {n: env[n] for n in self.names if n in env} if env else None
        self._cache.put(key, values)
        return values

    def forget_dead(self, procs: Sequence[Proc]) -> None:
        """Drop the entries of processes not in `procs` (core.livecache's rule)."""
        self._cache.forget_dead(lambda: {p.key for p in procs})


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
