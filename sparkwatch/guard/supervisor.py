"""The guard process's supervision of the telemetry process: spawn it, talk to it, restart it with backoff.

One thread. It spawns `python -m sparkwatch.telemetry --channel-fd N` (without site: guard/start.telemetry_argv)
with its end of a socketpair, sends it the validated config, then loops once per tick: send the guard's state when it
changed (never blocking), forward the guard's events, and read what telemetry says (per-pid GPU bytes and holders into
`gpu`, engine and compile-job counts for STATUS=, reload replies), a bounded amount of it (common.channel).

Near the floor it looks every STATE_FAST_S and sends the state each time (the exporter's counters lag a kill by at
most that). Far from it, it sleeps until telemetry sends, an event is to be forwarded, or a heartbeat is due every
HEARTBEAT_S, and sends the state when a counter changed or as that heartbeat: on this VM a wake-up of a Python thread
costs 0.2-1 ms of CPU, so an idle guard's cost is its wake-ups (bench/RESULTS-idle.md).

Telemetry is killed and started again, with a `component_restarted` event and a backoff that doubles from 1 s to
60 s (and resets once a run lasted 60 s), when it exits, when it sends nothing valid for `stall_after_s` (a hung
NVML load holds its GIL), or when it floods the channel (every receive for `stall_after_s` left datagrams behind):
the checks run on the supervisor's own clock, whatever the traffic. Nothing here is on the pool watch's thread.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from sparkwatch.common import logs
from sparkwatch.common.channel import Channel, ChannelClosed, socketpair
from sparkwatch.common.eventlog import EventLog, EventLogError, make_event
from sparkwatch.common.guardconfig import GuardConfig
from sparkwatch.common.lifecycle import Backoff, run_with_restarts
from sparkwatch.common.messages import (
    PEER_BUDGET_TTL_S,
    AckMsg,
    AppliedMsg,
    ContainersMsg,
    EventMsg,
    GpuSampleMsg,
    Message,
    PeerBudgetMsg,
    SettingsMsg,
    StateMsg,
    TelMsg,
)
from sparkwatch.common.selfwatch import GUARD_RSS_CAP_BYTES
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.container import NO_NOTES, ContainerNote, ContainerNotes
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import Event
from sparkwatch.guard.gpuboard import GpuBoard
from sparkwatch.guard.start import telemetry_argv

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTHY_RUN_S = 60.0  # a run this long resets the backoff
STOP_GRACE_S = 5.0
NVML_OFF_AFTER_STALLS = 2
MAX_UNACKED_EVENTS = 256
RELOAD_RESEND_S = 2.0  # a reload telemetry has not acknowledged is sent again this often
STATE_FAST_S = 0.25  # near the floor: the exporter's counters lag the guard by at most this
HEARTBEAT_S = 3.0  # an unchanged state is still sent this often: the exported loop age stays under the 10 s alert
MIN_WAIT_S = 0.05
log = logs.get("supervisor")


def telemetry_command(fd: int, nvml: bool = True) -> list[str]:
    args = ["--channel-fd", str(fd), "--guard-pid", str(os.getpid())]
    return telemetry_argv(args if nvml else [*args, "--no-nvml"], os.environ)


def telemetry_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The telemetry process's environment: ours, with CPython's small-object allocator off (unless the user chose
    one). Under 1,000 processes a minute its pymalloc arenas and glibc heap kept growing slowly (bench/RESULTS-soak.md)
    while its live Python objects did not (tracemalloc); with every object in glibc's heap the once-a-minute
    malloc_trim (telemetry/loop.py) hands back free pages wherever they are. The guard keeps pymalloc: it allocates
    little, and its memory is locked."""
    env = dict(environ)
    env.setdefault("PYTHONMALLOC", "malloc")
    return env


# Telemetry's main thread answers every 0.25-1 s whatever its cycle does; only a process-wide stop (a C call holding
# the GIL, such as a dlopen of a hung libnvidia-ml) or a reload waiting behind a slow cycle silences it.
STALL_MIN_S = 15.0
# Before its first message telemetry imports prometheus_client and pynvml and checks that NVML loads (up to
# 10 s, telemetry/sources/nvml_preflight.py): allow that much more, on a loaded box.
STARTUP_ALLOWANCE_S = 60.0


