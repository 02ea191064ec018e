"""`sparkwatch run`: wiring. Each component runs in its own thread(s); none waits on another.

Components are started in order and stopped in reverse. The guard comes first and stops last: if anything else fails
to start, the guard still runs.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Protocol

from sparkwatch import syscalls
from sparkwatch.actuators.events import EventLog
from sparkwatch.config import Settings
from sparkwatch.guard import Guard


class Component(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


def log(line: str) -> None:
    print(f"sparkwatch: {line}", file=sys.stderr, flush=True)


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.events = EventLog(settings.events_path)
        self.guard = Guard(settings, self.events)
        self.components: list[tuple[str, Component]] = [("guard", self.guard)]
        self._stop = threading.Event()
        self._add_telemetry()

    def _add_telemetry(self) -> None:
        """The telemetry loop and the metrics endpoint. Imported here: a failure costs telemetry, never the guard."""
        try:
            from sparkwatch.exporter.server import MetricsServer, build_registry  # noqa: PLC0415
            from sparkwatch.telemetry import Telemetry, TelemetryLoop  # noqa: PLC0415

            self.telemetry = TelemetryLoop(
                Telemetry(self.settings), self.settings.telemetry_interval_s, on_event=self.events.append
            )
            registry = build_registry(self.settings, lambda: self.telemetry.latest, self.guard, self.events)
        except Exception as exc:
            log(f"ERROR telemetry unavailable: {type(exc).__name__}: {exc}; the guard keeps running")
            return
        self.add("telemetry", self.telemetry)
        self.add("metrics", MetricsServer(self.settings, registry))

    def add(self, name: str, component: Component) -> None:
        self.components.append((name, component))

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        if self.settings.mlock:
            try:
                log(f"mlockall: {syscalls.mlockall()}")
            except OSError as exc:
                log(
                    f"WARNING mlockall not permitted ({exc.strerror}); the guard may be paged out under pressure. "
                    "Raise LimitMEMLOCK in the unit to allow it."
                )
        started: list[tuple[str, Component]] = []
        for name, component in self.components:
            try:
                component.start()
                started.append((name, component))
            except Exception as exc:
                if name == "guard":
                    raise
                log(f"ERROR {name} did not start: {exc}; the guard keeps running")

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            self._stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        s = self.settings
        log(
            f"running: floor {s.floor >> 20} MiB, metrics on {s.listen}, events in {s.events_path}"
            + (" (DRY RUN: nothing will be signalled)" if s.dry_run else "")
        )
        while not self._stop.wait(1.0):
            pass
        log("stopping")
        for name, component in reversed(started):
            try:
                component.stop()
            except Exception as exc:
                log(f"ERROR stopping {name}: {exc}")
        return 0
