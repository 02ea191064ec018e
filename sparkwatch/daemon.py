"""`sparkwatch run`: wiring. Each component runs in its own thread(s); none waits on another.

Components are started in order and stopped in reverse. The guard comes first and stops last: if anything else fails
to start, the guard still runs.

Signals: SIGTERM/SIGINT stop cleanly (STOPPING=1 to systemd first, exit 0). SIGHUP re-reads the config from the same
file, environment and flags as at start, logs what changed, and applies what can be applied live (each component
with a `reconfigure(settings)` method says which keys it took); a bad new config is logged and the old one kept.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

from sparkwatch import syscalls
from sparkwatch.actuators.events import EventLog
from sparkwatch.actuators.outbox import AlertRouter, Outbox
from sparkwatch.actuators.systemd import JournalSink, Notifier, ServiceNotifier
from sparkwatch.config import ConfigError, Settings
from sparkwatch.core.status import status_line
from sparkwatch.loops.driverwatch import DriverWatcher
from sparkwatch.loops.guard import Guard
from sparkwatch.loops.headroom import HeadroomWatcher
from sparkwatch.sources.udev import UdevWatcher


class Component(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


def log(line: str) -> None:
    print(f"sparkwatch: {line}", file=sys.stderr, flush=True)


class Daemon:
    def __init__(self, settings: Settings, loader: Callable[[], Settings] | None = None) -> None:
        self.settings = settings
        self.loader = loader  # re-reads the config on SIGHUP; None: SIGHUP is logged and ignored
        self.events = EventLog(settings.events_path)
        self.journal = JournalSink()
        self.events.subscribe(self.journal)
        self.sd = ServiceNotifier(Notifier(), self.status_line, poll_max_s=settings.poll_max_s)
        self.guard = Guard(settings, self.events, heartbeat=self.sd.beat)
        self.components: list[tuple[str, Component]] = [("guard", self.guard), ("sd_notify", self.sd)]
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake = threading.Event()
        self._add_alerting()
        self._add_telemetry()

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

    def _add_telemetry(self) -> None:
        """The telemetry loop and the metrics endpoint. Imported here: a failure costs telemetry, never the guard."""
        try:
            from sparkwatch.exporter.server import MetricsServer, build_registry  # noqa: PLC0415
            from sparkwatch.loops.telemetry import Telemetry, TelemetryLoop  # noqa: PLC0415

            self.telemetry = TelemetryLoop(
                Telemetry(self.settings, driver=lambda: self.driver.report),
                self.settings.telemetry_interval_s,
                on_event=self.events.append,
            )
            registry = build_registry(
                self.settings, lambda: self.telemetry.latest, self.guard, self.events, self.outbox
            )
        except Exception as exc:
            log(f"ERROR telemetry unavailable: {type(exc).__name__}: {exc}; the guard keeps running")
            return
        self.add("telemetry", self.telemetry)
        self.add("metrics", MetricsServer(self.settings, registry))
        # The guard ranks victims with per-pid GPU bytes from telemetry's latest snapshot (a reference read, no NVML
        # call on the guard's thread). When the guard runs in its own process this callable becomes the channel.
        from sparkwatch.loops.telemetry import gpu_bytes_by_pid  # noqa: PLC0415

        telemetry = self.telemetry
        self.guard.gpu_bytes_by_pid = lambda: gpu_bytes_by_pid(telemetry.latest)

    def add(self, name: str, component: Component) -> None:
        self.components.append((name, component))

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def request_reload(self) -> None:
        self._reload.set()
        self._wake.set()

    def status_line(self) -> str:
        """systemd's STATUS= line: the pool against the floor, and engines and compile jobs when telemetry runs."""
        g = self.guard
        with g.lock:
            mem = g.stats.mem
            armed = g.stats.armed
            error = g.stats.last_error if mem is None else None
            floor = g.params.floor_bytes
            dry_run = g.settings.dry_run
        engines: int | None = None
        compile_jobs: int | None = None
        for name, component in self.components:
            snapshot = getattr(component, "latest", None) if name == "telemetry" else None
            if snapshot is not None:
                engines = len(getattr(snapshot, "engines", ()))
                jobs = getattr(getattr(snapshot, "compile", None), "parallel_jobs", None)
                compile_jobs = jobs if isinstance(jobs, int) else None
        return status_line(
            None if mem is None else mem.available_bytes,
            floor,
            engines=engines,
            compile_jobs=compile_jobs,
            dry_run=dry_run,
            armed=armed,
            error=error,
        )

    def reload(self) -> bool:
        """Re-read the config and apply it. Returns False (and keeps the running config) if the new one is bad."""
        if self.loader is None:
            log("SIGHUP: this daemon was started without a config loader; nothing reloaded")
            return False
        notify = self.sd.notifier
        notify.notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        try:
            try:
                new = self.loader()
            except ConfigError as exc:
                log(f"reload: config error: {exc}; keeping the running config")
                return False
            changes = describe_changes(self.settings, new)
            if not changes:
                log("reload: config unchanged")
                return True
            applied: set[str] = set()
            for name, component in self.components:
                reconfigure = getattr(component, "reconfigure", None)
                if reconfigure is None:
                    continue
                try:
                    applied |= set(reconfigure(new))
                except Exception as exc:
                    log(f"ERROR reload: {name} could not apply the new config: {exc}")
            self.settings = new
            log("reload: " + "; ".join(text for _key, text in changes))
            pending = [key for key, _text in changes if key not in applied]
            if pending:
                log(f"reload: takes effect after a restart: {', '.join(pending)}")
            return True
        finally:
            notify.notify(f"READY=1\nSTATUS={self.status_line()}")

    def _protect_self(self) -> None:
        """Lock our memory so the guard is not paged out under the very pressure it watches (earlyoom does too)."""
        syscalls.limit_malloc_arenas(2)  # before the threads start: one arena per thread costs RSS for nothing
        too_small = syscalls.memlock_limit_too_small()
        if self.settings.mlock and too_small is not None:
            log(
                f"WARNING not locking memory: RLIMIT_MEMLOCK is {too_small >> 20} MiB. Under a finite limit "
                "mlockall(MCL_FUTURE) makes later thread stacks fail once the locked address space (130-200 MiB "
                "measured) reaches it. Set LimitMEMLOCK=infinity (docs/systemd.md)."
            )
        elif self.settings.mlock:
            try:
                log(f"mlockall: {syscalls.mlockall()}")
            except OSError as exc:
                log(
                    f"WARNING mlockall not permitted ({exc.strerror}); the guard may be paged out under pressure. "
                    "Raise LimitMEMLOCK in the unit to allow it."
                )

    def run(self) -> int:
        self._protect_self()
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
            if signum == signal.SIGHUP:
                self.request_reload()
            else:
                self.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, on_signal)
        s = self.settings
        log(
            f"running: floor {s.floor >> 20} MiB, metrics on {s.listen}, events in {s.events_path}"
            + (" (DRY RUN: nothing will be signalled)" if s.dry_run else "")
            + f"; journal via {self.journal.backend}"
            + (f", sd_notify via {self.sd.notifier.backend}" if self.sd.notifier.enabled else "")
        )
        syscalls.trim_heap()  # hand back what importing and building everything left free (~0.7 MiB measured)
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._reload.is_set() and not self._stop.is_set():
                self._reload.clear()
                self.reload()
        self.sd.stopping()  # first, so systemd knows the exit that follows is wanted
        log("stopping")
        for name, component in reversed(started):
            try:
                component.stop()
            except Exception as exc:
                log(f"ERROR stopping {name}: {exc}")
        return 0


def describe_changes(old: Settings, new: Settings) -> list[tuple[str, str]]:
    """(key, 'key: old → new') for each changed setting, secrets masked as check-config masks them."""
    old_shown, new_shown = old.public_dict(), new.public_dict()
    out: list[tuple[str, str]] = []
    for key in type(old).model_fields:
        if getattr(old, key) == getattr(new, key):
            continue
        before, after = old_shown.get(key), new_shown.get(key)
        if before == after:  # a secret, or a URL whose hidden part changed
            out.append((key, f"{key}: changed (value hidden)"))
        else:
            out.append((key, f"{key}: {_shown(before)} → {_shown(after)}"))
    return out


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
