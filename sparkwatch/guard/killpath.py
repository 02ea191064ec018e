"""The kill path: every kill the guard makes, from the request to its record, in one place (oomd's one kill plugin).

The detectors only decide: the pool watch's floor and prediction (core.kill.trigger: `floor`, `predicted`, `escalate`,
`hunt`), the kernel-log hook (`driver_alloc_failed`, guard.kernlog), the budgets (`budget`, guard.budgets) and the
group watch (`group_teardown`, guard.groupwatch: a group spanning nodes lost a member) and the wedge watch (`wedged`,
guard.wedgewatch: an engine up but not serving for kill_wedged_after_s). Each builds one frozen
KillRequest (its trigger, when, and for a trigger that names its own tree the target it checked, with its facts). The
pool watch fires its own on its tick; every other detector hands its request to the guard's one inbox (guard.inbox),
which the pool watch drains on its tick. Either way `KillPath.fire` gets it on the guard's own thread, with the tick's
MemInfo sample. That one owner:
1. chooses: a /proc scan ranked by core.kill.policy (growth history, GPU bytes, kill order), never a tree already
   signalled in this episode or still tearing down; a budget's, a group's or a wedge's request names its tree, chosen
   unless it is such a tree (its kill is then the one under way: nothing more is signalled or recorded);
2. re-reads MemAvailable right before the signal, as earlyoom does, and applies core.kill.trigger.should_cancel: a
   floor, escalation or hunt is cancelled when memory is back above the floor, a prediction when the floor is again more
   than two kill budgets away; a driver allocation failure, a budget and a group teardown are never cancelled by the
   pool (the driver failed already; a budget is the engine's own limit, which a pool that came back does not lift; a
   group that lost a member on another node is stuck whatever this node's pool holds);
3. kills (guard.killer.Killer: pidfds, SIGSTOP, sweep, cgroup.kill, SIGKILL), with the tick's own rules and scope;
4. counts (common.stats.GuardStats, under the guard's lock);
5. tracks the teardown: the victim is excluded from every later choice until the episode ends, its reap is waited
   for with a deadline sized to what it held (core.kill.trigger.teardown_deadline_s), and core.kill.trigger's state
   hears of it (`fired`, then `reaped`), so the next tree dies only when memory did not come back, whatever the trigger
   was;
6. notes a launched engine's kill for its launch (guard.launchwatch) and republishes guard.json (`on_taken`);
7. submits the record to the Reaper (guard.killer.Reaper), whose thread writes it: KillRecords below.

Reaping is checked in one place, the Reaper's thread (a pidfd polls readable when its process has exited): it hands
each reaped tree's key back through a deque that `reaped` drains on the guard's tick, without a syscall.
The guard thread never waits on disk, NVML, HTTP or a webhook: every event and log line goes through the Reaper.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.eventlog import EventLog, EventLogError, make_event
from sparkwatch.common.guardconfig import GuardSnapshot
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.common.stats import GuardStats, RecentKill
from sparkwatch.core.container import NO_NOTES, ContainerNotes
from sparkwatch.core.engines.identity import find_engine_trees
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill import policy
from sparkwatch.core.kill import trigger as core
from sparkwatch.core.kill.footprint import Footprint
from sparkwatch.core.kill.killloop import LOOP_WINDOW_S, LoopState, loop_identity, note_kill
from sparkwatch.core.kill.killrecord import (
    GroupLoss,
    KillFacts,
    WedgeStall,
    container_entry,
    in_container,
    kill_fields,
    kill_line,
    kill_reason,
    kill_summary,
    terminal_note,
    victims_of,
)
from sparkwatch.core.kill.triggers import TRIGGERS, Trigger
from sparkwatch.core.model import EngineTree, MemInfo
from sparkwatch.core.units import format_size
from sparkwatch.guard.gpuboard import device_check, verified_holders
from sparkwatch.guard.killer import Killer, KillJob, Reaper
from sparkwatch.guard.launchwatch import LaunchedEngines
from sparkwatch.guard.ttynote import tell_terminal

log = logs.get("guard")

# The ranking shown in a kill event: the first trees in kill order (a box runs a handful of engines).
RANKING_IN_EVENT = 8


@dataclass(frozen=True, slots=True)
class BudgetFacts:
    """What a budget request carries: the tree over its budget, as guard.budgets measured it."""

    tree: EngineTree
    budget_bytes: int
    source: str  # "launch" | "config"
    footprint: Footprint


# The group watch's counters (guard.groupwatch), exported at 0 before its first group (its module loads only then).
GROUP_COUNTERS = ("teardowns", "refused", "errors")


@dataclass(frozen=True, slots=True)
class GroupFacts:
    """What a group teardown request carries: this node's members of the group, checked by guard.groupwatch and made
    one tree (the API server first), and what was lost."""

    tree: EngineTree
    loss: GroupLoss


@dataclass(frozen=True, slots=True)
class WedgedFacts:
    """What a wedged request carries: the engine tree guard.wedgewatch checked, and what the serving probe said."""

    tree: EngineTree
    wedged_for_s: float
    failures: int
    error: str
    counter: str  # the engine's progress counter that did not move, and its value (core.engines.progress)
    counter_value: float


# The tree a request names, with its facts as its detector or verifier found them (a budget's, a group's, a wedge's);
# a pool trigger names none: the kill path chooses the tree itself.
Target = BudgetFacts | GroupFacts | WedgedFacts


@dataclass(frozen=True, slots=True)
class KillRequest:
    """One trigger's word to the kill path: its trigger, `detected_at` (monotonic time of the decision), and for a
    trigger that names its own tree (TRIGGERS[trigger].names_tree) the `target` it checked; `growing_only`: during a
    teardown only a tree that is itself growing may die. The MemInfo sample it is weighed against is the tick's that
    hands it to `KillPath.fire`. Pool triggers come from the pool watch's tick; every other comes through its inbox
    (guard.inbox)."""

    trigger: Trigger
    detected_at: float
    target: Target | None = None
    growing_only: bool = False


# Per-pid GPU bytes as the guard last heard them from telemetry, or None (the policy ranks without them).
GpuReading = Callable[[], policy.GpuBytes | None]
# Engine-event recorder handed to the launched engines and the budgets: (kind, summary, fields, level, log line).
Record = Callable[[EventKind, str, dict[str, object], int, str], None]


class KillRecords:
    """The Reaper's side: the KILL line, the terminal note, and each kill's event once it is measured; and every other
    event or line the guard thread sends, in the order it sent them (guard.killer.Reaper)."""

    def __init__(self, proc_root: Path, events: EventLog, stats: GuardStats, lock: threading.Lock, settle_s: float):
        self.events = events
        self.stats = stats
        self.lock = lock
        # Keys of trees whose victims all exited (or whose wait ran out), appended on the reaper's thread and drained
        # by KillPath.reaped on the guard's (deque append and popleft are atomic).
        self.reaped_keys: collections.deque[policy.TreeKey] = collections.deque()
        # The reaper waits as long as the longest teardown the policy allows (a GB10 engine holding 77 GiB: ~10 s).
        self.reaper = Reaper(
            proc_root, self._announce, self._finish, wait_s=core.TEARDOWN_MAX_S, settle_s=settle_s, reaped=self._reaped
        )

    def record(self, kind: EventKind, summary: str, fields: dict[str, object], level: int, line: str) -> None:
        """An event (the launched engines', the budgets', the kill path's own), written on the reaper's thread."""
        self.reaper.call(lambda: self._append(kind, summary, fields, level, line))

    def line(self, level: int, text: str) -> None:
        """A log line, after any KILL line already handed to the reaper."""
        self.reaper.call(lambda: log.log(level, text))

    def _append(self, kind: EventKind, summary: str, fields: dict[str, object], level: int, line: str) -> None:
        log.log(level, line)
        try:
            self.events.append(make_event(kind, summary, fields))
        except EventLogError as exc:
            log.error("ERROR could not record %s event: %s", kind, exc)

    def _reaped(self, job: KillJob) -> None:
        if job.facts.trees:
            self.reaped_keys.append(job.facts.trees[0].root.key)

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
        elif facts.group is not None:  # its own kind, dry run or not (`dry_run` says which): docs/multinode.md
            kind = EventKind.GROUP_TEARDOWN
        else:  # a dry run's decision has a kind of its own: nothing that reads `kill` mistakes it for a kill
            kind = EventKind.WOULD_KILL if facts.dry_run else EventKind.KILL
        fields = kill_fields(facts)
        if facts.group is not None and facts.group.detected_ts:
            since_s = max(time.time() - facts.group.detected_ts, 0.0)  # Ray's word -> this node's members reaped
            fields["since_detected_s"] = round(since_s, 3)
            if not facts.dry_run:
                with self.lock:
                    self.stats.observe_group_teardown(since_s)
        event = make_event(kind, kill_summary(facts), fields)
        try:
            self.events.append(event)
        except EventLogError as exc:
            log.error("ERROR could not record %s event: %s", kind, exc)

    def cancelled(self, facts: KillFacts, tree: EngineTree, reasons: tuple[str, ...], available_now: int) -> None:
        summary = (
            f"Would have killed {tree.kind} (root pid {tree.root.pid}) but MemAvailable recovered to "
            f"{format_size(available_now)} before the signal: nothing was signalled."
        )
        fields = {
            **kill_fields(replace(facts, trees=(tree,), victims=victims_of([tree]), why_this_tree=reasons)),
            "mem_available_now_bytes": available_now,
        }
        self.record(EventKind.KILL_CANCELLED, summary, fields, logging.INFO, summary)

    def loop(self, tree: EngineTree, count: int, facts: KillFacts) -> None:
        name = tree.root.display_name
        note = facts.note_of(tree)
        container = container_entry(tree, note)
        if container is None:
            restarter = "something restarts it into the same memory spike (a supervisor or Restart=)"
            fix = "stop its supervisor"
        else:  # its parent is the runtime's shim: the container is what restarts it
            restarter = "its container's restart policy (or a supervisor in it) restarts it into the same memory spike"
            fix = "stop the container or change its restart policy"
        summary = (
            f"Kill loop: {tree.kind} {name!r}{in_container(tree, note)} was killed {count} times within "
            f"{LOOP_WINDOW_S / 60:.0f} minutes; {restarter}. Each kill was made under the floor; fix the engine's "
            f"memory settings or {fix}."
        )
        fields: dict[str, object] = {
            "engine": tree.kind,
            "name": name,
            "root_pid": tree.root.pid,
            "parent_pid": tree.root.ppid,
            "kills": count,
            "window_s": LOOP_WINDOW_S,
            "mem_available_bytes": facts.mem.available_bytes,
            "floor_bytes": facts.floor_bytes,
        }
        if container is not None:
            fields["container"] = {k: v for k, v in container.items() if k != "root_pid"}
        self.record(EventKind.KILL_LOOP, summary, fields, logging.ERROR, f"KILL LOOP: {summary}")


@dataclass(frozen=True, slots=True)
class _Choice:
    tree: EngineTree
    key: policy.TreeKey
    held_bytes: int  # RSS + GPU (or the budget's footprint): sizes the teardown deadline
    rss_bytes: int
    gpu_bytes: int | None
    reasons: tuple[str, ...]


def _named(req: KillRequest, facts: KillFacts) -> tuple[_Choice, KillFacts] | None:
    """The tree a request names (its target), with what its record says of it; None for the pool's triggers, whose
    tree the kill path chooses itself."""
    target = req.target
    if isinstance(target, BudgetFacts):
        b, fp, tree = target, target.footprint, target.tree
        reasons = (f"over its budget {format_size(b.budget_bytes)} ({b.source})",)
        facts = replace(
            facts,
            budget_bytes=b.budget_bytes,
            budget_source=b.source,
            footprint_bytes=fp.bytes,
            footprint_source=str(fp.source),
        )
        return _Choice(tree, tree.root.key, fp.bytes, tree.rss_bytes, fp.gpu_bytes, reasons), facts
    if isinstance(target, GroupFacts):
        loss, tree = target.loss, target.tree
        reasons = (f"its group lost a member: {loss.death}",)
        return _Choice(tree, tree.root.key, tree.rss_bytes, tree.rss_bytes, None, reasons), replace(facts, group=loss)
    if isinstance(target, WedgedFacts):
        w, tree = target, target.tree
        stall = WedgeStall(w.failures, w.wedged_for_s, w.error, w.counter, w.counter_value)
        reasons = (
            f"wedged: up but not serving for {w.wedged_for_s:.0f} s ({w.failures} one-token probes failed in a row"
            + (f", last: {w.error}" if w.error else "")
            + f"; {stall.counter} did not move)",
        )
        return _Choice(tree, tree.root.key, tree.rss_bytes, tree.rss_bytes, None, reasons), replace(facts, wedge=stall)
    return None


class KillPath:
    """The one owner of a kill: chooses, re-reads, kills, counts, tracks the teardown, records (module docstring).
    Runs on the guard's thread only; `observe` (the growth history) also on the scout's, by reference swaps."""

    def __init__(
        self,
        proc_root: Path,
        *,
        records: KillRecords,
        meminfo: MeminfoReader,
        scanner: ProcScanner,
        launched: LaunchedEngines,
        stats: GuardStats,
        lock: threading.Lock,
        gpu: GpuReading,
        gpu_holders: Callable[[], Collection[tuple[int, int]]],
        on_taken: Callable[[], None] | None,
        snapshot: GuardSnapshot,
        containers: Callable[[], ContainerNotes] = lambda: NO_NOTES,
    ) -> None:
        """`containers`: telemetry's last word on the containers (names, io.sparkwatch.* labels), a reference read."""
        self.records = records
        self._containers = containers
        self.meminfo = meminfo
        self.scanner = scanner
        self.launched = launched
        self.stats = stats
        self.lock = lock
        self._gpu = gpu
        self._gpu_holders = gpu_holders
        self._on_taken = on_taken
        self._holds_gpu = device_check(str(proc_root))
        self.killer = Killer(proc_root, snapshot.rules, snapshot.scope)
        self.history = policy.GrowthHistory()  # replaced whole by the scout and the kill path (atomic reference swap)
        # The trees of the last own scan (monotonic time, trees), for the flight recorder: a reference swap.
        self.seen_trees: tuple[float, tuple[EngineTree, ...]] | None = None
        self.loops = LoopState()
        # Victims signalled and not reaped yet: tree -> teardown deadline. Past it a victim counts as stuck (D state)
        # and is no longer waited for; the reaper says when one exited (KillRecords.reaped_keys).
        self._outstanding: dict[policy.TreeKey, float] = {}
        # Trees killed (or, in dry run, chosen) in this episode, by any trigger: never chosen twice.
        self._episode_victims: set[policy.TreeKey] = set()
        self._hunt_recorded = False  # one no_victim event per stretch of hunting, not one per look

    def last_scan(self) -> tuple[float, tuple[EngineTree, ...]] | None:
        """The trees of the last own scan (monotonic time, trees), for the flight recorder (a reference read)."""
        return self.seen_trees

    # --- the growth history (the scout's warm scans and the kill path's own)
    def observe(self, now: float, trees: list[EngineTree], snap: GuardSnapshot) -> policy.GpuBytes | None:
        gpu = self._gpu()
        self.history = policy.observe(self.history, now, trees, gpu, snap.policy.growth_window_s)
        self.seen_trees = (now, tuple(trees))
        return gpu

    def ranking(self, trees: list[EngineTree], now: float, snap: GuardSnapshot) -> tuple[policy.Candidate, ...]:
        """The order in which the guard would kill these trees now, with its reasons."""
        gpu = self.observe(now, trees, snap)
        return policy.rank(trees, self.history, now, gpu, snap.policy, containers=self._containers())

    # --- the episode
    def rearmed(self) -> None:
        """MemAvailable is back above floor + rearm_headroom: a new episode may choose any tree again."""
        self._episode_victims.clear()
        self._hunt_recorded = False

    def reaped(self, state: core.GuardState, snap: GuardSnapshot, now: float) -> core.GuardState:
        """Drop victims the reaper saw exit, and those past their deadline; when none is left, the teardown is over."""
        keys = self.records.reaped_keys
        while keys:
            self._outstanding.pop(keys.popleft(), None)
        if not self._outstanding:
            return state
        for key, deadline in list(self._outstanding.items()):
            if now >= deadline:
                del self._outstanding[key]
        if not self._outstanding:
            state = core.reaped(state, now, kill_settle_s=snap.config.kill_settle_s)
        return state

    # --- the kill
    def fire(self, req: KillRequest, mem: MemInfo, state: core.GuardState, snap: GuardSnapshot) -> core.GuardState:
        """Act on one request, weighed against `mem` (the sample of the tick that hands it over); returns
        core.kill.trigger's state with what came of it."""
        config = snap.config
        exclude = self._episode_victims.union(self._outstanding)
        facts = KillFacts(
            trigger=req.trigger,
            mem=mem,
            floor_bytes=config.floor,
            fill_rate_bytes_per_s=state.fill_rate_bytes_per_s,
            dry_run=config.dry_run,
            trees=(),
            victims=(),
        )
        named = _named(req, facts)
        if named is not None:  # a budget's or a group's request: the detector chose the tree
            choice, facts = named
            if choice.key in exclude:
                return state  # already this episode's victim: that kill is under way and recorded
            spared = policy.protected_by_label(choice.tree, self._containers())
            if spared is not None:  # a wedge or a group teardown (a budget never tracks one): protected all the same
                self.records.line(
                    logging.WARNING,
                    f"sparkwatch: not killing {choice.tree.kind} tree root={choice.tree.root.pid} ({req.trigger}): "
                    f"io.sparkwatch.protect=true on {spared}",
                )
                return state
        else:
            picked, ranking = self._choose(req, exclude, snap)
            facts = replace(
                facts, ranking=tuple((c.tree.root.pid, c.tree.kind, c.reasons) for c in ranking[:RANKING_IN_EVENT])
            )
            if picked is None:
                state = core.fired(state, time.monotonic(), core.Outcome.NONE)
                if not req.growing_only and not self._hunt_recorded:
                    self._hunt_recorded = True  # one no_victim event; the guard keeps looking while under the floor
                    self.records.reaper.submit(KillJob(facts, [], req.detected_at, None, mem.available_bytes))
                return state
            held = picked.rss_bytes + (picked.gpu_bytes or 0)
            choice = _Choice(picked.tree, picked.key, held, picked.rss_bytes, picked.gpu_bytes, picked.reasons)
        # Re-read right before the signal, as earlyoom does: memory may have come back while we chose.
        try:
            available_now = self.meminfo.read().available_bytes
        except MeminfoError:
            available_now = mem.available_bytes  # the decision stands on the last good sample
        decided = mem.available_bytes
        rate = state.fill_rate_bytes_per_s
        if core.should_cancel(
            req.trigger, decided, available_now, rate, floor=config.floor, kill_budget_s=config.kill_budget_s
        ):
            state = core.fired(state, time.monotonic(), core.Outcome.CANCELLED)
            with self.lock:
                self.stats.cancelled_total += 1
            self.records.cancelled(facts, choice.tree, choice.reasons, available_now)
            return state
        return self._kill(req, choice, facts, available_now=available_now, state=state, snap=snap)

    def _choose(
        self, req: KillRequest, exclude: Collection[policy.TreeKey], snap: GuardSnapshot
    ) -> tuple[policy.Candidate | None, tuple[policy.Candidate, ...]]:
        scan = self.scanner.scan()
        holders: Collection[tuple[int, int]] = ()
        if snap.rules.gpu_holders_are_engines:  # telemetry's word is a hint: checked again here, in our own scan
            scanned = {p.pid: p.start_ticks for p in scan.procs}
            holders = verified_holders(self._gpu_holders(), scanned, self._holds_gpu)
        trees = find_engine_trees(
            scan.procs,
            snap.rules,
            snap.scope,
            holders,
            declared=self.launched.declared(),
            launchers=self.launched.launchers(),
        )
        ranking = self.ranking(trees, time.monotonic(), snap)
        return policy.choose(ranking, growing_only=req.growing_only, exclude=exclude), ranking

    def _kill(
        self,
        req: KillRequest,
        choice: _Choice,
        facts: KillFacts,
        *,
        available_now: int,
        state: core.GuardState,
        snap: GuardSnapshot,
    ) -> core.GuardState:
        dry_run = snap.config.dry_run
        self._hunt_recorded = False
        tree = choice.tree
        victims, signaled_at, notes, method = self.killer.kill(
            [tree], dry_run=dry_run, rules=snap.rules, scope=snap.scope
        )
        ref = tree.container
        named_by = self._containers() if ref is not None else NO_NOTES
        facts = replace(
            facts,
            trees=(tree,),
            container_notes=(named_by.by_id[ref.id],) if ref is not None and ref.id in named_by.by_id else (),
            victims=victims_of([tree]) if dry_run else tuple((v.proc, v.engine) for v in victims),
            method=method,
            victim_rss_bytes=choice.rss_bytes,
            victim_gpu_bytes=choice.gpu_bytes,
            why_this_tree=choice.reasons,
        )
        now = time.monotonic()
        self._episode_victims.add(choice.key)
        told = self._note_launched(choice.key, tree, facts)
        teardown_s = core.teardown_deadline_s(choice.held_bytes)
        if not dry_run and victims:
            self._outstanding[choice.key] = now + teardown_s
        state = core.fired(state, now, core.Outcome.KILLED, teardown_s)
        if choice.key not in self._outstanding:
            # Dry run, or already gone: nothing to wait for.
            state = core.reaped(state, now, kill_settle_s=snap.config.kill_settle_s)
        with self.lock:
            self.stats.count_kill(req.trigger, dry_run, len(victims), time.time())
            if victims and not dry_run:  # told to the peers at once (telemetry.peerdoc): the event comes after settle
                pids = tuple(v.proc.pid for v in victims)
                self.stats.remember_kill(RecentKill(time.time(), req.trigger, kill_reason(facts), pids))
        self.records.reaper.submit(
            KillJob(
                facts=facts,
                victims=victims,
                detected_at=req.detected_at,
                signaled_at=signaled_at,
                available_at_signal=available_now,
                notes=notes,
                told_by_launch=told,
            )
        )
        # A tree chosen again and again in dry run was never killed; a trigger that names its own tree (a budget, a
        # group teardown, a wedge) is no spike under the floor: its row says it counts toward no kill loop.
        if not dry_run and TRIGGERS[req.trigger].counts_toward_loop:
            self.loops, count = note_kill(self.loops, now, loop_identity(tree))
            if count is not None:
                with self.lock:
                    self.stats.kill_loops_total += 1
                self.records.loop(tree, count, facts)
        return state

    def _note_launched(self, key: policy.TreeKey, tree: EngineTree, facts: KillFacts) -> frozenset[int]:
        """The kill for engine_exited and, for a launched engine, as the guard's word to its launch (guard.json is
        republished at once). Returns the roots whose launch tells the owner: no line on their terminal then."""
        launched = self.launched.note_kill(key, facts.trigger, dry_run=facts.dry_run, summary=kill_summary(facts))
        if launched and self._on_taken is not None:
            self._on_taken()
        told = self.launched.told_by_launch(key, tree.root.ppid)
        return frozenset({tree.root.pid}) if told else frozenset()
