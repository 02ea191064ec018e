"""The guard process as the telemetry process sees it: the last `state` message, shaped for the exporter.

`RemoteGuard` holds the guard's counters (`stats`, under `lock`) and its live settings as the collector reads them
from the pool watch itself in a single process; `kernlog` the kernel-log counters. Both are replaced whole by each
message (common.messages.StateMsg), so a scrape never sees half of one.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from sparkwatch.common.eventlog import EventLog
from sparkwatch.common.messages import StateMsg
from sparkwatch.common.stats import GuardStats, KernelLogStats

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings


class RemoteKernelLog:
    """The guard process's kernel-log counters as the channel last carried them (`stats` under `lock`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = KernelLogStats()


class RemoteGuard:
    def __init__(self, settings: Settings) -> None:
        self.lock = threading.Lock()
        self.stats = GuardStats()
        self.settings = settings
        self.counters: dict[str, dict[str, int]] = {}
        self.rss_bytes: int | None = None
        self.pid: int | None = None
        self.updates_total = 0
        self.kernlog = RemoteKernelLog()  # the guard process reads /dev/kmsg; the exporter finds it as guard.kernlog

    def update(self, msg: StateMsg) -> None:
        with self.kernlog.lock:
            self.kernlog.stats = msg.kernlog
        with self.lock:
            self.stats = msg.guard
            self.counters = msg.counters
            self.rss_bytes = msg.rss_bytes
            self.pid = msg.pid
            self.updates_total += 1

    def available_bytes(self) -> int | None:
        with self.lock:
            return None if self.stats.mem is None else self.stats.mem.available_bytes

    def near_floor(self) -> bool:
        """Whether the guard's last MemAvailable is within warn_headroom of the floor: then GPU readings go to it each
        cycle (its kill policy ranks by them), and telemetry keeps its configured cadence (telemetry.loop.quiet)."""
        available = self.available_bytes()
        settings = self.settings
        return available is not None and available <= settings.floor + settings.warn_headroom


class EventErrors:
    """events.jsonl write errors of both processes, for `sparkwatch_event_log_write_errors`."""

    def __init__(self, events: EventLog, remote: RemoteGuard) -> None:
        self.events = events
        self.remote = remote

    @property
    def write_errors_total(self) -> int:
        with self.remote.lock:
            theirs = self.remote.counters.get("events", {}).get("event_write_errors", 0)
        return self.events.write_errors_total + int(theirs)

    @write_errors_total.setter
    def write_errors_total(self, _value: int) -> None:  # the exporter only reads; the protocol says "attribute"
        raise AttributeError("read-only")
