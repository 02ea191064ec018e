"""The guard loop: the most important code in sparkwatch.

It reads /proc/meminfo through a kept-open fd, feeds core.guard.step, and on a trigger scans for engine trees, ranks
them (core.policy), re-reads MemAvailable and hands the first victim's tree to the killer, all in its own thread.
One tree per firing: core.guard says when the next one may die (after the reap and a settle time, or at once when
another tree is itself growing). It never waits on NVML, HTTP, disk sync or a webhook: the record of
a kill is written by the Reaper thread. Between samples it sleeps in poll(2) on a PSI memory trigger (where the kernel
lets us create one) and a wake-up pipe, so pressure or shutdown wake it early.
"""

from __future__ import annotations

import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.events import EventLog, EventLogError, make_event
from sparkwatch.common.guardconfig import GuardConfig, GuardSettings, engine_rules, engine_scope
from sparkwatch.common.sources.kmsg import KmsgSource
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.common.stats import GuardStats
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core import budget as core_budget
from sparkwatch.core import policy
from sparkwatch.core import trigger as core
from sparkwatch.core.engines import find_engine_trees
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.footprint import Footprint
from sparkwatch.core.killloop import LOOP_WINDOW_S, LoopState, loop_identity, note_kill
from sparkwatch.core.killrecord import KillFacts, kill_fields, kill_line, kill_summary, terminal_note, victims_of
from sparkwatch.core.model import EngineTree, MemInfo
from sparkwatch.core.units import format_size
from sparkwatch.guard.budgets import BudgetWatch, Tracked
from sparkwatch.guard.gpuboard import device_check, verified_holders
from sparkwatch.guard.kernlog import KernelLogWatch
from sparkwatch.guard.killer import Killer, KillJob, Reaper
from sparkwatch.guard.launchwatch import LaunchedEngines
from sparkwatch.guard.recorder import FlightRecorder, Tick
from sparkwatch.guard.ttynote import tell_terminal

# A PSI trigger: wake when tasks stalled on memory for 150 ms within a 2 s window (2 s is the smallest window an
# unprivileged process may use). Without swap PSI reacts late, so this only ever shortens a sleep.
PSI_TRIGGER = b"some 150000 2000000\0"
# Near the floor (within warn_headroom, or under WARM_SCAN_HORIZON_S from it at the current fill rate) the scout
# thread rescans /proc at most this often, so the scan on the kill path finds argv already cached.
WARM_SCAN_EVERY_S = 1.0
WARM_SCAN_HORIZON_S = 10.0
# The ranking shown in a kill event: the first trees in kill order (a box runs a handful of engines).
RANKING_IN_EVENT = 8

# Per-pid GPU bytes, injected: `() -> (monotonic time of the reading, pid -> bytes) | None`. The guard process wires
# the GpuBoard that telemetry's `tel` messages fill (guard.gpuboard); it returns at once and never calls NVML.
GpuBytesSource = Callable[[], policy.GpuBytes | None]


def _params(settings: GuardSettings) -> core.GuardParams:
    return core.GuardParams(
        floor_bytes=settings.floor,
        kill_budget_s=settings.kill_budget_s,
        debounce_samples=settings.debounce_samples,
        poll_min_s=settings.poll_min_s,
        poll_max_s=settings.poll_max_s,
        rearm_headroom_bytes=settings.rearm_headroom,
        settle_s=settings.kill_settle_s,
    )


def policy_params(settings: GuardSettings) -> policy.PolicyParams:
    return policy.PolicyParams.build(settings.kill_order, settings.kill_priority, settings.never_kill)


def budget_params(settings: GuardSettings) -> core_budget.BudgetParams:
    return core_budget.BudgetParams(
        debounce_samples=settings.debounce_samples, poll_min_s=settings.poll_min_s, poll_max_s=settings.poll_max_s
    )


log = logs.get("guard")


