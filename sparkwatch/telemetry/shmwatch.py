"""The shm watch: the files a killed engine left in /dev/shm, for `sparkwatch_shm_orphaned_bytes`, on a slow cadence.

The scan reads every process's fds and maps whenever /dev/shm holds any file (telemetry/sources/shmfiles.py): too
much for every telemetry cycle, and needless between kills, since an orphan stays until someone removes it. So it
scans at start, every SCAN_EVERY_S, and AFTER_END_S after an engine tree the telemetry loop saw is gone: the settle
time of a kill. On a thread of its own: a /proc read that blocks holds up this watch only, never a cycle.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.launch.shmleft import judge
from sparkwatch.core.model import EngineTree, ShmLeft
from sparkwatch.telemetry.sources.shmfiles import scan, shm_dir

# A leftover changes only at a kill or a removal; a minute keeps the metric fresh for a dashboard at no real cost
# (a full scan: 4-40 ms over 120-140 processes on the 2-core test VM, idle to loaded; nothing while /dev/shm holds
# no regular file).
SCAN_EVERY_S = 60.0
# A SIGKILLed tree's last processes are reaped within seconds of its root (wait-settled's 5 s quiet window follows
# them); 10 s later its files are orphans or held by a survivor.
AFTER_END_S = 10.0
LOOK_EVERY_S = 2.0  # how often the engine roots (a reference read of the last cycle) are compared

log = logs.get("shm")


class ShmWatch:
    def __init__(self, root: Path, proc_root: Path, engines: Callable[[], tuple[EngineTree, ...] | None]) -> None:
        """`engines`: the telemetry loop's last engine trees (None before its first cycle)."""
        self.shm_root = shm_dir(root)
        self.proc_root = Path(proc_root)
        self.engines = engines
        self.latest: ShmLeft | None = None  # the telemetry loop puts it in Snapshot.shm
        self.errors_total = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = daemon_thread(self._run, "sparkwatch-shm")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def counters(self) -> Mapping[str, int]:
        return {"errors": self.errors_total}

    def scan_once(self) -> ShmLeft | None:
        """One scan. Never raises: an unreadable /dev/shm is counted (a missing one, a fixture root, is not) and the
        metric goes absent until the next scan reads it."""
        try:
            self.latest = judge(scan(self.shm_root, self.proc_root), os.geteuid())
        except FileNotFoundError:
            self.latest = None
        except OSError as exc:
            self.errors_total += 1
            self.latest = None
            log.error("ERROR cannot scan %s: %s", self.shm_root, exc.strerror or exc)
        return self.latest

    def _run(self) -> None:
        roots: set[tuple[int, int]] = set()
        next_at = time.monotonic()
        while True:
            now = time.monotonic()
            current = {(t.root.pid, t.root.start_ticks) for t in self.engines() or ()}
            if roots - current:  # a tree ended: its files are judged once its last processes are reaped
                next_at = min(next_at, now + AFTER_END_S)
            roots = current
            if now >= next_at:
                self.scan_once()
                next_at = now + SCAN_EVERY_S
            if self._stop.wait(min(LOOK_EVERY_S, max(next_at - now, 0.0))):
                return
