"""The telemetry process: everything but the guard, in a process of its own that the guard supervises.

NVML, the telemetry loop (/proc census, compilers, JIT caches), the metrics endpoint, the alert outbox, the driver
drift watcher and its udev trigger, and the low-headroom alerts. If anything here blocks (a `dlopen` of a hung
libnvidia-ml holds this interpreter's GIL), leaks or crashes, the guard loop in the other process does not notice;
the guard's supervisor restarts this process with backoff.

What it knows of the guard comes over the channel (`sparkwatch.channel`): its state every 0.25 s, exported under
today's `sparkwatch_guard_*` names through `RemoteGuard`, the guard's events (kills) for the outbox, and the config.
It sends back per-pid GPU memory and the engine and compile-job counts for the guard's STATUS= line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from sparkwatch import logs, syscalls
from sparkwatch.actuators.events import EventLog
from sparkwatch.actuators.outbox import Outbox
from sparkwatch.actuators.spool import AlertRouter
from sparkwatch.actuators.systemd import JournalSink
from sparkwatch.channel import Channel, ChannelClosed, rss_bytes
from sparkwatch.component import Part, Passive, apply_parts, start_parts, stop_parts
from sparkwatch.config import ConfigError, Settings, settings_from_wire
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.exporter.internal import InternalCollector
from sparkwatch.exporter.server import MetricsServer, build_registry
from sparkwatch.loops.driverwatch import DriverWatcher
from sparkwatch.loops.guard import GuardStats
from sparkwatch.loops.headroom import HeadroomWatcher
from sparkwatch.loops.kernlog import KernelLogStats
from sparkwatch.loops.telemetry import Telemetry, TelemetryLoop, gpu_bytes_by_pid
from sparkwatch.model import Event, MemInfo, NvmlFacts, Snapshot
from sparkwatch.sources.nvml_preflight import NvmlOff, nvml_hang_reason
from sparkwatch.sources.udev import UdevWatcher

log = logs.get("telemetry")
FIRST_SETTINGS_S = 30.0
_STATS_FIELDS = frozenset(f.name for f in dataclasses.fields(GuardStats))


class RemoteGuard:
    """The guard's state as the channel last carried it, shaped like the Guard for the exporter: `stats` and
    `settings` read under `lock`."""

    def __init__(self, settings: Settings) -> None:
        self.lock = threading.Lock()
        self.stats = GuardStats()
        self.settings = settings
        self.counters: dict[str, dict[str, int]] = {}
        self.rss_bytes: int | None = None
        self.pid: int | None = None
        self.updates_total = 0
        self.kernlog = RemoteKernelLog()  # the guard process reads /dev/kmsg; the exporter finds it as guard.kernlog

    def update(self, msg: Mapping[str, Any]) -> None:
        raw = msg.get("guard")
        if not isinstance(raw, dict):
            return
        fields = {k: v for k, v in raw.items() if k in _STATS_FIELDS}
        mem = fields.get("mem")
        fields["mem"] = MemInfo(**mem) if isinstance(mem, dict) else None
        stats = GuardStats(**fields)
        self.kernlog.update(msg.get("kernlog"))
        counters = msg.get("counters")
        with self.lock:
            self.stats = stats
            if isinstance(counters, dict):
                self.counters = {str(c): dict(v) for c, v in counters.items() if isinstance(v, dict)}
            rss = msg.get("rss_bytes")
            self.rss_bytes = rss if isinstance(rss, int) else None
            pid = msg.get("pid")
            self.pid = pid if isinstance(pid, int) else None
            self.updates_total += 1

    def available_bytes(self) -> int | None:
        with self.lock:
            return None if self.stats.mem is None else self.stats.mem.available_bytes


_KERNLOG_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelLogStats))


class RemoteKernelLog:
    """The guard process's kernel-log counters as the channel last carried them (`stats` under `lock`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = KernelLogStats()

    def update(self, raw: object) -> None:
        if not isinstance(raw, dict):
            return
        fields = {k: v for k, v in raw.items() if k in _KERNLOG_FIELDS}
        xids = fields.get("xid_total")
        if isinstance(xids, dict):  # JSON object keys are strings; Xid codes are ints
            fields["xid_total"] = {int(code): int(n) for code, n in xids.items() if str(code).isdigit()}
        recent = fields.get("recent_xids")
        if isinstance(recent, list):
            fields["recent_xids"] = [tuple(x) for x in recent if isinstance(x, list) and len(x) == 3]
        try:
            stats = KernelLogStats(**fields)
        except TypeError:
            return  # a malformed message changes nothing
        with self.lock:
            self.stats = stats