def unchanging(state: StateMsg) -> StateMsg:
    """The state without what moves every tick: two states with the same `unchanging` say the same thing. That the
    loop has run (and read meminfo) at all is a change: the first tick's state goes out at once."""
    ran = 1.0 if state.guard.last_loop_monotonic else 0.0
    guard = replace(state.guard, mem=None, fill_rate_bytes_per_s=0.0, poll_interval_s=0.0, last_loop_monotonic=ran)
    return replace(state, guard=guard, rss_bytes=state.rss_bytes >> 20)


def stall_after_s(config: GuardConfig) -> float:
    """Silence from telemetry this long means it is stuck: ten cycles, and never under STALL_MIN_S."""
    return max(STALL_MIN_S, 10 * config.telemetry_interval_s)


class TelemetrySupervisor:
    """A component of the guard process. `state()` builds the state to send, `near_floor()` picks the tick; `gpu`
    holds what telemetry reports about the GPU."""

    name = "telemetry"
    live_keys: frozenset[str] = frozenset()  # telemetry answers for its own keys over the channel

    def __init__(
        self,
        config: GuardConfig,
        events: EventLog,
        state: Callable[[], StateMsg],
        *,
        command: Callable[[int, bool], list[str]] = telemetry_command,
        near_floor: Callable[[], bool] = lambda: False,
        on_over_cap: Callable[[int], None] | None = None,
        on_gpu_sample: Callable[[], None] = lambda: None,
        verifiers: Mapping[type[Message], Callable[[Any], object]] | None = None,
    ) -> None:
        """`on_gpu_sample`: wakes the pool watch when a fast GPU sample of a near-budget engine came (guard.budgets).
        `verifiers`: the one table from each kill-asking message type (common.messages.KILL_ASKS: a group that lost a
        member, a wedged engine) to the guard's verifier of it (guard.groupwatch, guard.wedgewatch), which checks it
        itself and hands what passes to the guard's inbox. A new telemetry trigger is one row here, no branch."""
        self.config = config
        self.events = events
        self.state = state
        self.near_floor = near_floor
        self.command = command
        self.gpu = GpuBoard(on_sample=on_gpu_sample)
        self.engines: int | None = None
        self.compile_jobs: int | None = None
        self.engine_roots: tuple[tuple[str, int], ...] | None = None  # telemetry's engine trees (kind, root pid)
        # The last PeerBudgetMsg's budgets, {(pid, start ticks): (uid, bytes)}, and when it came (monotonic)
        self._peer_budgets: tuple[float, dict[tuple[int, int], tuple[int, int]]] = (0.0, {})
        # Telemetry's last word on the containers (names, io.sparkwatch.* labels), replaced whole when it changes and
        # kept across a telemetry restart: a container's labels never change, and its id is never reused.
        self._container_notes: tuple[ContainerNote, ...] = ()
        self._containers: ContainerNotes = NO_NOTES
        self.restarts_total = 0
        self.stalls_total = 0
        self.floods_total = 0
        self.consecutive_stalls = 0
        self.nvml = True  # off once telemetry hung NVML_OFF_AFTER_STALLS times in a row, until sparkwatch restarts
        self.channel: Channel | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.last_heard_monotonic: float | None = None
        self.states_sent_total = 0
        self._pending: deque[Event] = deque(maxlen=MAX_UNACKED_EVENTS)  # not yet sent (telemetry may be down)
        # Sent but not yet acknowledged (telemetry acks once its outbox has the alert): resent to the next telemetry
        # process if this one dies first, so a kill's alert survives a telemetry crash (delivery is at least once).
        self._unacked: OrderedDict[str, Event] = OrderedDict()
        self._reply: AppliedMsg | None = None
        self._replied = threading.Event()
        self._waiting_reply = False
        self._settings_dirty = False  # a reload telemetry has not acknowledged yet
        self._settings_sent_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dropped_before = 0
        self._bad_before = 0
        self._last_state: StateMsg | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # The guard process's RSS cap, checked on the state each look builds (its RSS is in it already).
        self.rss_cap_bytes = GUARD_RSS_CAP_BYTES
        self.on_over_cap = on_over_cap
        self.verifiers: Mapping[type[Message], Callable[[Any], object]] = dict(verifiers or {})
        self._last_state_at = 0.0

    # --- component interface
    def start(self) -> None:
        self._thread = daemon_thread(self._run, "sparkwatch-supervisor")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.wake()
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
        self.wake()
        try:
            if not self._replied.wait(timeout_s):
                return None
        finally:
            self._waiting_reply = False
        reply = self._reply or AppliedMsg()
        for error in reply.errors:
            log.error("reload: telemetry: %s", error)
        return frozenset(reply.keys)

    def forward(self, event: Event) -> None:
        """An EventLog listener: queue the event for telemetry's outbox. Never blocks (on the reaper thread)."""
        self._pending.append(event)
        self.wake()

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
            "telemetry_floods": self.floods_total,
            "channel_dropped": self.channel_dropped_total,
            "channel_bad": self.channel_bad_total,
        }

    # --- the thread
    def _run(self) -> None:
        run_with_restarts(
            self._run_once, self._stop, Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S, HEALTHY_RUN_S), self._restarting
        )

    def _restarting(self, reason: str, backoff_s: float) -> None:
        self.restarts_total += 1
        log.error("telemetry process %s; restarting it in %.0f s (the guard keeps running)", reason, backoff_s)
        self._record_restart(reason, backoff_s)

    def _spawn(self) -> tuple[Channel, subprocess.Popen[bytes]]:
        ours, theirs = socketpair()
        try:
            proc = subprocess.Popen(
                self.command(theirs.fileno(), self.nvml),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                env=telemetry_env(os.environ),
            )
        finally:
            theirs.close()
        return Channel(ours), proc

    def _run_once(self) -> str | None:
        """One telemetry process, from spawn to its end: why it ended (None when we are stopping)."""
        channel, proc = self._spawn()
        self.channel, self.proc = channel, proc
        self._requeue_unacked()
        spawned = time.monotonic()
        self.last_heard_monotonic = None
        self.engines = self.compile_jobs = self.engine_roots = None
        self._last_state = None
        flooding_since: float | None = None
        with self._lock:
            config = self.config
            self._settings_dirty = False
        channel.send(SettingsMsg(dict(config.wire), dict(config.public), reload=False))
        try:
            while not self._stop.is_set():
                self._send_state(channel)
                self._flush_events(channel)
                self._resend_settings(channel)
                wait_s = self._wait_s()
                tick_ends = time.monotonic() + wait_s
                for msg in channel.receive(wait_s, wake_fd=self._wake_r):
                    self.last_heard_monotonic = time.monotonic()
                    self.consecutive_stalls = 0
                    self._handle(msg)
                if channel.saturated:  # the rest waits in the kernel's buffer: one receive's worth a tick, no more
                    self._stop.wait(max(0.0, tick_ends - time.monotonic()))
                if proc.poll() is not None:
                    return f"exited with status {proc.returncode}"
                now = time.monotonic()
                flooding_since = (flooding_since or now) if channel.saturated else None
                why = self._misbehaving(spawned, now, flooding_since)
                if why is not None:
                    proc.kill()  # a process stuck in a C call (a hung dlopen) does not answer SIGTERM
                    proc.wait(STOP_GRACE_S)
                    return why
            return None
        except ChannelClosed as exc:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_GRACE_S)
            return f"closed the channel ({exc}), exit status {proc.returncode}"
        finally:
            self.engines = self.compile_jobs = self.engine_roots = None
            self._dropped_before += channel.dropped_total
            self._bad_before += channel.bad_total
            self.channel = None
            channel.close()  # one socket per telemetry process: never leak one per restart

    def _wait_s(self) -> float:
        """How long to wait for telemetry before the next look: STATE_FAST_S near the floor; else until the next
        heartbeat (or reload resend) is due. A forwarded event, a reload and the pool watch reaching the floor's band
        wake the wait at once (`wake`)."""
        if self.near_floor():
            return STATE_FAST_S
        due = self._last_state_at + HEARTBEAT_S
        with self._lock:
            if self._settings_dirty:
                due = min(due, self._settings_sent_at + RELOAD_RESEND_S)
        return min(HEARTBEAT_S, max(MIN_WAIT_S, due - time.monotonic()))

    def wake(self) -> None:
        """Make the supervisor look now (from any thread, never blocking)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full: a wake-up is already pending
            pass

    def _misbehaving(self, spawned: float, now: float, flooding_since: float | None) -> str | None:
        """Why this telemetry process must be killed now, or None: silent too long, or flooding too long."""
        limit_s = stall_after_s(self.config)
        if flooding_since is not None and now - flooding_since > limit_s:
            self.floods_total += 1
            self.stalls_total += 1  # a telemetry process stuck in a loop is as stalled as a silent one
            return f"flooded the channel for {now - flooding_since:.0f} s (stuck in a loop; killed)"
        heard = self.last_heard_monotonic
        silent_s = now - (spawned if heard is None else heard)
        if silent_s <= (STARTUP_ALLOWANCE_S if heard is None else limit_s):
            return None
        self.stalls_total += 1
        self.consecutive_stalls += 1
        if self.consecutive_stalls >= NVML_OFF_AFTER_STALLS and self.nvml:
            self.nvml = False  # the usual culprit: a dlopen or init of libnvidia-ml that never returns
            log.error("telemetry hung %d times in a row: restarting it without NVML", self.consecutive_stalls)
        return f"sent nothing for {silent_s:.0f} s (stuck; killed)"

    def _send_state(self, channel: Channel) -> None:
        """The guard's state when it changed, or every HEARTBEAT_S. The readings that move every tick (MemAvailable, the
        fill rate, the loop's clock, RSS by the page) are not a change: far from the floor an idle guard sends one
        datagram every HEARTBEAT_S, and a counter that moves (a kill, an error) goes out at the next tick. Near the
        floor every tick sends."""
        state = self.state()
        if state.rss_bytes > self.rss_cap_bytes and self.on_over_cap is not None:
            self.on_over_cap(state.rss_bytes)
        key = unchanging(state)
        now = time.monotonic()
        if key == self._last_state and now - self._last_state_at < HEARTBEAT_S and not self.near_floor():
            return
        if channel.send(state):
            self._last_state, self._last_state_at = key, now
            self.states_sent_total += 1

    def _resend_settings(self, channel: Channel) -> None:
        # A reload is sent until telemetry answers `applied`, again every RELOAD_RESEND_S: a message refused by a full
        # channel, or lost while telemetry was starting, is never the end of it (applying twice changes nothing).
        now = time.monotonic()
        with self._lock:
            config = self.config
            due = self._settings_dirty and now >= self._settings_sent_at + RELOAD_RESEND_S
            if due:
                self._settings_sent_at = now
        if due:
            channel.send(SettingsMsg(dict(config.wire), dict(config.public), reload=True))

    def _flush_events(self, channel: Channel) -> None:
        while self._pending:
            event = self._pending[0]
            if not channel.send(EventMsg(event)):
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

    def _handle(self, msg: Message) -> None:
        verify = self.verifiers.get(type(msg))
        if verify is not None:  # a kill request (KILL_ASKS): its verifier checks it on this thread
            verify(msg)
        elif isinstance(msg, TelMsg):
            self.engines, self.compile_jobs = msg.engines, msg.compile_jobs
            self.engine_roots = msg.engine_roots if msg.engines is not None else None
            self.gpu.update(msg)
        elif isinstance(msg, GpuSampleMsg):
            self.gpu.update_fast(msg)
        elif isinstance(msg, PeerBudgetMsg):
            budgets = {(pid, ticks): (uid, size) for pid, ticks, uid, size, _group in msg.budgets if size > 0}
            self._peer_budgets = (time.monotonic(), budgets)
        elif isinstance(msg, ContainersMsg):
            if msg.containers != self._container_notes:  # a resend changes nothing: the budgets' discovery stays put
                self._container_notes = msg.containers
                self._containers = ContainerNotes.of(msg.containers)
        elif isinstance(msg, AckMsg):
            for event_id in msg.ids:
                self._unacked.pop(event_id, None)
        elif isinstance(msg, AppliedMsg):
            with self._lock:
                self._settings_dirty = False  # telemetry has the new settings: stop resending them
            if self._waiting_reply:
                self._reply = msg
                self._replied.set()
            else:  # the reload's wait ran out first: say what telemetry applied when it does
                log.info("reload: telemetry answered late (after the reload's wait)")
                log.info("reload: telemetry applied %s", ", ".join(msg.keys) or "nothing")
                for error in msg.errors:
                    log.error("reload: telemetry: %s", error)
        # a guard → telemetry kind coming back is a confused peer: ignored

    def peer_budgets(self) -> Mapping[tuple[int, int], tuple[int, int]]:
        """The budgets another node's launch gave this node's Ray ranks, as telemetry last sent them (a reference
        read); nothing once PEER_BUDGET_TTL_S passed without a word (telemetry down, or the group gone)."""
        at, budgets = self._peer_budgets
        if not budgets:  # nearly always: no clock read on the guard's tick
            return budgets
        return budgets if time.monotonic() - at <= PEER_BUDGET_TTL_S else {}

    def containers(self) -> ContainerNotes:
        """What telemetry last said of the containers (a reference read, on the guard's tick)."""
        return self._containers

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
