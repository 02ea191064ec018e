"""Per-engine budgets, enforced in the guard process on the pool watch's own tick (no thread, no timer of its own).

Which trees have a budget: a launched engine's declaration (`sparkwatch launch --budget`, trusted through
guard.launchwatch); this node's Ray ranks of an engine launched on another node with `--budget worker=SIZE`, as
telemetry names them by pid, start time and uid (common.messages.PeerBudgetMsg: the tree whose root is that very
process, its own user's); a container's `io.sparkwatch.budget` label, as telemetry tells the guard the labels
(common.messages.ContainersMsg), matched by the container id in the tree's own cgroup path (budget source `label`);
or the config's `engine_budgets` ('SIZE=regex', matched like kill_priority: core.kill.policy owns the syntax). A tree
in a container labelled `io.sparkwatch.protect=true` has no budget, whatever its source: the guard never kills it
(said once in the log). Only those trees are looked at, and only as often as their distance to the budget
asks (core.kill.budget):
- discovery: a /proc scan (the guard's own scanner, its argv cache warm) finds the budgeted trees and their members,
  every DISCOVER_EVERY_S, every NEAR_DISCOVER_EVERY_S while a tree is within WARN_RATIO of its budget, and at once
  when a member died, a budgeted declaration appeared, or telemetry's count of engine trees changed (a hint from
  its census, which runs every second anyway: a new engine is looked at within about a second);
- sampling, between discoveries: the members' stat files (RSS), telemetry's per-pid GPU bytes (a hint with its age)
  and the scope's memory.current when the tree owns its cgroup (core.kill.footprint: counted once); while it is the only
  launched engine booting, the pool's drop since its launch too, which may warn but never kills;
- over budget + margin for the guard's debounce: the killer kills that tree alone (trigger `budget`), recorded as
  every kill is (the reaper writes the event); in dry-run the same decision is recorded and nothing is signalled;
- at 90 %: one `budget_near` event (again only after it fell under 80 %);
- at GPU_FAST_RATIO (80 %) or more: the tree's members go to telemetry in the state (`BudgetStat.gpu_watch`), which
  samples their GPU bytes every FAST_PERIOD_S and sends each change (common.messages.GpuSampleMsg); the guard's
  supervisor wakes this loop for it, and a near tree whose GPU bytes moved is looked at on that tick, whatever its
  schedule said (`_gpu_moved`).
With no budget anywhere, `tick` returns at once: the idle guard pays one attribute check a tick.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sparkwatch.common import logs
from sparkwatch.common.launched import Declaration
from sparkwatch.common.messages import MAX_GPU_WATCH_PIDS
from sparkwatch.common.sources.cgroupmem import read_memory_current
from sparkwatch.common.sources.procs import ProcScanner, parse_stat
from sparkwatch.common.stats import BudgetStat
from sparkwatch.core.container import LABEL_PROTECT, NO_NOTES, ContainerNotes
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill import budget as core
from sparkwatch.core.kill.footprint import Footprint, FootprintInputs, FootprintSource, footprint, owned_scope
from sparkwatch.core.kill.policy import GPU_STALE_S, GpuBytes, TreeKey, first_match
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.core.units import format_size
from sparkwatch.guard.killpath import BudgetFacts, KillRequest

log = logs.get("guard")

DISCOVER_EVERY_S = 5.0
NEAR_DISCOVER_EVERY_S = 1.0
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Tracked:
    key: TreeKey
    tree: EngineTree
    budget_bytes: int
    source: str  # "launch" | "peer" | "label" | "config"
    decl: Declaration | None = None
    state: core.BudgetState = field(default_factory=core.BudgetState)
    next_t: float = 0.0
    last: Footprint | None = None
    killed: bool = False

    @property
    def name(self) -> str:
        if self.decl is not None and self.decl.model:
            return self.decl.model
        return self.tree.root.display_name


# Where a budget kill goes: the guard's inbox (guard.inbox.KillInbox.put), drained into the one kill path on this same
# tick. The kill path owns the killer, the reaper and the stats, and records the kill as it records every other.
KillFn = Callable[[KillRequest], None]
EventFn = Callable[[EventKind, str, dict[str, object], int, str], None]


def read_member_rss(proc_root: str, members: Sequence[Proc]) -> tuple[int, int]:
    """(RSS of the members still alive with their start time, how many are gone)."""
    total = 0
    gone = 0
    for p in members:
        try:
            fd = os.open(f"{proc_root}/{p.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.read(fd, 4096)
            finally:
                os.close(fd)
            _comm, state, _ppid, _flags, start, rss_pages = parse_stat(p.pid, data)
        except (OSError, ValueError):
            gone += 1
            continue
        if start != p.start_ticks or state in ("Z", "X"):
            gone += 1
            continue
        total += rss_pages * _PAGE
    return total, gone


def near_gpu(t: Tracked, ratio: float) -> bool:
    """The tree's last footprint is at `ratio` of its budget or more."""
    return t.last is not None and t.last.bytes >= ratio * t.budget_bytes