class _EventErrors:
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


def event_from_json(data: Mapping[str, Any]) -> Event:
    known = {"id", "ts", "kind", "node", "summary"}
    return Event(
        id=str(data["id"]),
        ts=str(data["ts"]),
        kind=EventKind(data["kind"]),
        node=str(data["node"]),
        summary=str(data["summary"]),
        fields={k: v for k, v in data.items() if k not in known},
    )


NVML_OFF = "NVML off: telemetry hung twice in a row (a hung libnvidia-ml?); restart sparkwatch to try it again"


class TelemetryProcess:
    def __init__(
        self, settings: Settings, channel: Channel | None, *, log_handler: Any = None, nvml_off: str | None = None
    ) -> None:
        """`nvml_off`: why NVML must not be loaded in this process (None: load it)."""
        self.settings = settings
        self.nvml_off = nvml_off
        self.channel = channel
        self.log_handler = log_handler
        self.remote = RemoteGuard(settings)
        self.events = EventLog(settings.events_path, max_bytes=settings.events_max_bytes)
        self.journal = JournalSink()
        self.events.subscribe(self.journal)
        self.parts: list[Part[Settings]] = []
        self.outbox: Outbox | None = None
        self.router: AlertRouter | None = None
        if settings.webhook_url is not None:
            self.outbox = Outbox(
                settings.outbox_dir,
                str(settings.webhook_url),
                settings.webhook_secret.get_secret_value() if settings.webhook_secret is not None else None,
                timeout_s=settings.webhook_timeout_s,
                backoff_min_s=settings.webhook_backoff_min_s,
                backoff_max_s=settings.webhook_backoff_max_s,
                max_alerts=settings.outbox_max_alerts,
                events_path=settings.events_path,
                log=lambda line: logs.legacy(line, "outbox"),
            )
            router = self.router = AlertRouter(self.outbox)
            self.events.subscribe(router)
            box = self.outbox
            self.parts.append(
                Part(
                    "outbox",
                    box,
                    counters=lambda: {
                        "spool_errors": box.spool_errors_total,
                        "failed_attempts": box.failed_attempts_total,
                        "alerts_suppressed": router.suppressed_total,
                        "router_errors": router.errors_total,
                    },
                )
            )
        driver = self.driver = DriverWatcher(
            settings, self.events, nvml_probe=None if nvml_off is None else (lambda: NvmlFacts(error=nvml_off))
        )
        self.parts.append(
            Part(
                "driver",
                driver,
                frozenset({"driver_check_interval_s"}),
                self._apply_driver,
                lambda: {"errors": driver.errors_total},
            )
        )
        if str(settings.root) == "/":  # uevents describe this machine: with a fixture root only the timer runs
            udev = UdevWatcher(driver.poke, log=lambda line: logs.legacy(line, "udev"))
            self.parts.append(Part("udev", udev, counters=lambda: {"errors": udev.errors_total}))
        headroom = self.headroom = HeadroomWatcher(settings, self.remote.available_bytes, self.events)
        self.parts.append(
            Part(
                "headroom",
                headroom,
                HeadroomWatcher.LIVE_KEYS,
                headroom.apply,
                lambda: {"event_errors": headroom.event_errors_total},
            )
        )
        loop = self.loop = TelemetryLoop(
            Telemetry(
                settings, gpu_source=None if nvml_off is None else NvmlOff(nvml_off), driver=lambda: driver.report
            ),
            settings.telemetry_interval_s,
            on_event=self.events.append,
        )
        self.parts.append(
            Part(
                "telemetry",
                loop,
                Telemetry.LIVE_KEYS | {"telemetry_interval_s"},
                loop.reconfigure,
                lambda: {"cycle_errors": loop.errors_total},
            )
        )
        self.registry = build_registry(
            settings, lambda: loop.latest, self.remote, _EventErrors(self.events, self.remote), self.outbox
        )
        self.registry.register(
            InternalCollector(self.all_counters, self.rss, self.psi_trigger, self.telemetry_restarts)
        )
        self.metrics = MetricsServer(settings, self.registry)
        self.parts.append(Part("metrics", self.metrics, counters=self.metrics.counters))
        self.parts.append(
            Part(
                "events",
                Passive(),
                counters=lambda: {
                    "event_write_errors": self.events.write_errors_total,
                    "journal_send_errors": self.journal.send_errors_total,
                    "log_send_errors": logs.send_errors_total(self.log_handler),
                },
            )
        )
        if channel is not None:
            ch = channel
            self.parts.append(
                Part("channel", Passive(), counters=lambda: {"dropped": ch.dropped_total, "bad": ch.bad_total})
            )
        self._apply_lock = threading.Lock()
        self._stop = threading.Event()
        self._last_sent: Snapshot | None = None

    # --- exported
    def all_counters(self) -> dict[str, dict[str, dict[str, int]]]:
        mine = {part.name: dict(part.counters()) for part in self.parts}
        with self.remote.lock:
            theirs = {c: dict(v) for c, v in self.remote.counters.items()}
        return {"telemetry": mine, "guard": theirs} if theirs else {"telemetry": mine}

    def rss(self) -> dict[str, int]:
        out = {"telemetry": rss_bytes()}
        with self.remote.lock:
            if self.remote.rss_bytes is not None:
                out["guard"] = self.remote.rss_bytes
        return out

    def psi_trigger(self) -> bool | None:
        with self.remote.lock:
            return self.remote.stats.psi_trigger if self.remote.updates_total else None

    def telemetry_restarts(self) -> int | None:
        with self.remote.lock:
            return self.remote.counters.get("telemetry", {}).get("telemetry_restarts")

    # --- reload
    def _apply_driver(self, settings: Settings) -> frozenset[str]:
        self.driver.interval_s = settings.driver_check_interval_s
        return frozenset({"driver_check_interval_s"})

    def apply(self, settings: Settings) -> tuple[frozenset[str], list[str]]:
        with self._apply_lock:
            applied, errors = apply_parts(self.parts, settings)
            self.settings = settings
            with self.remote.lock:
                self.remote.settings = settings
        return frozenset().union(*applied.values()), errors

    # --- the channel
    def handle(self, msg: Mapping[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "state":
            self.remote.update(msg)
        elif kind == "event" and isinstance(msg.get("event"), dict):
            try:
                event = event_from_json(msg["event"])
            except (KeyError, ValueError) as exc:
                log.error("unusable event from the guard: %s", exc)
                return
            if self.router is not None:
                self.router(event)  # already durable in events.jsonl and in the journal: only the alert is left
            self._send("ack", ids=[event.id])  # the outbox has it (spooled, fsynced): the guard may forget it
        elif kind == "settings" and msg.get("reload"):
            try:
                new = settings_from_wire(msg.get("wire") or {})
            except ConfigError as exc:
                self._send("applied", keys=[], errors=[f"config refused: {exc}"])
                return
            t0 = time.monotonic()
            keys, errors = self.apply(new)
            took_s = time.monotonic() - t0
            if took_s > 1.0:
                log.warning("reload: applying took %.1f s (a telemetry cycle was running)", took_s)
            self._send("applied", keys=sorted(keys), errors=errors)

    def _send(self, kind: str, **fields: Any) -> None:
        if self.channel is not None:
            self.channel.send(kind, **fields)

    def report(self) -> None:
        """The latest cycle's parts of the guard's STATUS= line, and per-pid GPU memory for the kill policy."""
        snap = self.loop.latest
        if snap is None or snap is self._last_sent:
            self._send("tel", engines=None, compile_jobs=None, gpu_ts=None, gpu_pids={})  # alive, nothing yet
            return
        self._last_sent = snap
        reading = gpu_bytes_by_pid(snap)
        pids = {str(pid): used for pid, used in reading[1].items()} if reading is not None else {}
        self._send(
            "tel",
            engines=len(snap.engines),
            compile_jobs=snap.compile.parallel_jobs if snap.compile is not None else None,
            gpu_ts=snap.ts if snap.gpu is not None and snap.gpu.up else None,
            gpu_pids=pids,
            gpu_holders=[list(key) for key in sorted(self.loop.telemetry.gpu_holder_keys)],
        )

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        try:
            # A port in use is not a failure here: the server keeps trying to bind on its own thread (BIND_RETRY_S)
            # while the rest runs. Any other failure to start the endpoint (unreadable TLS files) exits, and the
            # guard's supervisor tries again after its backoff.
            started = start_parts(self.parts, essential={"metrics"})
        except Exception:
            return 3
        endpoint = ""
        if self.metrics in [p.obj for p in started]:
            listen = self.settings.listen
            endpoint = f"; metrics on {listen}" if self.metrics.serving else f"; metrics waiting for {listen}"
        log.info("telemetry running (pid %d): %s%s", os.getpid(), ", ".join(part.name for part in started), endpoint)
        next_report = 0.0
        while not self._stop.is_set():
            if self.channel is None:
                self._stop.wait(1.0)
                continue
            try:
                for msg in self.channel.receive(0.25):
                    self.handle(msg)
            except ChannelClosed:
                log.info("the guard closed the channel; telemetry stops")
                break
            now = time.monotonic()
            if now >= next_report:
                next_report = now + min(1.0, self.settings.telemetry_interval_s)
                self.report()
        stop_parts(started)
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    stop = threading.Event()
    target: list[TelemetryProcess] = []

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()
        if target:
            target[0].request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the guard owns reloads; a terminal hangup reaches us too
    parser = argparse.ArgumentParser(prog="sparkwatch-telemetry")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--guard-pid", type=int, default=0)
    parser.add_argument("--no-nvml", action="store_true", help="never load libnvidia-ml (after it hung twice)")
    args = parser.parse_args(argv)
    # Die with the guard (even one killed with SIGKILL): a telemetry process left behind would hold the metrics port.
    syscalls.set_parent_death_signal(signal.SIGKILL)
    if args.guard_pid and os.getppid() != args.guard_pid:
        return 0  # the guard is already gone
    syscalls.set_comm("sparkwatch-tel")
    # Before any thread starts (the guard process does the same): glibc gives each thread that mallocs its own arena
    # (up to 8 per core), and memory freed in one arena is not reused by the others.
    syscalls.limit_malloc_arenas(2)
    handler = logs.setup("telemetry")
    channel = Channel.from_fd(args.channel_fd)
    settings: Settings | None = None
    deadline = time.monotonic() + FIRST_SETTINGS_S
    try:
        while settings is None and not stop.is_set() and time.monotonic() < deadline:
            for msg in channel.receive(0.5):
                if msg.get("t") == "settings":
                    settings = settings_from_wire(msg.get("wire") or {})
                    break
    except (ChannelClosed, ConfigError) as exc:
        log.error("no usable config from the guard: %s", exc)
        return 2
    if settings is None:
        return 0 if stop.is_set() else 2
    # NVML is loaded only after a child process showed it loads: a hung load would stop this whole interpreter.
    nvml_off = NVML_OFF if args.no_nvml else nvml_hang_reason()
    if nvml_off is not None:
        log.error("%s", nvml_off)
    process = TelemetryProcess(settings, channel, log_handler=handler, nvml_off=nvml_off)
    target.append(process)
    if stop.is_set():
        return 0
    return process.run()


if __name__ == "__main__":
    raise SystemExit(main())
