"""Low-headroom alerts: MemAvailable within `warn_headroom` of the floor, read from the guard's last sample.

It never reads meminfo itself (the guard already does, every 50 ms to 1 s) and has no thread of its own: the
telemetry process calls `tick()` for each state the guard sends (four times a second near the floor, at least every
3 s far from it) and it records a `low_headroom` event when the band is entered. `apply(settings)` swaps floor,
warn_headroom and rearm_headroom together, so a reload is seen whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sparkwatch.common import logs
from sparkwatch.common.eventlog import EventLog, EventLogError, make_event
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.report.alerts import headroom_step
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
    ) -> None:
        self.available = available  # the guard's last MemAvailable in bytes, None before its first poll
        self.events = events
        self.in_band = False
        self.event_errors_total = 0
        self._band = _Band(settings.floor, settings.warn_headroom, settings.rearm_headroom)

    def apply(self, settings: HeadroomSettings) -> frozenset[str]:
        self._band = _Band(settings.floor, settings.warn_headroom, settings.rearm_headroom)  # one reference swap
        return self.LIVE_KEYS

    # The lifecycle of a component: nothing to run (tick() is called for each state the guard sends).
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

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
