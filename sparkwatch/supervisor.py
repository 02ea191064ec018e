"""The guard process's supervision of the telemetry process: spawn it, talk to it, restart it with backoff.

One thread. It spawns `python -m sparkwatch.loops.telemetry_process --channel-fd N` with its end of a socketpair,
sends it the validated config, then loops: send the guard's state every STATE_EVERY_S (never blocking), forward the
guard's events, and read what telemetry says (per-pid GPU bytes, engine and compile-job counts for STATUS=, reload
replies). When telemetry exits, or stops talking for `stall_after_s` (a hung NVML load holds its GIL), it is killed,
a `component_restarted` event is recorded, and it is started again after a backoff that doubles from 1 s to 60 s
and resets once a run lasted 60 s. Nothing here is on the guard loop's thread.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

from sparkwatch import logs
from sparkwatch.actuators.events import EventLog, EventLogError, make_event
from sparkwatch.channel import STATE_EVERY_S, Channel, ChannelClosed, GpuBoard, socketpair
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.guardconfig import GuardConfig
from sparkwatch.model import Event

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTHY_RUN_S = 60.0  # a run this long resets the backoff
STOP_GRACE_S = 5.0
NVML_OFF_AFTER_STALLS = 2
MAX_UNACKED_EVENTS = 256
RELOAD_RESEND_S = 2.0  # a reload telemetry has not acknowledged is sent again this often
log = logs.get("supervisor")


def telemetry_command(fd: int, nvml: bool = True) -> list[str]:
    module = "sparkwatch.loops.telemetry_process"
    argv = [sys.executable, "-m", module, "--channel-fd", str(fd), "--guard-pid", str(os.getpid())]
    return argv if nvml else [*argv, "--no-nvml"]


def telemetry_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The telemetry process's environment: ours, with CPython's small-object allocator off (unless the user chose
    one). Under 1,000 processes a minute its pymalloc arenas and glibc heap kept growing slowly (bench/RESULTS-soak.md)
    while its live Python objects did not (tracemalloc); with every object in glibc's heap the once-a-minute
    malloc_trim (loops/telemetry.py) hands back free pages wherever they are. The guard keeps pymalloc: it allocates
    little, and its memory is locked."""
    env = dict(environ)
    env.setdefault("PYTHONMALLOC", "malloc")
    return env


# Telemetry's main thread answers every 0.25-1 s whatever its cycle does; only a process-wide stop (a C call holding
# the GIL, such as a dlopen of a hung libnvidia-ml) or a reload waiting behind a slow cycle silences it.
STALL_MIN_S = 15.0
# Before its first message telemetry imports pydantic, prometheus_client and pynvml and checks that NVML loads (up to
# 10 s, sources/nvml_preflight.py): allow that much more, on a loaded box.
STARTUP_ALLOWANCE_S = 60.0


def stall_after_s(config: GuardConfig) -> float:
    """Silence from telemetry this long means it is stuck: ten cycles, and never under STALL_MIN_S."""
    return max(STALL_MIN_S, 10 * config.telemetry_interval_s)


