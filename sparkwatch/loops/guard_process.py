"""The guard process: the unit's main PID. It guards, feeds the systemd watchdog, and supervises telemetry.

`sparkwatch run` validates the config (pydantic, in `sparkwatch.config`), then execs into this module with the
validated values on a memfd, so this process never imports pydantic, NVML, prometheus_client, HTTP or rich: its RSS
is the guard's (bench/RESULTS-guard.md). Threads: the guard loop, the reaper, the scout, the sd_notify sender, the
telemetry supervisor; the main thread only waits for signals and runs reloads. A hung NVML load, a stuck scrape or a
thread explosion happens in the telemetry process, whose GIL is not ours.

Signals: handlers are installed before anything else starts (`sparkwatch.entry` kept them blocked until then).
SIGTERM/SIGINT stop cleanly (STOPPING=1 first, exit 0). SIGHUP validates the whole config in a short child process
(`sparkwatch run --print-settings`, the same loader as at start), then the guard applies the new values, then the
telemetry process gets them over the channel and says which keys its components took; the log names what applied
and what needs a restart. A bad config is logged and the running one kept.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from sparkwatch import logs, syscalls
from sparkwatch.actuators.events import EventLog
from sparkwatch.actuators.spool import AlertRouter, FileSpool
from sparkwatch.actuators.systemd import JournalSink, Notifier, ServiceNotifier
from sparkwatch.channel import rss_bytes
from sparkwatch.component import Part, Passive, apply_parts, start_parts, stop_parts
from sparkwatch.core.redact import remember_secrets
from sparkwatch.core.status import status_line
from sparkwatch.entry import DAEMON_SIGNALS
from sparkwatch.guardconfig import GuardConfig, describe_wire_changes
from sparkwatch.loops.guard import Guard
from sparkwatch.supervisor import TelemetrySupervisor, stats_to_wire, telemetry_command

log = logs.get("daemon")
VALIDATE_TIMEOUT_S = 60.0  # the validator imports pydantic: ~0.5 s idle, seconds on a box under pressure
# Telemetry applies between two cycles; a first cycle on a loaded box (NVML init, a /proc census of thousands of
# processes) took up to several seconds here.
TELEMETRY_REPLY_S = 20.0


class ReloadError(Exception):
    """The new config is not valid (or could not be read); the message names the key like check-config does."""


def validate_with(command: Sequence[str]) -> GuardConfig:
    """Run the validator (`sparkwatch run … --print-settings`) and build the config it printed."""
    try:
        done = subprocess.run(
            list(command), stdin=subprocess.DEVNULL, capture_output=True, timeout=VALIDATE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReloadError(f"could not run the validator: {exc}") from None
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        message = lines[-1] if lines else f"validator exited with status {done.returncode}"
        raise ReloadError(message.removeprefix("sparkwatch: ").removeprefix("config error: "))
    try:
        data = json.loads(done.stdout)
        remember_secrets(data.get("secrets") or [])
        return GuardConfig.from_wire(data["wire"], data["public"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ReloadError(f"validator output unusable: {exc}") from None


class GuardProcess:
    def __init__(
        self,
        config: GuardConfig,
        validate: Callable[[], GuardConfig] | None = None,
        *,
        log_handler: Any = None,
        telemetry: Callable[[int, bool], list[str]] | None = telemetry_command,
    ) -> None:
        self.config = config
        self.validate = validate  # None: SIGHUP is logged and ignored
        self.log_handler = log_handler
        self.events = EventLog(config.events_path, max_bytes=config.events_max_bytes)
        self.journal = JournalSink()
        self.events.subscribe(self.journal)
        self.sd = ServiceNotifier(Notifier(), self.status_line, poll_max_s=config.poll_max_s)
        self.guard = Guard(config, self.events, heartbeat=self.sd.beat)
        self.supervisor = TelemetrySupervisor(config, self.events, self.state, command=telemetry or telemetry_command)
        # From telemetry's last cycle, over the channel: NVML's GPU holders and per-pid GPU bytes (the guard never
        # loads NVML itself; a stale or missing reading never delays a kill: the policy ranks without it).
        self.guard.gpu_holders = self.supervisor.gpu.holder_keys
        self.guard.gpu_bytes_by_pid = self.supervisor.gpu.latest
        # With a webhook, the guard spools its own alerts (kills, kernel-log events) before each event is written, so
        # a guard that dies between the event and the hand-over to telemetry loses none: telemetry's outbox finds the
        # file when it starts (actuators.spool).
        self.spool: FileSpool | None = None
        self.router: AlertRouter | None = None
        if config.wire.get("webhook_url"):
            self.spool = FileSpool(config.state_dir / "outbox")
            self.router = AlertRouter(self.spool)
            self.events.subscribe(self.router)
        self.events.subscribe(self.supervisor.forward)
        self.parts: list[Part[GuardConfig]] = [
            Part(
                "guard",
                self.guard,
                Guard.LIVE_KEYS,
                self.guard.reconfigure,
                lambda: {"meminfo_errors": self.guard.stats.meminfo_errors_total},
            ),
            Part(
                "sd_notify",
                self.sd,
                frozenset(),
                self.sd.reconfigure,
                lambda: {"notify_send_errors": self.sd.notifier.send_errors_total},
            ),
            Part(
                "events",
                Passive(),
                frozenset(),
                None,
                lambda: {
                    "event_write_errors": self.events.write_errors_total,
                    "journal_send_errors": self.journal.send_errors_total,
                    "log_send_errors": logs.send_errors_total(self.log_handler),
                    "alert_spool_errors": self.spool.spool_errors_total if self.spool is not None else 0,
                    "alerts_suppressed": self.router.suppressed_total if self.router is not None else 0,
                    "router_errors": self.router.errors_total if self.router is not None else 0,
                    "kernel_log_events_dropped": self.guard.kernlog.stats.events_dropped_total,
                },
            ),
        ]
        if telemetry is not None:
            self.parts.append(Part("telemetry", self.supervisor, frozenset(), None, self.supervisor.counters))
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake = threading.Event()

    # --- what the channel carries
    def counters(self) -> dict[str, dict[str, int]]:
        return {part.name: dict(part.counters()) for part in self.parts}

    def state(self) -> dict[str, Any]:
        g = self.guard
        with g.lock:
            stats = stats_to_wire(g.stats)
        stats["warm_scans_total"] = g.warm_scans_total
        with g.kernlog.lock:
            kernlog = stats_to_wire(g.kernlog.stats)
        return {
            "guard": stats,
            "kernlog": kernlog,
            "counters": self.counters(),
            "rss_bytes": rss_bytes(),
            "watchdog_pings_total": self.sd.watchdog_pings_total,
            "pid": os.getpid(),
        }

    # --- signals
    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def request_reload(self) -> None:
        self._reload.set()
        self._wake.set()

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.request_reload()
        else:
            self.request_stop()

    def status_line(self) -> str:
        g = self.guard
        with g.lock:
            mem = g.stats.mem
            armed = g.stats.armed
            error = g.stats.last_error if mem is None else None
            floor = g.params.floor_bytes
        return status_line(
            None if mem is None else mem.available_bytes,
            floor,
            engines=self.supervisor.engines,
            compile_jobs=self.supervisor.compile_jobs,
            dry_run=self.config.dry_run,
            armed=armed,
            error=error,
        )

    # --- reload
    def reload(self) -> bool:
        """Validate the whole new config, then apply it: the guard process's parts, then telemetry's."""
        if self.validate is None:
            log.warning("SIGHUP: this daemon was started without a config loader; nothing reloaded")
            return False
        notify = self.sd.notifier
        notify.notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        try:
            try:
                new = self.validate()
            except ReloadError as exc:
                log.error("reload: config error: %s; keeping the running config", exc)
                return False
            old = self.config
            changes = describe_wire_changes(old.wire, new.wire, old.public, new.public)
            if not changes:
                log.info("reload: config unchanged")
                return True
            applied, errors = apply_parts(self.parts, new, skip={"telemetry"})  # telemetry's answer comes below
            for error in errors:
                log.error("reload: %s", error)
            self.config = new
            telemetry_keys = self.supervisor.apply(new, TELEMETRY_REPLY_S)
            if telemetry_keys is not None:
                applied["telemetry"] = telemetry_keys
            log.info("reload: %s", "; ".join(text for _key, text in changes))
            changed = [key for key, _text in changes]
            for name, keys in applied.items():
                took = [key for key in changed if key in keys]
                if took:
                    log.info("reload: %s applied %s", name, ", ".join(took))
            live = frozenset().union(*applied.values())
            pending = [key for key in changed if key not in live]
            if telemetry_keys is None:
                log.warning(
                    "reload: the telemetry process has not answered in %.0f s; it applies the new config when it "
                    "reads it (or when it restarts), and what it applied is logged then",
                    TELEMETRY_REPLY_S,
                )
            if pending and telemetry_keys is None:
                log.info("reload: not applied yet (telemetry's part, or after a restart): %s", ", ".join(pending))
            elif pending:
                log.info("reload: takes effect after a restart: %s", ", ".join(pending))
            return True
        finally:
            notify.notify(f"READY=1\nSTATUS={self.status_line()}")

    # --- run
    def _protect_self(self) -> None:
        """Lock our memory so the guard is not paged out under the very pressure it watches (earlyoom does too)."""
        syscalls.limit_malloc_arenas(2)  # before the threads start: one arena per thread costs RSS for nothing
        too_small = syscalls.memlock_limit_too_small()
        if self.config.mlock and too_small is not None:
            log.warning(
                "not locking memory: RLIMIT_MEMLOCK is %d MiB. Under a finite limit mlockall(MCL_FUTURE) makes later "
                "thread stacks fail once the locked address space reaches it. Set LimitMEMLOCK=infinity "
                "(docs/systemd.md).",
                too_small >> 20,
            )
        elif self.config.mlock:
            try:
                log.info("mlockall: %s", syscalls.mlockall())
            except OSError as exc:
                log.warning(
                    "mlockall not permitted (%s); the guard may be paged out under pressure. "
                    "Raise LimitMEMLOCK in the unit to allow it.",
                    exc.strerror,
                )

    def run(self) -> int:
        self._protect_self()
        started = start_parts(self.parts, essential={"guard"})
        c = self.config
        log.info(
            "running: floor %d MiB, metrics on %s, events in %s%s; journal via %s%s; telemetry in its own process",
            c.floor >> 20,
            c.listen,
            c.events_path,
            " (DRY RUN: nothing will be signalled)" if c.dry_run else "",
            self.journal.backend,
            f", sd_notify via {self.sd.notifier.backend}" if self.sd.notifier.enabled else "",
        )
        syscalls.trim_heap()  # hand back what importing and building everything left free
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._reload.is_set() and not self._stop.is_set():
                self._reload.clear()
                self.reload()
        self.sd.stopping()  # first, so systemd knows the exit that follows is wanted
        log.info("stopping")
        stop_parts(started)
        return 0


def read_settings_fd(fd: int) -> Mapping[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    data = json.loads(b"".join(chunks))
    if not isinstance(data, dict):
        raise ValueError("settings payload is not an object")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    # Handlers first, then unblock: a SIGHUP that arrived while `run` loaded the config is delivered now, as a
    # reload request, and nothing has started yet that it could catch half-built.
    pending: list[int] = []
    target: list[GuardProcess] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if target:
            target[0].on_signal(signum, frame)
        else:
            pending.append(signum)

    for sig in DAEMON_SIGNALS:
        signal.signal(sig, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, DAEMON_SIGNALS)
    parser = argparse.ArgumentParser(prog="sparkwatch-guard")
    parser.add_argument("--settings-fd", type=int, required=True)
    parser.add_argument("cli_args", nargs=argparse.REMAINDER, help="the `sparkwatch run …` arguments, for reloads")
    args = parser.parse_args(argv)
    syscalls.set_comm("sparkwatch")
    handler = logs.setup("guard")
    try:
        data = read_settings_fd(args.settings_fd)
        remember_secrets(data.get("secrets") or [])  # before any line is logged: the log redacts them
        config = GuardConfig.from_wire(data["wire"], data["public"])
    except (OSError, ValueError, KeyError) as exc:
        log.error("config error: cannot read the validated settings: %s", exc)
        return 2
    cli_args = [a for a in args.cli_args if a != "--"]
    command = [sys.executable, "-m", "sparkwatch", *cli_args, "--print-settings"]
    process = GuardProcess(config, lambda: validate_with(command), log_handler=handler)
    target.append(process)
    for signum in pending:
        process.on_signal(signum, None)
    return process.run()


if __name__ == "__main__":
    raise SystemExit(main())
