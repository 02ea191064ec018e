"""The guard's kernel-log hook: NVRM and Xid lines polled on the guard's thread, recorded on a thread of their own.

`KernelLogWatch.poll` runs inside the guard's tick. It reads what /dev/kmsg has (non-blocking, rate-bounded), parses
it, counts it and feeds driver allocation failures to core.driver.nvrm.corroborate. It returns the trigger to fire with,
or None; the guard calls its own `fire`. It never scans /proc and never writes to disk: attributing a line's pid to an
engine tree (a /proc scan) and the fsynced event are the recorder thread's work, queued without waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.eventlog import EventLog, EventLogError, make_event
from sparkwatch.common.sources.kmsg import KmsgSource
from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.common.stats import KernelLogStats
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.driver import nvrm as core
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import EngineTree
from sparkwatch.core.units import format_size

RECORD_QUEUE_MAX = 256  # events waiting for the recorder; beyond this they are counted as dropped, never waited on


@dataclass(frozen=True, slots=True)
class _Job:
    kind: EventKind
    summary: str
    fields: dict[str, object]
    pid: int | None


log = logs.get("kernlog")


class KernelLogWatch:
    def __init__(
        self,
        events: EventLog,
        proc_root: Path,
        scope: Callable[[], tuple[EngineRules, Scope]],
        *,
        enabled: bool = True,
        accept_injected: bool = False,
        source: KmsgSource | None = None,
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        self.events = events
        self.source = source if source is not None else KmsgSource()
        self.enabled = enabled  # kernel_log_corroboration: off, lines are still counted and recorded, never fire
        self.accept_injected = accept_injected  # kernel_log_accept_injected: see poll()
        self._injected_logged = False
        self.stats = KernelLogStats()
        self.lock = threading.Lock()
        self.state = core.CorroborationState()
        self._scope = scope
        self._proc_root = proc_root
        self._scanner = ProcScanner(proc_root)  # the recorder thread's own: the guard's scanner stays the guard's
        self._wall = wall_clock or time.time
        self._jobs: queue.Queue[_Job | str | None] = queue.Queue(RECORD_QUEUE_MAX)  # str: a line to log
        self._thread: threading.Thread | None = None

    # --- lifecycle
    def start(self) -> None:
        if not self.source.open():
            log.warning("kernel log not readable, NVRM/Xid lines unseen: %s", self.source.stats.reason)
        with self.lock:
            self.stats.readable = self.source.stats.readable
            self.stats.reason = self.source.stats.reason
        self._thread = daemon_thread(self._record_run, "sparkwatch-kernlog")
        self._thread.start()

    def stop(self) -> None:
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        if self._thread is not None:
            self._thread.join(2)
        self.source.close()

    # --- on the guard's thread
    def poll(
        self, now: float, available_bytes: int | None, floor_bytes: int, warn_headroom_bytes: int, armed: bool
    ) -> str | None:
        """Read and judge the new kernel-log lines; the trigger to fire with now, or None. Never blocks."""
        records = self.source.poll(now)
        src = self.source.stats
        fire: str | None = None
        params = core.CorroborationParams(floor_bytes, warn_headroom_bytes, self.enabled)
        parsed: list[core.XidLine | core.NvrmError] = []
        for record in records:
            if "NVRM" not in record.text:
                continue
            if not core.is_from_kernel(record) and not self.accept_injected:
                # Written into /dev/kmsg by a process, not printed by the driver: the kernel gives every such line a
                # userspace facility so it can be told apart. A test suite, `logger --kmsg` or an attacker with root
                # must not page anyone with "GPU has fallen off the bus" or make the guard fire.
                with self.lock:
                    self.stats.injected_ignored_total += 1
                if not self._injected_logged:
                    self._injected_logged = True
                    self._log_later(
                        f"sparkwatch: ignoring NVRM lines written into the kernel log by a process (facility "
                        f"{record.facility}, not the kernel's); kernel_log_accept_injected = true acts on them"
                    )
                continue
            line = core.parse_nvrm(record.text, record.level)
            if line is None:
                continue
            parsed.append(line)
            if isinstance(line, core.XidLine):
                self._queue_xid(line)
                continue
            if not line.is_alloc_failure:
                continue
            self.state, verdict = core.corroborate(
                self.state, params, now, available_bytes, line, guard_armed=armed and fire is None
            )
            pid = line.pid if line.pid is not None else record.caller_tid
            if verdict.action == core.FIRE:
                fire = verdict.trigger
            if verdict.action is not None:
                self._queue_alloc(
                    line, verdict, available=available_bytes, floor=floor_bytes, warn=warn_headroom_bytes, pid=pid
                )
        with self.lock:
            s = self.stats
            s.readable, s.reason = src.readable, src.reason
            s.lines_total, s.dropped_total = src.lines_total, src.dropped_total
            for line in parsed:
                if isinstance(line, core.XidLine):
                    s.xid_total[line.code] = s.xid_total.get(line.code, 0) + 1
                    s.recent_xids = [*s.recent_xids[-15:], (self._wall(), line.code, core.xid_info(line).name)]
                else:
                    s.nvrm_errors_total[line.kind] = s.nvrm_errors_total.get(line.kind, 0) + 1
            if fire is not None:
                s.corroborated_fires_total += 1
        return fire

    def _queue_xid(self, xid: core.XidLine) -> None:
        info = core.xid_info(xid)
        who = f", pid {xid.pid} ({xid.process or '?'})" if xid.pid is not None else ""
        need = {
            core.RESET_GPU: "the GPU needs a reset (nvidia-smi -r, or a reboot): a human must act",
            core.REBOOT: "the box needs a reboot: a human must act",
            core.RESTART_APP: "restart the application",
            core.CHECK_APP: "check the application (illegal access, bad kernel)",
        }.get(info.action, "for information")
        summary = f"GPU Xid {xid.code} on {xid.device}: {info.name}{who}; {need}"
        fields: dict[str, object] = {
            "code": xid.code,
            "name": info.name,
            "action": info.action,
            "page": info.pages,
            "device": xid.device,
            "pid": xid.pid,
            "process": xid.process,
            "message": xid.message[:300],
        }
        self._submit(_Job(EventKind.XID, summary, fields, xid.pid))

    def _queue_alloc(
        self,
        line: core.NvrmError,
        verdict: core.Corroboration,
        *,
        available: int | None,
        floor: int,
        warn: int,
        pid: int | None,
    ) -> None:
        fired = verdict.action == core.FIRE
        if fired:
            what = "counted as a floor crossing: the guard fires"
        elif not self.enabled:
            what = "kernel_log_corroboration is off: alert only"
        elif verdict.in_band:
            what = "the guard is disarmed after a kill: alert only"
        else:
            what = "MemAvailable is above floor + warn_headroom: alert only, no kill"
        shown = "?" if available is None else format_size(available)
        summary = f"NVIDIA driver allocation failed ({line.status or line.kind}) at MemAvailable {shown}: {what}"
        fields: dict[str, object] = {
            "trigger": verdict.trigger,
            "action": "fired" if fired else "alerted",
            "nvrm_kind": line.kind,
            "status": line.status,
            "available_bytes": available,
            "floor_bytes": floor,
            "warn_headroom_bytes": warn,
            "in_band": verdict.in_band,
            "pid": pid,
            "message": line.message[:300],
        }
        self._submit(_Job(EventKind.DRIVER_ALLOC_FAILED, summary, fields, pid))

    def _submit(self, job: _Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            with self.lock:
                self.stats.events_dropped_total += 1

    def _log_later(self, line: str) -> None:
        """Log `line` from the recorder's thread: the guard's thread never writes to stderr or the journal itself."""
        try:
            self._jobs.put_nowait(line)
        except queue.Full:
            pass

    # --- on the recorder's thread
    def _record_run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, str):
                log.warning(job)
                continue
            try:
                self._record(job)
            except Exception as exc:  # a record that fails must not end the thread
                log.error("ERROR kernel-log event: %r", exc)

    def _record(self, job: _Job) -> None:
        fields = dict(job.fields)
        tree = self._attribute(job.pid) if job.pid is not None else None
        if tree is not None:
            fields["engine"] = tree.kind
            fields["engine_root_pid"] = tree.root.pid
        summary = job.summary + (f" [engine {tree.kind} root {tree.root.pid}]" if tree is not None else "")
        level = logging.WARNING if job.kind == EventKind.XID else logging.ERROR  # the journal priorities of the events
        log.log(level, "%s %s", job.kind.upper(), summary)
        try:
            self.events.append(make_event(job.kind, summary, fields))
        except EventLogError as exc:
            log.error("ERROR could not record %s event: %s", job.kind, exc)

    def _attribute(self, pid: int) -> EngineTree | None:
        """The engine tree a driver line's pid (or printing thread) belongs to: threads count as their process."""
        rules, scope = self._scope()
        tgid = _tgid(self._proc_root, pid)
        for tree in find_engine_trees(self._scanner.scan().procs, rules, scope):
            if pid in tree.pids or tgid in tree.pids:
                return tree
        return None


def _tgid(proc_root: Path, tid: int) -> int | None:
    """The process a thread id belongs to (a kmsg caller=T<tid> names a thread)."""
    try:
        with open(proc_root / str(tid) / "status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