class TelemetrySupervisor:
    """A component of the guard process. `state()` gives the guard state to send; `gpu` is fed from telemetry."""

    name = "telemetry"
    live_keys: frozenset[str] = frozenset()  # telemetry answers for its own keys over the channel

    def __init__(
        self,
        config: GuardConfig,
        events: EventLog,
        state: Callable[[], Mapping[str, Any]],
        *,
        command: Callable[[int, bool], list[str]] = telemetry_command,
    ) -> None:
        self.config = config
        self.events = events
        self.state = state
        self.command = command
        self.gpu = GpuBoard()
        self.engines: int | None = None
        self.compile_jobs: int | None = None
        self.restarts_total = 0
        self.stalls_total = 0
        self.consecutive_stalls = 0
        self.nvml = True  # off once telemetry hung NVML_OFF_AFTER_STALLS times in a row, until sparkwatch restarts
        self.channel: Channel | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.last_heard_monotonic: float | None = None
        self._pending: deque[Event] = deque(maxlen=MAX_UNACKED_EVENTS)  # not yet sent (telemetry may be down)
        # Sent but not yet acknowledged (telemetry acks once its outbox has the alert): resent to the next telemetry
        # process if this one dies first, so a kill's alert survives a telemetry crash (delivery is at least once).
        self._unacked: OrderedDict[str, Event] = OrderedDict()
        self._reply: dict[str, Any] | None = None
        self._replied = threading.Event()
        self._waiting_reply = False
        self._settings_dirty = False  # a reload telemetry has not acknowledged yet
        self._settings_sent_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dropped_before = 0
        self._bad_before = 0

    # --- component interface
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sparkwatch-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_GRACE_S)
        if self._thread is not None:
            self._thread.join(STOP_GRACE_S)

    def apply(self, config: GuardConfig, timeout_s: float = 5.0) -> frozenset[str] | None:
        """Hand telemetry the new config; the keys its components applied, or None if it did not answer in time
        (it is restarting: it will start with the new config)."""
        with self._lock:
            self.config = config
            self._reply = None
            self._replied.clear()
            self._settings_dirty = True
            self._settings_sent_at = -RELOAD_RESEND_S  # send at the next tick
            self._waiting_reply = True
        try:
            if not self._replied.wait(timeout_s):
                return None
        finally:
            self._waiting_reply = False
        reply: dict[str, Any] = self._reply or {}
        for error in reply.get("errors", []):
            log.error("reload: telemetry: %s", error)
        return frozenset(str(k) for k in reply.get("keys", []))

    def forward(self, event: Event) -> None:
        """An EventLog listener: queue the event for telemetry's outbox. Never blocks (on the reaper thread)."""
        self._pending.append(event)

    @property
    def channel_dropped_total(self) -> int:
        return self._dropped_before + (self.channel.dropped_total if self.channel is not None else 0)

    @property
    def channel_bad_total(self) -> int:
        return self._bad_before + (self.channel.bad_total if self.channel is not None else 0)

    def counters(self) -> dict[str, int]:
        return {
            "telemetry_restarts": self.restarts_total,
            "telemetry_stalls": self.stalls_total,
            "channel_dropped": self.channel_dropped_total,
            "channel_bad": self.channel_bad_total,
        }

    # --- the thread
    def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                reason = self._run_once()
            except Exception as exc:  # never let supervision end: the guard would lose telemetry for good
                reason = f"supervisor error: {type(exc).__name__}: {exc}"
            if self._stop.is_set():
                return
            if time.monotonic() - started >= HEALTHY_RUN_S:
                backoff = BACKOFF_MIN_S
            self.restarts_total += 1
            log.error("telemetry process %s; restarting it in %.0f s (the guard keeps running)", reason, backoff)
            self._record_restart(reason, backoff)
            self._stop.wait(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    def _run_once(self) -> str:
        ours, theirs = socketpair()
        try:
            self.proc = subprocess.Popen(
                self.command(theirs.fileno(), self.nvml),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                env=telemetry_env(os.environ),
            )
        finally:
            theirs.close()
        channel = self.channel = Channel(ours)
        self._requeue_unacked()
        proc = self.proc
        spawned = time.monotonic()
        self.last_heard_monotonic = None
        self.engines = self.compile_jobs = None
        with self._lock:
            config = self.config
            self._settings_dirty = False
        channel.send("settings", wire=dict(config.wire), public=dict(config.public), reload=False)
        next_state = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_state:
                    next_state = now + STATE_EVERY_S
                    channel.send("state", **self.state())
                    self._flush_events(channel)
                    with self._lock:
                        config = self.config
                        # A reload is sent until telemetry answers `applied`, again every RELOAD_RESEND_S: a message
                        # refused by a full channel, or lost while telemetry was starting, is never the end of it
                        # (applying the same settings twice changes nothing).
                        due = self._settings_dirty and now >= self._settings_sent_at + RELOAD_RESEND_S
                        if due:
                            self._settings_sent_at = now
                    if due:
                        channel.send("settings", wire=dict(config.wire), public=dict(config.public), reload=True)
                for msg in channel.receive(STATE_EVERY_S):
                    self.last_heard_monotonic = time.monotonic()
                    self.consecutive_stalls = 0
                    self._handle(msg)
                if proc.poll() is not None:
                    return f"exited with status {proc.returncode}"
                heard = self.last_heard_monotonic
                silent_s = time.monotonic() - (spawned if heard is None else heard)
                if silent_s > (STARTUP_ALLOWANCE_S if heard is None else stall_after_s(self.config)):
                    self.stalls_total += 1
                    self.consecutive_stalls += 1
                    if self.consecutive_stalls >= NVML_OFF_AFTER_STALLS and self.nvml:
                        self.nvml = False  # the usual culprit: a dlopen or init of libnvidia-ml that never returns
                        log.error(
                            "telemetry hung %d times in a row: restarting it without NVML", self.consecutive_stalls
                        )
                    proc.kill()  # a process stuck in a C call (a hung dlopen) does not answer SIGTERM
                    proc.wait(STOP_GRACE_S)
                    return f"sent nothing for {silent_s:.0f} s (stuck; killed)"
            return "stopping"
        except ChannelClosed as exc:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_GRACE_S)
            return f"closed the channel ({exc}), exit status {proc.returncode}"
        finally:
            self.engines = self.compile_jobs = None
            self._dropped_before += channel.dropped_total
            self._bad_before += channel.bad_total
            self.channel = None
            channel.close()  # one socket per telemetry process: never leak one per restart

    def _flush_events(self, channel: Channel) -> None:
        while self._pending:
            event = self._pending[0]
            if not channel.send("event", event=event.to_json_dict()):
                return  # telemetry busy or gone: keep it for the next try (or the next telemetry process)
            self._pending.popleft()
            self._unacked[event.id] = event
            while len(self._unacked) > MAX_UNACKED_EVENTS:
                self._unacked.popitem(last=False)

    def _requeue_unacked(self) -> None:
        """The last telemetry process died before its outbox had these: send them first to the next one."""
        while self._unacked:
            _id, event = self._unacked.popitem(last=True)
            self._pending.appendleft(event)

    def _handle(self, msg: Mapping[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "tel":
            engines, jobs = msg.get("engines"), msg.get("compile_jobs")
            self.engines = engines if isinstance(engines, int) else None
            self.compile_jobs = jobs if isinstance(jobs, int) else None
            pids, read_at = msg.get("gpu_pids"), msg.get("gpu_ts")
            if isinstance(pids, dict) and isinstance(read_at, (int, float)):
                self.gpu.update(pids, float(read_at))
            self.gpu.update_holders(msg.get("gpu_holders"))
        elif kind == "ack":
            for event_id in msg.get("ids", []):
                self._unacked.pop(str(event_id), None)
        elif kind == "applied":
            with self._lock:
                self._settings_dirty = False  # telemetry has the new settings: stop resending them
            if self._waiting_reply:
                self._reply = dict(msg)
                self._replied.set()
            else:  # the reload's wait ran out first: say what telemetry applied when it does
                keys = ", ".join(str(k) for k in msg.get("keys", []))
                log.info("reload: telemetry answered late (after the reload's wait)")
                log.info("reload: telemetry applied %s", keys or "nothing")
                for error in msg.get("errors", []):
                    log.error("reload: telemetry: %s", error)

    def _record_restart(self, reason: str, backoff_s: float) -> None:
        event = make_event(
            EventKind.COMPONENT_RESTARTED,
            f"telemetry process {reason}; restarted after {backoff_s:.0f} s",
            {"component": "telemetry", "reason": reason, "backoff_s": backoff_s, "restarts": self.restarts_total},
        )
        try:
            self.events.append(event)
        except EventLogError as exc:
            log.error("could not record component_restarted event: %s", exc)


def stats_to_wire(stats: object) -> dict[str, Any]:
    """GuardStats as plain JSON (dataclasses all the way down)."""
    if not dataclasses.is_dataclass(stats) or isinstance(stats, type):
        raise TypeError("expected a dataclass instance")
    return dataclasses.asdict(stats)
