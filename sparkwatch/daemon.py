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
from sparkwatch.actuators.outbox import AlertRouter, Outbox
from sparkwatch.config import Settings
from sparkwatch.driverwatch import DriverWatcher
from sparkwatch.guard import Guard
from sparkwatch.headroom import HeadroomWatcher
from sparkwatch.sources.udev import UdevWatcher


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
        self._add_alerting()

    def _add_alerting(self) -> None:
        """The alert outbox (when a webhook is set), the driver drift watcher, its udev trigger, low headroom."""
        s = self.settings
        self.outbox: Outbox | None = None
        if s.webhook_url is not None:
            self.outbox = Outbox(
                s.outbox_dir,
                str(s.webhook_url),
                s.webhook_secret.get_secret_value() if s.webhook_secret is not None else None,
                timeout_s=s.webhook_timeout_s,
                backoff_min_s=s.webhook_backoff_min_s,
                backoff_max_s=s.webhook_backoff_max_s,
                log=lambda line: print(line, file=sys.stderr, flush=True),
            )
            self.events.subscribe(AlertRouter(self.outbox))
            self.add("outbox", self.outbox)
        self.driver = DriverWatcher(s, self.events)
        self.add("driver", self.driver)
        # uevents describe this machine: with a fixture --root only the timer runs the drift check.
        if str(s.root) == "/":
            self.add("udev", UdevWatcher(self.driver.poke, log=log))
        self.headroom = HeadroomWatcher(s, self.guard, self.events)
        self.add("headroom", self.headroom)

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