def _gpu_moved(t: Tracked, gpu: GpuBytes | None, now: float) -> bool:
    """A near-budget tree whose GPU bytes in the latest (fresh) reading differ from those its last look counted: a
    fast sample (or the cycle's reading) moved them, so it is looked at now. Far from its budget its schedule stands."""
    if gpu is None or t.last is None or now - gpu[0] > GPU_STALE_S or not near_gpu(t, core.GPU_FAST_RATIO):
        return False
    by_pid = gpu[1]
    return sum(by_pid.get(p.pid, 0) for p in t.tree.members) != (t.last.gpu_bytes or 0)


class BudgetWatch:
    def __init__(
        self,
        proc_root: str,
        scanner: ProcScanner,
        kill: KillFn,
        event: EventFn,
        line: Callable[[int, str], None] | None = None,
    ) -> None:
        """`line`: a log line, written off the guard's thread (guard.killpath.KillRecords.line)."""
        self.proc_root = proc_root
        self.scanner = scanner
        self.kill = kill
        self.event = event
        self.line = line
        self.tracked: dict[TreeKey, Tracked] = {}
        self._seen_containers: ContainerNotes = NO_NOTES
        self._said_protected: set[TreeKey] = set()  # protected trees whose budget was said to be off
        self._next_discovery = 0.0
        self._seen_declared: frozenset[TreeKey] = frozenset()
        self._seen_engines: int | None = None
        self.scans_total = 0
        self.samples_total = 0

    def active(
        self,
        config_budgets: Sequence[tuple[int, re.Pattern[str]]],
        launched: Sequence[Declaration],
        peer_budgets: Mapping[TreeKey, tuple[int, int]] | None = None,
        containers: ContainerNotes = NO_NOTES,
    ) -> bool:
        return (
            bool(config_budgets)
            or any(d.budget_bytes for d in launched)
            or bool(peer_budgets)
            or bool(containers.budgets)
            or bool(self.tracked)
        )

    def stats(self) -> list[BudgetStat]:
        out = []
        watched = 0
        for t in self.tracked.values():
            fp = t.last
            watch: tuple[tuple[int, int], ...] = ()
            if not t.killed and near_gpu(t, core.GPU_FAST_RATIO):
                watch = tuple(p.key for p in t.tree.members[: MAX_GPU_WATCH_PIDS - watched])
                watched += len(watch)
            out.append(
                BudgetStat(
                    root_pid=t.key[0],
                    kind=t.tree.kind,
                    name=t.name,
                    budget_bytes=t.budget_bytes,
                    footprint_bytes=None if fp is None else fp.bytes,
                    footprint_source=None if fp is None else str(fp.source),
                    peak_bytes=t.state.peak_bytes,
                    budget_source=t.source,
                    gpu_watch=watch,
                )
            )
        return out

    def tick(
        self,
        now: float,
        available_bytes: int,
        *,
        rules: EngineRules,
        scope: Scope,
        params: core.BudgetParams,
        config_budgets: Sequence[tuple[int, re.Pattern[str]]],
        launched: Sequence[Declaration],
        gpu: GpuBytes | None,
        engines_hint: int | None = None,
        peer_budgets: Mapping[TreeKey, tuple[int, int]] | None = None,
        containers: ContainerNotes = NO_NOTES,
    ) -> float | None:
        """One look at whatever budgeted tree is due. Returns the seconds until the next is due (None: no budgets).
        `engines_hint`: telemetry's count of engine trees, whose change means a tree may have appeared.
        `peer_budgets`: {(pid, start ticks): (uid, bytes)} of this node's Ray ranks, from another node's launch.
        `containers`: telemetry's word on the containers' labels (a new word is a new object: discovery at once)."""
        peer = peer_budgets or {}
        if not self.active(config_budgets, launched, peer, containers):
            return None
        budgeted = frozenset(d.tree_key for d in launched if d.budget_bytes) | frozenset(peer)
        if (
            budgeted - self._seen_declared
            or (engines_hint is not None and engines_hint != self._seen_engines)
            or containers is not self._seen_containers
        ):
            self._next_discovery = now
        self._seen_declared, self._seen_engines, self._seen_containers = budgeted, engines_hint, containers
        if now >= self._next_discovery:
            self._discover(now, rules, scope, config_budgets, launched, peer=peer, containers=containers)
        booting = [d for d in launched if d.booting]
        for t in list(self.tracked.values()):
            if t.killed or (now < t.next_t and not _gpu_moved(t, gpu, now)):
                continue
            fp, gone = self._footprint(t, now, available_bytes, gpu, sole_booting=len(booting) == 1)
            self.samples_total += 1
            if gone:
                self._next_discovery = now  # a member died: see the tree as it is now
            if gone >= len(t.tree.members):
                del self.tracked[t.key]
                continue
            t.last = fp
            t.state, decision = core.budget_step(
                t.state, params, now, fp.bytes, t.budget_bytes, warn_bytes=fp.warn_bytes
            )
            t.next_t = now + decision.next_interval_s
            if decision.warn:
                self._warn(t, fp, decision.limit_bytes)
            if fp.bytes >= params.warn_ratio * t.budget_bytes:
                self._next_discovery = min(self._next_discovery, now + NEAR_DISCOVER_EVERY_S)
            if decision.kill:
                t.killed = True
                self.kill(
                    KillRequest(Trigger.BUDGET, time.monotonic(), BudgetFacts(t.tree, t.budget_bytes, t.source, fp))
                )
        due = [t.next_t for t in self.tracked.values() if not t.killed]
        wake = min([*due, self._next_discovery]) if due else self._next_discovery
        return max(wake - now, 0.0)

    def _discover(
        self,
        now: float,
        rules: EngineRules,
        scope: Scope,
        config_budgets: Sequence[tuple[int, re.Pattern[str]]],
        launched: Sequence[Declaration],
        *,
        peer: Mapping[TreeKey, tuple[int, int]],
        containers: ContainerNotes = NO_NOTES,
    ) -> None:
        self._next_discovery = now + DISCOVER_EVERY_S
        by_key = {d.tree_key: d for d in launched}
        declared = {d.tree_key: (d.kind, d.uid) for d in launched}
        procs = self.scanner.scan().procs
        self.scans_total += 1
        seen: set[TreeKey] = set()
        launchers = {d.tree_key: d.launcher_pid for d in launched}
        for tree in find_engine_trees(procs, rules, scope, declared=declared, launchers=launchers):
            key = tree.root.key
            decl = by_key.get(key)
            if decl is not None and decl.uid != tree.root.uid:
                decl = None  # a declaration speaks only for its own uid's process: never another user's budget
            budget, source = (decl.budget_bytes, "launch") if decl is not None and decl.budget_bytes else (None, "")
            told = peer.get(key)
            if budget is None and told is not None and told[0] == tree.root.uid:  # that very process, its own user's
                budget, source = told[1], "peer"
            ref = tree.container if containers else None  # the id in its own cgroup path, never telemetry's word
            if budget is None and ref is not None and ref.id in containers.budgets:
                budget, source = containers.budgets[ref.id], "label"
            if budget is None:
                budget, source = first_match(tree, config_budgets), "config"
            if budget is None:
                continue
            if ref is not None and ref.id in containers.protected:
                self._say_protected(tree, containers.by_id[ref.id].label(with_id=True), source)
                continue
            seen.add(key)
            old = self.tracked.get(key)
            if old is None:
                self.tracked[key] = Tracked(key, tree, budget, source, decl)
            else:
                old.tree, old.budget_bytes, old.source, old.decl = tree, budget, source, decl
        for key in list(self.tracked):
            if key not in seen and not self.tracked[key].killed:
                del self.tracked[key]
            elif key not in seen and self.tracked[key].killed:
                del self.tracked[key]  # its kill is the reaper's now

    def _footprint(
        self, t: Tracked, now: float, available_bytes: int, gpu: GpuBytes | None, *, sole_booting: bool
    ) -> tuple[Footprint, int]:
        rss, gone = read_member_rss(self.proc_root, t.tree.members)
        gpu_bytes = gpu_age = None
        if gpu is not None:
            taken_at, by_pid = gpu
            gpu_age = now - taken_at
            gpu_bytes = sum(by_pid.get(p.pid, 0) for p in t.tree.members)
        decl = t.decl
        declared = (decl.cgroup, decl.container) if decl is not None else (None, "")
        cgroup = read_memory_current(owned_scope(t.tree.root.cgroup, *declared))
        drop = None
        if decl is not None and decl.booting and sole_booting and decl.available_at_launch_bytes:
            drop = max(decl.available_at_launch_bytes - available_bytes, 0)
        inputs = FootprintInputs(rss, gpu_bytes, gpu_age, cgroup, drop)
        return footprint(inputs), gone

    def _warn(self, t: Tracked, fp: Footprint, limit: int) -> None:
        share = fp.warn_bytes / t.budget_bytes
        if fp.warn_source == FootprintSource.POOL_DROP:
            # The pool's drop holds everything else on the box too: a warning, never the kill's reason.
            summary = (
                f"{t.tree.kind} {t.name!r} (root pid {t.key[0]}) is booting and the pool fell by "
                f"{format_size(fp.warn_bytes)} since its launch, {share:.0%} of its budget "
                f"{format_size(t.budget_bytes)} ({t.source}); the tree itself holds {format_size(fp.bytes)} "
                f"({fp.source}), and only that, past {format_size(limit)}, is a kill."
            )
        else:
            summary = (
                f"{t.tree.kind} {t.name!r} (root pid {t.key[0]}) holds {format_size(fp.bytes)}, {share:.0%} of its "
                f"budget {format_size(t.budget_bytes)} ({t.source}); past {format_size(limit)} the guard kills it."
            )
        fields: dict[str, object] = {
            "engine": t.tree.kind,
            "root_pid": t.key[0],
            "name": t.name,
            "budget_bytes": t.budget_bytes,
            "footprint_bytes": fp.bytes,
            "footprint_source": str(fp.source),
            "pool_drop_bytes": fp.pool_drop_bytes,
            "budget_source": t.source,
        }
        self.event(EventKind.BUDGET_NEAR, summary, fields, logging.WARNING, f"sparkwatch: WARNING {summary}")

    def _say_protected(self, tree: EngineTree, container: str, source: str) -> None:
        key = tree.root.key
        if key in self._said_protected or self.line is None:
            return
        if len(self._said_protected) >= 256:
            self._said_protected.clear()
        self._said_protected.add(key)
        self.line(
            logging.WARNING,
            f"sparkwatch: budget: {tree.kind} tree root={tree.root.pid} in {container} is protected "
            f"({LABEL_PROTECT}=true): its budget ({source}) is not enforced, and the guard never kills it",
        )

    def forget(self, key: TreeKey) -> None:
        self.tracked.pop(key, None)
