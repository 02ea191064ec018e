"""Low-headroom alerts: MemAvailable within `warn_headroom` of the floor, read from the guard's last sample.

It never reads meminfo itself (the guard already does, every 50 ms to 1 s) and never touches the guard loop: it looks
at GuardStats under the guard's lock once a second and records a `low_headroom` event when the band is entered.
"""

from __future__ import annotations

import sys
import threading

from sparkwatch.actuators.events import EventLog, EventLogError, make_event
from sparkwatch.config import Settings
from sparkwatch.core.alerts import headroom_step
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.loops.guard import Guard
from sparkwatch.units import format_size


class HeadroomWatcher:
    def __init__(self, settings: Settings, guard: Guard, events: EventLog, interval_s: float = 1.0) -> None:
        self.settings = settings
        self.guard = guard
        self.events = events
        self.interval_s = interval_s
        self.in_band = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sparkwatch-headroom", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> bool:
        """One look; True when it recorded an event."""
        with self.guard.lock:
            mem = self.guard.stats.mem
        if mem is None:
            return False
        s = self.settings
        self.in_band, fire = headroom_step(
            self.in_band, mem.available_bytes, s.floor, s.warn_headroom, s.rearm_headroom
        )
        if not fire:
            return False
        summary = (
            f"low headroom: MemAvailable {format_size(mem.available_bytes)} is within "
            f"{format_size(s.warn_headroom)} of the {format_size(s.floor)} kill floor"
        )
        fields = {
            "mem_available_bytes": mem.available_bytes,
            "floor_bytes": s.floor,
            "warn_headroom_bytes": s.warn_headroom,
        }
        try:
            self.events.append(make_event(EventKind.LOW_HEADROOM, summary, fields))
        except EventLogError as exc:
            print(f"sparkwatch: ERROR could not record low_headroom event: {exc}", file=sys.stderr, flush=True)
        return True
