"""The shm watch: the files a killed engine left in /dev/shm, for `sparkwatch_shm_orphaned_bytes`, on a slow cadence.

The scan reads every process's fds and maps whenever /dev/shm holds any file (telemetry/sources/shmfiles.py): too
much for every telemetry cycle, and needless between kills, since an orphan stays until someone removes it. So it
scans at start, every SCAN_EVERY_S, and AFTER_END_S after an engine tree the telemetry loop saw is gone: the settle
time of a kill. On a thread of its own: a /proc read that blocks holds up this watch only, never a cycle.

The telemetry process hands it each cycle's engine trees (`observe`, on the loop's thread: a set of roots compared),
and only the end of one wakes the thread early: between scans it sleeps, engines or none (it woke every 2 s to
compare the roots itself before).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
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

log = logs.get("shm")


class ShmWatch:
    def __init__(self, root: Path, proc_root: Path) -> None:
        self.shm_root = shm_dir(root)
        self.proc_root = Path(proc_root)
        self.latest: ShmLeft | None = None  # the telemetry loop puts it in Snapshot.shm
        self.errors_total = 0
        self.scans_total = 0
        self._roots: frozenset[tuple[int, int]] = frozenset()  # the engine trees of the last cycle told (loop's thread)
        self._ended_at: float | None = None  # when a tree was last seen gone, not yet taken by the thread (monotonic)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a tree ended, or stop
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = daemon_thread(self._run, "sparkwatch-shm")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)

    def observe(self, trees: Iterable[EngineTree]) -> None:
        """A telemetry cycle's engine trees (the loop's thread; never blocks): one that is gone wakes the thread,
        which scans AFTER_END_S later, once its last processes are reaped."""
        roots = frozenset((t.root.pid, t.root.start_ticks) for t in trees)
        ended = bool(self._roots - roots)
        self._roots = roots
        if ended:
            with self._lock:
                self._ended_at = time.monotonic()
            self._wake.set()

    def counters(self) -> Mapping[str, int]:
        return {"errors": self.errors_total}

    def scan_once(self) -> ShmLeft | None:
        """One scan. Never raises: an unreadable /dev/shm is counted (a missing one, a fixture root, is not) and the
        metric goes absent until the next scan reads it."""
        self.scans_total += 1
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
        next_at = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                ended_at, self._ended_at = self._ended_at, None
            if ended_at is not None:  # a tree ended: its files are judged once its last processes are reaped
                next_at = min(next_at, ended_at + AFTER_END_S)
            now = time.monotonic()
            if now >= next_at:
                self.scan_once()
                next_at = now + SCAN_EVERY_S
            self._wake.wait(max(next_at - now, 0.0))
            self._wake.clear()