class PoolWatch:
    def __init__(
        self,
        settings: GuardSettings,
        events: EventLog,
        heartbeat: Callable[[float], None] | None = None,
        gpu_bytes_by_pid: GpuBytesSource | None = None,
    ) -> None:
        self.settings = settings
        self.events = events
        self.heartbeat = heartbeat
        # Settable after construction: the guard process wires the GpuBoard once its supervisor exists.
        self.gpu_bytes_by_pid = gpu_bytes_by_pid
        self.params = _params(settings)
        self.policy = policy_params(settings)
        self.history = policy.GrowthHistory()  # replaced whole by the scout and the kill path (atomic reference swap)
        self.loops = LoopState()
        # Victims signalled and not yet reaped: tree -> (teardown deadline, this thread's own dups of their pidfds; the
        # reaper closes its own). Past the deadline a victim counts as stuck (D state) and is no longer waited for.
        self._outstanding: dict[policy.TreeKey, tuple[float, list[int]]] = {}
        # Trees killed (or, in dry-run, chosen) in this episode: never chosen twice.
        self._episode_victims: set[policy.TreeKey] = set()
        self._hunt_recorded = False  # one no_victim event per stretch of hunting, not one per look
        self.rules = engine_rules(settings)
        self.scope = engine_scope(settings)
        self.stats = GuardStats()
        # (pid, start_ticks) of the processes NVML lists as GPU holders, from telemetry (a reference read, no I/O):
        # with `guard_gpu_holders`, those that match no rule are engines too, once fire() confirmed them itself
        # (guard.gpuboard.verified_holders). The guard process wires it; the guard never loads NVML itself.
        self.gpu_holders: Callable[[], Collection[tuple[int, int]]] = lambda: ()
        self._holds_gpu = device_check(str(settings.proc_root))
        self.lock = threading.Lock()
        self.state = core.GuardState()
        # Everything the kill path needs exists before the first poll: fds open, threads started, code imported.
        self.meminfo = MeminfoReader(settings.proc_root)
        self.scanner = ProcScanner(settings.proc_root)
        self.killer = Killer(settings.proc_root, self.rules, self.scope)
        # The reaper waits as long as the longest teardown the policy allows (a GB10 engine holding 77 GiB: ~10 s).
        self.reaper = Reaper(
            settings.proc_root,
            self._announce,
            self._finish,
            wait_s=core.TEARDOWN_MAX_S,
            settle_s=settings.kill_settle_s,
        )
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        self._psi_fd = self._open_psi_trigger(settings.proc_root)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error_logged = 0.0
        # The scout warms the scanner's argv cache near the floor, on its own thread: reading /proc/<pid>/cmdline
        # takes the target's mmap lock and can block while an engine maps memory; the guard loop must not wait.
        self._warm = threading.Event()
        self._scout: threading.Thread | None = None
        self.warm_scans_total = 0
        self.near_floor = False
        # Called (on this thread; it must not block) when telemetry should hear from the guard at once: the first
        # sample, and each entry into the floor's band.
        self.on_news: Callable[[], None] | None = None
        self.ticks = 0
        # The flight recorder (guard.recorder), offered each tick's reading; its own thread writes. The guard process
        # wires it. `seen_trees`: the trees of the guard's last own scan (monotonic time, trees), a reference swap.
        self.recorder: FlightRecorder | None = None
        self.seen_trees: tuple[float, tuple[EngineTree, ...]] | None = None
        # NVRM/Xid lines from /dev/kmsg, read non-blocking each tick: see _kernel_log.
        self.kernlog = KernelLogWatch(
            events,
            settings.proc_root,
            lambda: (self.rules, self.scope),
            enabled=settings.kernel_log_corroboration,
            accept_injected=settings.kernel_log_accept_injected,
            source=KmsgSource(settings.kernel_log_path),
        )
        # Engines declared by `sparkwatch launch` (guard.launchwatch) and per-engine budgets (guard.budgets): both on
        # this thread's tick; with nothing declared and no budget configured they cost one stat per directory.
        self.launched = LaunchedEngines.for_settings(settings.state_dir, settings.proc_root, self._record)
        self.budget_errors_total = 0  # a budget look that raised: the floor loop went on (counted, said once a minute)
        self._last_budget_error_logged = -math.inf
        self.budgets = BudgetWatch(str(settings.proc_root), self.scanner, self._budget_kill, self._record)
        self.budget_params = budget_params(settings)
        self.engine_budgets = policy.parse_engine_budgets(settings.engine_budgets)
        self._budget_victims: dict[policy.TreeKey, float] = {}  # killed for their budget -> teardown deadline
        # Telemetry's count of engine trees (a reference read): a change starts a budget discovery at once.
        self.engines_hint: Callable[[], int | None] = lambda: None
        # Called (on this thread; it must not block) when the set of launched engines the guard took changed, or it
        # killed one of them: the guard process republishes its state (common.guardstate) on its main thread.
        self.on_taken: Callable[[], None] | None = None
        self._taken: frozenset[policy.TreeKey] = frozenset()
        self._last_mem: MemInfo | None = None

    # Settings applied on SIGHUP without a restart: those GuardConfig marks LIVE (the one declaration).
    LIVE_KEYS = GuardConfig.live_keys()

    def reconfigure(self, settings: GuardSettings) -> frozenset[str]:
        """Apply new settings live (SIGHUP). Returns the keys the guard applies. Thread-safe: the guard thread reads
        params, rules and the killer's settings once per tick, and each is swapped whole under the lock."""
        params = _params(settings)
        pparams = policy_params(settings)
        rules = engine_rules(settings)
        scope = engine_scope(settings)
        bparams = budget_params(settings)
        budgets = policy.parse_engine_budgets(settings.engine_budgets)
        with self.lock:
            self.settings = settings
            self.params = params
            self.policy = pparams
            self.budget_params = bparams
            self.engine_budgets = budgets
            self.reaper.settle_s = settings.kill_settle_s
            self.rules = rules
            self.scope = scope
            self.killer.rules = rules
            self.killer.scope = scope
            self.kernlog.enabled = settings.kernel_log_corroboration
            self.kernlog.accept_injected = settings.kernel_log_accept_injected
        self._wake()  # a new floor or poll interval takes effect now, not after the current sleep
        return self.LIVE_KEYS

    # --- lifecycle
    def start(self) -> None:
        self.reaper.start()
        self.kernlog.start()
        self.launched.start()
        self._scout = daemon_thread(self._scout_run, "sparkwatch-scout")
        self._scout.start()
        self._thread = daemon_thread(self.run, "sparkwatch-guard")
        self._thread.start()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        self._warm.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._scout is not None:
            self._scout.join(1)  # a scout stuck in a /proc read is a daemon thread: never wait on it long
        self.launched.stop()
        self.kernlog.stop()
        self.reaper.stop()

    def _open_psi_trigger(self, proc_root: Path) -> int | None:
        try:
            fd = os.open(proc_root / "pressure" / "memory", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            os.write(fd, PSI_TRIGGER)
        except OSError:
            os.close(fd)
            return None
        self._poller.register(fd, select.POLLPRI)
        self.stats.psi_trigger = True
        return fd

    # --- the loop
    def run(self) -> None:
        interval = self.params.poll_min_s
        while not self._stop.is_set():
            interval = self.tick()
            self._sleep(interval)

    def tick(self) -> float:
        """One look at meminfo, and a kill if due. Returns the seconds to sleep."""
        now = time.monotonic()
        try:
            mem = self.meminfo.read()
        except MeminfoError as exc:
            # A parse error is never a reason to kill: report it, keep the last good state, look again soon.
            with self.lock:
                self.stats.meminfo_errors_total += 1
                self.stats.last_error = str(exc)
                self.stats.last_loop_monotonic = now
            if now - self._last_error_logged > 60:
                self._last_error_logged = now
                log.error("ERROR %s", exc)
            self._beat(now)
            return self.params.poll_min_s * 4
        self._check_reaped(now)
        self.state, decision = core.step(self.state, self.params, now, mem.available_bytes)
        if decision.rearmed:
            self._episode_victims.clear()
            self._hunt_recorded = False
            line = f"sparkwatch: re-armed: MemAvailable {format_size(mem.available_bytes)}"
            self.reaper.call(lambda: log.info(line))  # after any KILL line already handed to the reaper
        if decision.trigger is not None:
            self.fire(decision.trigger, mem, now, growing_only=decision.growing_only)
        self._last_mem = mem
        wake = self._engines_tick(now, mem)
        with self.lock:
            self.stats.mem = mem
            self.stats.fill_rate_bytes_per_s = self.state.fill_rate_bytes_per_s
            self.stats.poll_interval_s = decision.next_interval_s
            self.stats.armed = self.state.armed
            self.stats.phase = str(self.state.phase)
            self.stats.last_loop_monotonic = now
        near = self._near_floor(mem.available_bytes, decision)
        first = self.ticks == 0
        self.ticks += 1
        if (first or (near and not self.near_floor)) and self.on_news is not None:
            self.on_news()  # the supervisor tells telemetry now (a pipe write), not at its next heartbeat
        self.near_floor = near  # read by the supervisor: state goes to telemetry four times a second near the floor
        if decision.trigger is None and not self._kernel_log(now, mem) and near:
            self._warm.set()  # the scout rescans (at most once a second); this thread never waits for it
        recorder = self.recorder
        if recorder is not None:  # a queue put at most, never a write: the recorder's thread writes
            recorder.offer(
                Tick(
                    now,
                    time.time(),
                    mem,
                    self.state.fill_rate_bytes_per_s,
                    decision.next_interval_s,
                    near,
                    str(self.state.phase),
                    sum(self.stats.kills_total.values()),
                )
            )
        self._beat(now)
        return decision.next_interval_s if wake is None else min(decision.next_interval_s, max(wake, 0.0))

    def _engines_tick(self, now: float, mem: MemInfo) -> float | None:
        """Launched engines' declarations and per-engine budgets: the seconds until a budget wants a look (None: no
        budget anywhere). Never raises: a budget is a refinement; the floor stays the last line."""
        try:  # the declarations are read on their own thread (guard.launchwatch): here only its last result
            self._note_taken()
            with self.lock:
                rules, scope, bparams, budgets = self.rules, self.scope, self.budget_params, self.engine_budgets
            live = self.launched.live()
            wake = self.budgets.tick(
                now,
                mem.available_bytes,
                rules=rules,
                scope=scope,
                params=bparams,
                config_budgets=budgets,
                launched=live,
                gpu=self._gpu() if self.budgets.active(budgets, live) else None,
                engines_hint=self.engines_hint(),
            )
        except Exception as exc:  # never let a budget stop the floor loop
            self.budget_errors_total += 1
            if now - self._last_budget_error_logged > 60:  # counted every time, said once a minute
                self._last_budget_error_logged = now
                log.warning("budgets: %r", exc)
            return None
        if wake is not None or self.stats.budgets:
            with self.lock:
                self.stats.budgets = self.budgets.stats()
        if self._budget_victims:
            self._budget_victims = {k: d for k, d in self._budget_victims.items() if d > now}
        return wake

    def _note_taken(self) -> None:
        declared = self.launched.declared()
        if declared.keys() != self._taken:  # a handful of keys compared: no allocation unless they changed
            self._taken = frozenset(declared)
            if self.on_taken is not None:
                self.on_taken()

    def _budget_kill(self, tracked: Tracked, fp: Footprint) -> None:
        """Kill one tree over its budget, alone, whatever the pool; recorded like every kill (trigger `budget`)."""
        with self.lock:
            settings, params = self.settings, self.params
        mem = self._last_mem
        if mem is None:
            return
        detected_at = time.monotonic()
        tree = tracked.tree
        victims, signaled_at, notes, method = self.killer.kill([tree], dry_run=settings.dry_run)
        facts = KillFacts(
            trigger="budget",
            mem=mem,
            floor_bytes=params.floor_bytes,
            fill_rate_bytes_per_s=self.state.fill_rate_bytes_per_s,
            dry_run=settings.dry_run,
            trees=(tree,),
            victims=victims_of([tree]) if settings.dry_run else tuple((v.proc, v.engine) for v in victims),
            method=method,
            victim_rss_bytes=tree.rss_bytes,
            victim_gpu_bytes=fp.gpu_bytes,
            why_this_tree=(f"over its budget {format_size(tracked.budget_bytes)} ({tracked.source})",),
            budget_bytes=tracked.budget_bytes,
            footprint_bytes=fp.bytes,
            footprint_source=str(fp.source),
            budget_source=tracked.source,
        )
        self._budget_victims[tracked.key] = detected_at + core.teardown_deadline_s(fp.bytes)
        told = self._note_kill(tracked.key, tree, facts)
        with self.lock:
            self.stats.count_kill("budget", settings.dry_run, len(victims), time.time())
        self.reaper.submit(KillJob(facts, victims, detected_at, signaled_at, mem.available_bytes, notes, told))

    def _note_kill(self, key: policy.TreeKey, tree: EngineTree, facts: KillFacts) -> frozenset[int]:
        """The kill for engine_exited and, for a launched engine, as the guard's word to its launch (guard.json is
        republished at once). Returns the roots whose launch tells the owner: no line on their terminal then."""
        launched = self.launched.note_kill(key, facts.trigger, dry_run=facts.dry_run, summary=kill_summary(facts))
        if launched and self.on_taken is not None:
            self.on_taken()
        told = self.launched.told_by_launch(key, tree.root.ppid)
        return frozenset({tree.root.pid}) if told else frozenset()

    def _record(self, kind: EventKind, summary: str, fields: dict[str, object], level: int, line: str) -> None:
        """An event from the launched engines or the budgets, written on the reaper's thread (never on the guard's)."""
        self.reaper.call(lambda: self._append(kind, summary, fields, level, line))

    def _kernel_log(self, now: float, mem: MemInfo) -> bool:
        """The kernel-log hook: a driver allocation failure near the floor fires like a crossing (core.kernlog), through
        the same policy as any other firing (one tree, the one causing the spike)."""
        trigger = self.kernlog.poll(
            now, mem.available_bytes, self.params.floor_bytes, self.settings.warn_headroom, self.state.armed
        )
        if trigger is None:
            return False
        self.fire(trigger, mem, now)
        return True

    def _check_reaped(self, now: float) -> None:
        """Drop victims that have exited (their pidfd reads POLLIN); when none is left, the teardown is over."""
        if not self._outstanding:
            return
        poller = select.poll()
        for _deadline, fds in self._outstanding.values():
            for fd in fds:
                poller.register(fd, select.POLLIN)
        exited = {fd for fd, _ in poller.poll(0)}
        for key, (deadline, fds) in list(self._outstanding.items()):
            if all(fd in exited for fd in fds) or now >= deadline:
                for fd in fds:
                    os.close(fd)
                del self._outstanding[key]
        if not self._outstanding:
            self.state = core.reaped(self.state, self.params, now)

    def _near_floor(self, available_bytes: int, decision: core.Decision) -> bool:
        if self.state.in_episode:
            return True  # growth history must stay fresh while a kill may follow
        if available_bytes <= self.params.floor_bytes + self.settings.warn_headroom:
            return True
        return decision.seconds_to_floor is not None and decision.seconds_to_floor < WARM_SCAN_HORIZON_S

    def _scout_run(self) -> None:
        """Keep the scanner's argv cache warm while a kill is plausible: the kill path's scan then reads only stat
        files (16.4 ms cold vs 3.9 ms warm for 113 processes, measured here). Far from the floor it sleeps."""
        while not self._stop.is_set():
            self._warm.wait()
            if self._stop.is_set():
                return
            self._warm.clear()
            try:
                scan = self.scanner.scan()  # shares the cache with the kill path: dict reads and writes are atomic
                with self.lock:
                    rules, scope = self.rules, self.scope
                declared, launchers = self.launched.declared(), self.launched.launchers()
                trees = find_engine_trees(scan.procs, rules, scope, declared=declared, launchers=launchers)
                self._observe(time.monotonic(), trees)
                self.warm_scans_total += 1
            except Exception as exc:  # a warm-up is an optimisation: never let it end the thread
                log.warning("scout scan failed: %r", exc)
            self._stop.wait(WARM_SCAN_EVERY_S)

    def _beat(self, now: float) -> None:
        if self.heartbeat is not None:
            self.heartbeat(now)

    def _sleep(self, seconds: float) -> None:
        for fd, _ev in self._poller.poll(seconds * 1000):
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 64)
                except BlockingIOError:
                    pass

    def _gpu(self) -> policy.GpuBytes | None:
        source = self.gpu_bytes_by_pid
        if source is None:
            return None
        try:
            return source()
        except Exception as exc:  # a GPU figure only refines the ranking: never let it stop a kill
            log.warning("GPU bytes unavailable: %r", exc)
            return None

    def _observe(self, now: float, trees: list[EngineTree]) -> policy.GpuBytes | None:
        gpu = self._gpu()
        self.history = policy.observe(self.history, now, trees, gpu, self.policy.growth_window_s)
        self.seen_trees = (now, tuple(trees))
        return gpu

    def ranking(self, trees: list[EngineTree], now: float) -> tuple[policy.Candidate, ...]:
        """The order in which the guard would kill these trees now, with its reasons."""
        gpu = self._observe(now, trees)
        return policy.rank(trees, self.history, now, gpu, self.policy)

    def fire(self, trigger: str, mem: MemInfo, detected_at: float, growing_only: bool = False) -> None:
        with self.lock:  # one consistent set, even if a SIGHUP reload lands mid-kill
            settings, params, rules, scope = self.settings, self.params, self.rules, self.scope
        scan = self.scanner.scan()
        holders: Collection[tuple[int, int]] = ()
        if rules.gpu_holders_are_engines:  # telemetry's word is a hint: checked again here, in our own scan
            scanned = {p.pid: p.start_ticks for p in scan.procs}
            holders = verified_holders(self.gpu_holders(), scanned, self._holds_gpu)
        trees = find_engine_trees(
            scan.procs, rules, scope, holders, declared=self.launched.declared(), launchers=self.launched.launchers()
        )
        ranking = self.ranking(trees, time.monotonic())
        exclude = self._episode_victims | set(self._outstanding) | set(self._budget_victims)
        victim = policy.choose(ranking, growing_only=growing_only, exclude=exclude)
        facts = KillFacts(
            trigger=trigger,
            mem=mem,
            floor_bytes=params.floor_bytes,
            fill_rate_bytes_per_s=self.state.fill_rate_bytes_per_s,
            dry_run=settings.dry_run,
            trees=(),
            victims=(),
            ranking=tuple((c.tree.root.pid, c.tree.kind, c.reasons) for c in ranking[:RANKING_IN_EVENT]),
        )
        if victim is None:
            self.state = core.fired(self.state, params, time.monotonic(), core.Outcome.NONE)
            if not growing_only and not self._hunt_recorded:
                self._hunt_recorded = True  # one no_victim event; the guard keeps looking while under the floor
                self.reaper.submit(KillJob(facts, [], detected_at, None, mem.available_bytes))
            return
        # Re-read right before the signal, as earlyoom does: memory may have come back while we chose.
        try:
            available_now = self.meminfo.read().available_bytes
        except MeminfoError:
            available_now = mem.available_bytes  # the decision stands on the last good sample
        if core.should_cancel(trigger, params, mem.available_bytes, available_now, self.state.fill_rate_bytes_per_s):
            self.state = core.fired(self.state, params, time.monotonic(), core.Outcome.CANCELLED)
            self._record_cancelled(facts, victim, available_now)
            return
        self._hunt_recorded = False
        victims, signaled_at, notes, method = self.killer.kill([victim.tree], dry_run=settings.dry_run)
        tree = victim.tree
        facts = replace(
            facts,
            trees=(tree,),
            victims=victims_of([tree]) if settings.dry_run else tuple((v.proc, v.engine) for v in victims),
            method=method,
            victim_rss_bytes=victim.rss_bytes,
            victim_gpu_bytes=victim.gpu_bytes,
            why_this_tree=victim.reasons,
        )
        now = time.monotonic()
        self._episode_victims.add(victim.key)
        told = self._note_kill(victim.key, tree, facts)
        held = victim.rss_bytes + (victim.gpu_bytes or 0)
        teardown_s = core.teardown_deadline_s(held)
        if not settings.dry_run and victims:
            self._outstanding[victim.key] = (now + teardown_s, [os.dup(v.pidfd) for v in victims])
        self.state = core.fired(self.state, params, now, core.Outcome.KILLED, teardown_s)
        if victim.key not in self._outstanding:
            self.state = core.reaped(self.state, params, now)  # dry run, or already gone: nothing to wait for
        with self.lock:
            self.stats.count_kill(trigger, settings.dry_run, len(victims), time.time())
        self.reaper.submit(
            KillJob(
                facts=facts,
                victims=victims,
                detected_at=detected_at,
                signaled_at=signaled_at,
                available_at_signal=available_now,
                notes=notes,
                told_by_launch=told,
            )
        )
        if settings.dry_run:
            return  # a tree chosen again and again in dry run was never killed: no kill loop to report
        self.loops, count = note_kill(self.loops, now, loop_identity(tree))
        if count is not None:
            self._record_loop(tree, count, facts)

    def _record_cancelled(self, facts: KillFacts, victim: policy.Candidate, available_now: int) -> None:
        with self.lock:
            self.stats.cancelled_total += 1
        tree = victim.tree
        summary = (
            f"Would have killed {tree.kind} (root pid {tree.root.pid}) but MemAvailable recovered to "
            f"{format_size(available_now)} before the signal: nothing was signalled."
        )
        fields = {
            **kill_fields(replace(facts, trees=(tree,), victims=victims_of([tree]), why_this_tree=victim.reasons)),
            "mem_available_now_bytes": available_now,
        }
        self.reaper.call(lambda: self._append(EventKind.KILL_CANCELLED, summary, fields, logging.INFO, summary))

    def _record_loop(self, tree: EngineTree, count: int, facts: KillFacts) -> None:
        with self.lock:
            self.stats.kill_loops_total += 1
        name = tree.root.display_name
        summary = (
            f"Kill loop: {tree.kind} {name!r} was killed {count} times within {LOOP_WINDOW_S / 60:.0f} minutes; "
            f"something restarts it into the same memory spike (a supervisor or Restart=). Each kill was made under "
            f"the floor; fix the engine's memory settings or stop its supervisor."
        )
        fields = {
            "engine": tree.kind,
            "name": name,
            "root_pid": tree.root.pid,
            "parent_pid": tree.root.ppid,
            "kills": count,
            "window_s": LOOP_WINDOW_S,
            "mem_available_bytes": facts.mem.available_bytes,
            "floor_bytes": facts.floor_bytes,
        }
        self.reaper.call(
            lambda: self._append(EventKind.KILL_LOOP, summary, fields, logging.ERROR, f"KILL LOOP: {summary}")
        )

    def _append(self, kind: EventKind, summary: str, fields: dict[str, object], level: int, line: str) -> None:
        log.log(level, line)
        try:
            self.events.append(make_event(kind, summary, fields))
        except EventLogError as exc:
            log.error("ERROR could not record %s event: %s", kind, exc)

    # --- on the reaper's thread
    def _announce(self, job: KillJob) -> None:
        """The greppable line, right after the signals: `journalctl --user -u sparkwatch | grep KILL`."""
        # A kill is an error: `journalctl -p err` shows it. A dry run's would-kill is a warning: nothing died.
        log.log(logging.WARNING if job.facts.dry_run and job.facts.trees else logging.ERROR, kill_line(job.facts))
        for note in job.notes:
            log.info("kill: %s", note)
        if job.signaled_at is not None:  # the owner's own terminal says who killed it (guard.ttynote)
            roots = {t.root.pid: t for t in job.facts.trees}
            for v in job.victims:  # a launched root's launch prints the guard's word there itself: one line
                if v.tty_nr and v.proc.pid in roots and v.proc.pid not in job.told_by_launch:
                    tell_terminal(v.tty_nr, v.proc.uid, terminal_note(job.facts, roots[v.proc.pid]))

    def _finish(self, job: KillJob, facts: KillFacts) -> None:
        if facts.signal_to_reaped_ms is not None and facts.detect_to_signal_ms is not None:
            with self.lock:
                self.stats.observe_kill_duration((facts.detect_to_signal_ms + facts.signal_to_reaped_ms) / 1000)
        if facts.survivors:
            log.warning(
                "WARNING pids %s not gone %.0f s after SIGKILL (D state?); the guard keeps running",
                list(facts.survivors),
                self.reaper.wait_s,
            )
        if not facts.trees:
            kind = EventKind.NO_VICTIM
        else:  # a dry run's decision has a kind of its own: nothing that reads `kill` mistakes it for a kill
            kind = EventKind.WOULD_KILL if facts.dry_run else EventKind.KILL
        event = make_event(kind, kill_summary(facts), kill_fields(facts))
        try:
            self.events.append(event)
        except EventLogError as exc:
            log.error("ERROR could not record %s event: %s", kind, exc)
