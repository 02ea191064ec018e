"""The guard process: the unit's main PID. It guards, feeds the systemd watchdog, and supervises telemetry.

`sparkwatch run` validates the config (pydantic, in `sparkwatch.config`), then execs into `python -m
sparkwatch.guard` with the validated values on a memfd, so this process never imports pydantic, NVML,
prometheus_client, HTTP or rich: its RSS is the guard's (bench/RESULTS-idle.md). Threads: the pool watch, the
reaper, the scout, the launch declarations reader (other users' files: never read on the pool watch's loop), the
kernel-log recorder, the flight recorder's writer, the sd_notify sender, the telemetry supervisor; the main thread only
waits for signals, checks the process's own RSS, and starts reloads. A hung NVML load, a stuck scrape or a thread
explosion happens in the telemetry process, whose GIL is not ours.

Signals: handlers are installed before anything else starts (`sparkwatch.entry` kept them blocked until then).
SIGTERM/SIGINT stop cleanly within a second whatever a reload is doing (STOPPING=1 first, exit 0). SIGHUP validates
the whole config in a short child process (`sparkwatch run --print-settings`, the same loader as at start) on a
thread of its own, then the guard applies the new values, then the telemetry process gets them over the channel and
says which keys its components took; the log names what applied and what needs a restart. A bad config is logged
and the running one kept.

Published state: the main thread writes guard.json (common.guardfile: pid and start time, armed or dry run, floor,
budgets, the launched engines taken, the latest kills of them for their launch) at start, after a reload, and when
the pool watch says the set of launched engines it took changed or it killed one; it removes it on a clean stop. No
heartbeat: a reader checks that the pid still has the start time the file gives, so a dead guard's file reads as
stale without the guard writing every tick.

Construction goes one way (gpud's New()): the recording; the guard's inbox (guard.inbox), its config snapshot cell
and the near-floor flag; the ledger (kill records, launched engines); the verifiers of telemetry's kill requests (the
group and wedge watches, which submit to the inbox); the supervisor, given them in its one table; the pool watch's
parts (guard.poolwatch.PoolParts), the flight recorder, the pool watch. Each is handed what it reads in its
constructor: no lambda reaches back to something built later, and nothing is assigned after construction.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from sparkwatch.common import guardfile, logs, syscalls
from sparkwatch.common.daemonargv import parse_daemon_argv
from sparkwatch.common.eventlog import make_event
from sparkwatch.common.guardconfig import GuardConfig, SnapshotCell, describe_wire_changes
from sparkwatch.common.lifecycle import Component, CountersOnly, apply_all, start_all, stop_all
from sparkwatch.common.messages import GroupTeardownMsg, StateMsg, WedgedMsg
from sparkwatch.common.recording import Recording, open_recording
from sparkwatch.common.selfwatch import rss_bytes
from sparkwatch.common.sharing import events_gid
from sparkwatch.common.signals import DAEMON_SIGNALS
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.common.spool import FileSpool
from sparkwatch.common.systemd import Notifier, ServiceNotifier
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.redact import remember_secrets
from sparkwatch.core.report.guardstate import GuardState
from sparkwatch.core.report.statusline import status_line
from sparkwatch.guard.inbox import KillInbox
from sparkwatch.guard.killpath import GROUP_COUNTERS, KillRequest
from sparkwatch.guard.poolwatch import GuardLinks, Ledger, PoolParts, PoolWatch
from sparkwatch.guard.recorder import FlightRecorder
from sparkwatch.guard.start import exec_guard
from sparkwatch.guard.supervisor import TelemetrySupervisor, telemetry_command
from sparkwatch.guard.wedgewatch import WedgeWatch

if TYPE_CHECKING:
    from sparkwatch.guard.groupwatch import GroupWatch

log = logs.get("daemon")
VALIDATE_TIMEOUT_S = 60.0  # the validator imports pydantic: ~0.5 s idle, seconds on a box under pressure
# Telemetry applies between two cycles; a first cycle on a loaded box (NVML init, a /proc census of thousands of
# processes) took up to several seconds here.
TELEMETRY_REPLY_S = 20.0
RELOAD_JOIN_S = 0.5  # on stop, how long a reload still running is waited for (its validator is killed first)


class ReloadError(Exception):
    """The new config is not valid (or could not be read); the message names the key like check-config does."""


class Validator:
    """Runs `sparkwatch run … --print-settings` and builds the config it printed; `cancel()` kills a run in flight
    (SIGTERM during a reload must not wait for a validator stuck on a slow box)."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self.last_secrets: list[str] | None = None  # of the last good validation, for a restart in place

    def __call__(self) -> GuardConfig:
        with self._lock:
            if self._cancelled:
                raise ReloadError("stopping")
            try:
                proc = self._proc = subprocess.Popen(
                    self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
                )
            except OSError as exc:
                raise ReloadError(f"could not run the validator: {exc}") from None
        try:
            out, err = proc.communicate(timeout=VALIDATE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise ReloadError(f"the validator did not finish within {VALIDATE_TIMEOUT_S:.0f} s") from None
        finally:
            with self._lock:
                self._proc = None
        if self._cancelled:
            raise ReloadError("stopping")
        config, self.last_secrets = _parse_validated(proc.returncode, out, err)
        return config

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()


def _parse_validated(returncode: int, out: bytes, err: bytes) -> tuple[GuardConfig, list[str]]:
    if returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        message = lines[-1] if lines else f"validator exited with status {returncode}"
        raise ReloadError(message.removeprefix("sparkwatch: ").removeprefix("config error: "))
    try:
        data = json.loads(out)
        secrets = [str(s) for s in data.get("secrets") or []]
        remember_secrets(secrets)
        return GuardConfig.from_wire(data["wire"], data["public"]), secrets
    except (ValueError, KeyError, TypeError) as exc:
        raise ReloadError(f"validator output unusable: {exc}") from None


class GroupTeardowns:
    """The group watch's door (the verifier of GroupTeardownMsg): with group_teardown on, guard.groupwatch checks this
    node's members itself and submits those that pass to the guard's inbox. Its module (and core.kill.raygroup) is
    imported at the first group: a node without Ray never loads them."""

    def __init__(self, snapshot: SnapshotCell, submit: Callable[[KillRequest], None]) -> None:
        self.snapshot, self.submit = snapshot, submit
        self.watch: GroupWatch | None = None
        self.refused_off_total = 0  # teardowns refused because group_teardown is off

    def handle(self, msg: GroupTeardownMsg) -> None:
        """A group spanning nodes lost a member (telemetry's word, on the supervisor's thread)."""
        if not self.snapshot.current.config.group_teardown:
            self.refused_off_total += 1
            log.warning("group %s lost a member: group_teardown is off, its members here are left alone", msg.group)
            return
        if self.watch is None:
            from sparkwatch.guard.groupwatch import GroupWatch  # noqa: PLC0415

            self.watch = GroupWatch(self.snapshot, self.submit)
        self.watch.handle(msg)

    def counters(self) -> dict[str, int]:
        counters = self.watch.counters() if self.watch is not None else dict.fromkeys(GROUP_COUNTERS, 0)
        return {**counters, "refused_off": self.refused_off_total}


class GuardProcess:
    def __init__(
        self,
        config: GuardConfig,
        validate: Callable[[], GuardConfig] | None = None,
        *,
        log_handler: Any = None,
        telemetry: Callable[[int, bool], list[str]] | None = telemetry_command,
        restart: Callable[[], None] | None = None,
    ) -> None:
        """Built in one direction, each part given those before it (module docstring). `validate`: None, SIGHUP is
        ignored; `restart`: how to start afresh when over the RSS cap (None: exit 1, and systemd restarts)."""
        self.config, self.validate, self.restart = config, validate, restart
        self.spool, self.recording = _recording(config, log_handler)
        self.events, self.journal, self.router = self.recording.events, self.recording.journal, self.recording.router
        self.sd = ServiceNotifier(Notifier(backend="builtin"), self.status_line, poll_max_s=config.poll_max_s)
        inbox, cell, near, ledger = KillInbox(), SnapshotCell(config), threading.Event(), Ledger.of(config, self.events)
        self.groups = GroupTeardowns(cell, inbox.submit)
        launched = ledger.launched
        self.wedgewatch = WedgeWatch(cell, inbox.submit, declared=launched.declared, launchers=launched.launchers)
        self.supervisor = sup = TelemetrySupervisor(
            config,
            self.events,
            self.state,
            command=telemetry or telemetry_command,
            near_floor=near.is_set,
            on_over_cap=self._over_cap_seen,
            on_gpu_sample=inbox.wake,  # a near-budget engine's GPU bytes moved: its budget is looked at now
            verifiers={GroupTeardownMsg: self.groups.handle, WedgedMsg: self.wedgewatch.handle},
        )
        links = _links(self.sd, sup, near, self.request_publish)
        parts = PoolParts.of(config, self.events, links, ledger=ledger, inbox=inbox, cell=cell)
        self.recorder = _recorder(config, parts, sup)
        self.guard = PoolWatch(config, self.events, parts, links, self.recorder)
        self.events.subscribe(sup.forward)
        self.components = self._components(with_telemetry=telemetry is not None)
        self._over_cap_rss: int | None = None
        self._stop, self._reload, self._publish = threading.Event(), threading.Event(), threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # the main thread's wake-ups (_poke)
        self._reloading: threading.Thread | None = None
        self._state_path: Path | None = None  # guard.json (common.guardfile): written by the main thread only
        self._state_error_logged = False

    def _components(self, *, with_telemetry: bool) -> list[Component[GuardConfig]]:
        sd, guard = self.sd, self.guard
        components: list[Component[GuardConfig]] = [
            # Before the guard: it stops after the pool watch, so its last sample (marked `stopping`) is the last tick.
            Component("recorder", self.recorder, counters=self.recorder.counters),
            Component("guard", guard, PoolWatch.LIVE_KEYS, guard.reconfigure, guard.counters),
            Component(
                "sd_notify",
                sd,
                frozenset(),
                sd.reconfigure,
                lambda: {"notify_send_errors": sd.notifier.send_errors_total},
            ),
            Component("events", CountersOnly(), counters=self._event_counters),
            Component("groupwatch", CountersOnly(), counters=self.groups.counters),
            Component("wedgewatch", CountersOnly(), counters=self.wedgewatch.counters),
        ]
        if with_telemetry:
            components.append(Component("telemetry", self.supervisor, counters=self.supervisor.counters))
        return components

    def _event_counters(self) -> dict[str, int]:
        router = self.router
        return {
            **self.recording.counters(),
            "alert_spool_errors": self.spool.spool_errors_total if self.spool is not None else 0,
            "alerts_suppressed": router.suppressed_total if router is not None else 0,
            "router_errors": router.errors_total if router is not None else 0,
            "kernel_log_events_dropped": self.guard.kernel_log_dropped(),
        }

    # --- what the channel carries
    def counters(self) -> dict[str, dict[str, int]]:
        return {component.name: dict(component.counters()) for component in self.components}

    def state(self) -> StateMsg:
        return StateMsg(
            guard=self.guard.stats_snapshot(),
            kernlog=self.guard.kernel_log_snapshot(),
            counters=self.counters(),
            rss_bytes=rss_bytes(),
            watchdog_pings_total=self.sd.watchdog_pings_total,
            pid=os.getpid(),
        )

    # --- signals
    def request_stop(self) -> None:
        self._stop.set()
        self._poke()

    def request_reload(self) -> None:
        self._reload.set()
        self._poke()

    def request_publish(self) -> None:
        """Rewrite guard.json soon, on the main thread (safe from any thread: a flag and a pipe write)."""
        self._publish.set()
        self._poke()

    def _poke(self) -> None:
        """Wake the main thread (from a signal handler or another thread)."""
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the main thread has wake-ups enough waiting

    def wakeup_fd(self) -> int:
        """For signal.set_wakeup_fd: the C-level handler writes each signal's number here, on whatever thread. The main
        thread sleeps in select() on this pipe, never on a lock: a signal the kernel hands to another of our threads
        (it may: each one has the daemon's signals unblocked) wakes it, where a lock wait in the main thread slept
        through it. Seen: a SIGTERM right after a reload's validator ended left the daemon running, 1 run in 7-12."""
        return self._wake_w

    def _sleep_until_woken(self) -> None:
        select.select([self._wake_r], [], [])
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

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
            floor = g.config.floor
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
        """Validate the whole new config, then apply it: the guard process's components, then telemetry's."""
        if self.validate is None:
            log.warning("SIGHUP: this daemon was started without a config loader; nothing reloaded")
            return False
        notify = self.sd.notifier
        notify.notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        try:
            try:
                new = self.validate()
            except ReloadError as exc:
                if not self._stop.is_set():
                    log.error("reload: config error: %s; keeping the running config", exc)
                return False
            if self._stop.is_set():
                return False
            self._apply(new)
            self.request_publish()  # a new floor, dry run or budgets: readers see them
            return True
        finally:
            if not self._stop.is_set():
                notify.notify(f"READY=1\nSTATUS={self.status_line()}")

    def _apply(self, new: GuardConfig) -> None:
        old = self.config
        changes = describe_wire_changes(old.wire, new.wire, old.public, new.public)
        if not changes:
            log.info("reload: config unchanged")
            return
        applied, errors = apply_all(self.components, new, skip={"telemetry"})  # telemetry's answer comes below
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

    def _start_reload(self) -> None:
        if self._reloading is not None and self._reloading.is_alive():
            self._reload.set()  # one at a time: this SIGHUP is taken once the running reload is done
            return
        self._reloading = daemon_thread(self.reload, "sparkwatch-reload")
        self._reloading.start()

    # --- the published state
    def published_state(self) -> GuardState:
        c = self.config
        live = self.guard.launched.live()
        return GuardState(
            pid=os.getpid(),
            start_ticks=read_start_ticks("/proc", os.getpid()) or 0,
            uid=os.geteuid(),
            dry_run=c.dry_run,
            floor_bytes=c.floor,
            budget_rules=len(c.engine_budgets),
            declared_budgets=sum(1 for d in live if d.budget_bytes),
            taken=tuple(sorted(d.tree_key for d in live)),
            written_at=time.time(),
            kills=self.guard.launched.kill_words(),
        )

    def _write_state(self) -> None:
        """Publish guard.json in the runtime dir, else in the state dir; a failure is logged once, never fatal."""
        state = self.published_state()
        first = guardfile.guard_dir(os.environ, self.config.state_dir)
        for directory in dict.fromkeys((first, self.config.state_dir)):
            try:
                path = guardfile.write(directory, state)
            except OSError as exc:
                if not self._state_error_logged:
                    self._state_error_logged = True
                    log.warning(
                        "could not publish the guard's state in %s: %s (status and launch look there)",
                        directory,
                        exc.strerror or exc,
                    )
                continue
            if self._state_path is not None and self._state_path != path:
                guardfile.remove(self._state_path, state.pid)
            self._state_path = path
            return

    def _remove_state(self) -> None:
        if self._state_path is not None:
            guardfile.remove(self._state_path, os.getpid())
            self._state_path = None

    # --- run
    def _protect_self(self) -> None:
        """Lock our memory so the guard is not paged out under the very pressure it watches (earlyoom does too)."""
        syscalls.limit_malloc_arenas(2)  # before the threads start: one arena per thread costs RSS for nothing
        # Before mlockall: the kernel releases no locked page (madvise refuses VM_LOCKED), so a trim after it only
        # gives back the heap's top. Measured on the 2-core VM after the guard's imports: trim then lock 20.5 ->
        # 19.8 MiB RSS, lock then trim 20.5 -> 20.4.
        syscalls.trim_heap()
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

    def _over_cap_seen(self, rss: int) -> None:
        """The supervisor saw our RSS over its cap (in the state it just built): the main thread restarts us."""
        self._over_cap_rss = rss
        self._poke()

    def _over_cap(self, rss: int) -> None:
        reason = f"guard RSS {rss >> 20} MiB over its {self.supervisor.rss_cap_bytes >> 20} MiB cap"
        log.error("ERROR %s: restarting the guard process in place", reason)
        try:
            self.events.append(
                make_event(
                    EventKind.COMPONENT_RESTARTED,
                    f"the guard process restarted itself: {reason}",
                    {
                        "component": "guard",
                        "reason": reason,
                        "rss_bytes": rss,
                        "cap_bytes": self.supervisor.rss_cap_bytes,
                    },
                )
            )
        except OSError as exc:
            log.error("could not record component_restarted event: %s", exc)

    def run(self) -> int:
        self._protect_self()
        started = start_all(self.components, essential={"guard"})
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
        self._write_state()
        syscalls.trim_heap()  # hand back what importing and building everything left free
        # The main thread wakes for a signal (the wakeup fd, then its handler), the supervisor's word that we are
        # over the RSS cap, or a state to publish: it never polls.
        while not self._stop.is_set() and self._over_cap_rss is None:
            self._sleep_until_woken()
            if self._reload.is_set() and not self._stop.is_set():
                self._reload.clear()
                self._start_reload()
            if self._publish.is_set() and not self._stop.is_set():
                self._publish.clear()
                self._write_state()
        over = self._over_cap_rss
        self.sd.stopping()  # first, so systemd knows the exit that follows is wanted
        self._remove_state()  # no longer guarding: readers must not take this guard as running
        log.info("stopping")
        if isinstance(self.validate, Validator):
            self.validate.cancel()
        if self._reloading is not None:
            self._reloading.join(RELOAD_JOIN_S)
        if over is not None:
            self._over_cap(over)
        stop_all(started)
        if over is not None:
            if self.restart is not None:
                self.restart()  # does not return when it works
            return 1
        return 0


def _recording(config: GuardConfig, log_handler: Any) -> tuple[FileSpool | None, Recording]:
    # With a webhook, the guard spools its own alerts (kills, kernel-log events) before each event is written, so
    # a guard that dies between the event and the hand-over to telemetry loses none: telemetry's outbox finds the
    # file when it starts (common.spool).
    spool = FileSpool(config.state_dir / "outbox") if config.wire.get("webhook_url") else None
    # The journal and sd_notify through their own few lines (common.systemd), never systemd-python: libsystemd and
    # its Python modules were 1.0 MiB of this process's mlocked RSS (22.2 -> 21.1 MiB measured here).
    recording = open_recording(
        config.events_path,
        config.events_max_bytes,
        spool,
        log_handler,
        events_gid(config.events_group),
        journal_backend="builtin",
    )
    return spool, recording


def _recorder(config: GuardConfig, parts: PoolParts, sup: TelemetrySupervisor) -> FlightRecorder:
    """The flight recorder: fed by the pool watch's tick (no wake-up of its own), written on its own thread, with what
    the guard already knows (its last scan, telemetry's engine trees and GPU bytes); the next boot judges it."""
    return FlightRecorder(
        config.state_dir,
        config.recorder_window_s,
        config.proc_root,
        trees=parts.kills.last_scan,
        roots=lambda: sup.engine_roots,
        engines=lambda: sup.engines,
        gpu=sup.gpu.latest,
        launched=parts.ledger.launched.boot_phases,
    )


def _links(
    sd: ServiceNotifier, sup: TelemetrySupervisor, near: threading.Event, on_taken: Callable[[], None]
) -> GuardLinks:
    """What the pool watch reads of the process around it."""
    gpu = sup.gpu
    return GuardLinks(
        heartbeat=sd.beat,
        # From telemetry's last cycle, over the channel: NVML's GPU holders and per-pid GPU bytes (the guard never
        # loads NVML itself; a stale or missing reading never delays a kill: the policy ranks without it).
        gpu_bytes_by_pid=gpu.latest,
        gpu_holders=gpu.holder_keys,
        on_news=sup.wake,  # the first sample, and each entry into the floor's band
        engines_hint=lambda: sup.engines,  # a new engine tree: budgets look at once
        on_taken=on_taken,  # the launched engines it guards changed: guard.json says so
        peer_budgets=sup.peer_budgets,  # this node's Ray ranks' budgets from another's launch
        containers=sup.containers,  # containers' names and io.sparkwatch.* labels (telemetry)
        near_floor=near,  # the supervisor sends the state four times a second near the floor
    )


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
    values, cli_args = parse_daemon_argv(
        sys.argv[1:] if argv is None else argv,
        usage="sparkwatch-guard --settings-fd N -- [sparkwatch run arguments]",
        numbers=("--settings-fd",),
        required=("--settings-fd",),
    )
    syscalls.set_comm("sparkwatch")
    handler = logs.setup("guard")
    try:
        data = read_settings_fd(values["--settings-fd"])
        remember_secrets(data.get("secrets") or [])  # before any line is logged: the log redacts them
        config = GuardConfig.from_wire(data["wire"], data["public"])
    except (OSError, ValueError, KeyError) as exc:
        log.error("config error: cannot read the validated settings: %s", exc)
        return 2
    validator = Validator([sys.executable, "-m", "sparkwatch", *cli_args, "--print-settings"])

    def restart() -> None:
        current = process.config
        secrets = validator.last_secrets if validator.last_secrets is not None else data.get("secrets")
        exec_guard({"wire": dict(current.wire), "public": dict(current.public), "secrets": secrets}, cli_args)

    process = GuardProcess(config, validator, log_handler=handler, restart=restart)
    signal.set_wakeup_fd(process.wakeup_fd(), warn_on_full_buffer=False)
    target.append(process)
    for signum in pending:
        process.on_signal(signum, None)
    return process.run()
