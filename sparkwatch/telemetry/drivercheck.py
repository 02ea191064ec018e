"""The driver check: reads driver facts every `driver_check_interval_s` and at once on a udev poke, judges them, and
turns episode changes into events (driver_stranded / driver_will_strand / driver_version_mismatch /
driver_not_loaded / driver_recovered).

Episodes survive restarts: the open problems are kept in <state_dir>/driver-alerts.json, so a daemon restarted while
the driver is still stranded does not page again, and one restarted after the reboot that fixed it says recovered.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sparkwatch.common import logs
from sparkwatch.common.durable import private_dir, read_regular, write_atomic
from sparkwatch.common.eventlog import EventLog, EventLogError, make_event
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.driver.drift import judge
from sparkwatch.core.enums import DriverProblem
from sparkwatch.core.model import DriverReport, NvmlFacts
from sparkwatch.core.report.alerts import driver_step
from sparkwatch.telemetry.sources.driverfacts import read_driver_facts
from sparkwatch.telemetry.sources.nvml import probe_nvml

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings

# A burst of uevents (nvidia, nvidia_uvm, nvidia_modeset, nvidia_drm, each add/remove) becomes one check.
STATE_MAX_BYTES = 65536  # the driver state is a few dozen bytes of JSON
POKE_COALESCE_S = 0.5


log = logs.get("driver")


class DriverWatcher:
    def __init__(
        self,
        settings: Settings,
        events: EventLog,
        nvml_probe: Callable[[], NvmlFacts] | None = None,
    ) -> None:
        self.settings = settings
        self.events = events
        self.root = settings.root
        # NVML describes this machine only: never ask it about a fixture root.
        live = str(settings.root) == "/"
        self.nvml_probe = nvml_probe if nvml_probe is not None else (probe_nvml if live else None)
        self.interval_s = settings.driver_check_interval_s
        self.state_path = settings.state_dir / "driver-alerts.json"
        self.report: DriverReport | None = None  # the latest; the telemetry loop puts it in Snapshot.driver
        self.checks_total = 0
        self.errors_total = 0
        self.last_error: str | None = None
        self.last_duration_s = 0.0
        self._open = self._load_state()
        self._poke = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = daemon_thread(self._run, "sparkwatch-driver")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        if self._thread is not None:
            self._thread.join(10)

    def poke(self, why: str = "") -> None:
        """Run a check now (called from the udev thread)."""
        self._poke.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            if self._poke.wait(self.interval_s):
                self._stop.wait(POKE_COALESCE_S)
            self._poke.clear()

    def check(self) -> DriverReport | None:
        """One look. Never raises: a failure is counted and logged, and the next minute tries again."""
        started = time.monotonic()
        try:
            return self._check()
        finally:
            self.last_duration_s = time.monotonic() - started
            self.checks_total += 1  # counted once the check, its events and its state are done

    def _check(self) -> DriverReport | None:
        try:
            report = judge(read_driver_facts(self.root, self.nvml_probe))
        except Exception as exc:
            self.errors_total += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("ERROR driver check: %s", self.last_error)
            return None
        previous = self.report
        self.report = report
        if previous is None or previous.verdict != report.verdict:
            log.info("driver: %s", report.summary)
        new_open, alerts = driver_step(self._open, report)
        for alert in alerts:
            try:
                self.events.append(make_event(alert.kind, alert.summary, alert.fields))
            except EventLogError as exc:
                # Keep the old episode state so the next check records it again (at least once, as the outbox).
                self.errors_total += 1
                log.error("ERROR could not record %s event: %s", alert.kind, exc)
                return report
        if new_open != self._open:
            self._open = new_open
            self._save_state()
        return report

    def _load_state(self) -> frozenset[DriverProblem]:
        try:
            data = json.loads(read_regular(self.state_path, STATE_MAX_BYTES, owned=True))  # ours, or not trusted
            names = {str(p) for p in data.get("open_problems", [])}
        except (OSError, ValueError, AttributeError, TypeError, RecursionError):
            return frozenset()
        return frozenset(p for p in DriverProblem if p in names)  # a name this version does not know is dropped

    def _save_state(self) -> None:
        try:
            private_dir(self.state_path.parent, self.events.group)  # the state dir, as the event log keeps it
            write_atomic(self.state_path, json.dumps({"open_problems": sorted(self._open)}).encode())
        except OSError as exc:
            self.errors_total += 1
            self.last_error = f"{self.state_path}: {exc.strerror or exc}"
            log.error("ERROR saving driver episode state: %s", self.last_error)
