"""Low-headroom alerts: MemAvailable within `warn_headroom` of the floor, read from the guard's last sample.

It never reads meminfo itself (the guard already does, every 50 ms to 1 s) and never touches the guard loop: once a
second it reads the guard's last MemAvailable (in the telemetry process: from the guard's state on the channel) and
records a `low_headroom` event when the band is entered. `apply(settings)` swaps floor, warn_headroom and
rearm_headroom together, so a reload is seen whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sparkwatch.common import logs
from sparkwatch.common.events import EventLog, EventLogError, make_event
from sparkwatch.core.alerts import headroom_step
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.units import format_size

log = logs.get("headroom")


class HeadroomSettings(Protocol):
    @property
    def floor(self) -> int: ...
    @property
    def warn_headroom(self) -> int: ...
    @property
    def rearm_headroom(self) -> int: ...


@dataclass(frozen=True)
class _Band:
    floor: int
    warn_headroom: int
    rearm_headroom: int


class HeadroomWatcher:
    LIVE_KEYS = frozenset({"floor", "warn_headroom", "rearm_headroom"})

    def __init__(
        self,
        settings: HeadroomSettings,
        available: Callable[[], int | None],
        events: EventLog,
        interval_s: float = 1.0,
    ) -> None:
        self.available = available  # the guard's last MemAvailable in bytes, None before its first poll
        self.events = events
        self.interval_s = interval_s
        self.in_band = False
        self.event_errors_total = 0
        self._band = _Band(settings.floor, settings.warn_headroom, settings.rearm_headroom)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def apply(self, settings: HeadroomSettings) -> frozenset[str]:
        self._band = _Band(settings.floor, settings.warn_headroom, settings.rearm_headroom)  # one reference swap
        return self.LIVE_KEYS

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
        available = self.available()
        if available is None:
            return False
        band = self._band
        self.in_band, fire = headroom_step(self.in_band, available, band.floor, band.warn_headroom, band.rearm_headroom)
        if not fire:
            return False
        summary = (
            f"low headroom: MemAvailable {format_size(available)} is within "
            f"{format_size(band.warn_headroom)} of the {format_size(band.floor)} kill floor"
        )
        fields = {
            "mem_available_bytes": available,
            "floor_bytes": band.floor,
            "warn_headroom_bytes": band.warn_headroom,
        }
        try:
            self.events.append(make_event(EventKind.LOW_HEADROOM, summary, fields))
        except EventLogError as exc:
            self.event_errors_total += 1
            log.error("could not record low_headroom event: %s", exc)
        return True
