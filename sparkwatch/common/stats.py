"""The guard process's counters, as the guard keeps them and as the channel carries them to the exporter.

The guard loop and reaper update `GuardStats`, the kernel-log hook `KernelLogStats`, each under its owner's lock; the
guard process sends copies in every `state` message (common.messages), and the telemetry process renders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sparkwatch.core.driver import nvrm as core
from sparkwatch.core.model import MemInfo

# Bucket edges for guard_kill_duration_seconds (detect -> last member reaped). Target: median <= 150 ms.
KILL_DURATION_BUCKETS_S = (0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Bucket edges for guard_group_teardown_duration_seconds (the death in Ray's state -> this node's members reaped).
# Goal: <= 5 s; Ray's own poll and state API make up most of it (median 0.41 s on the two-node test cluster).
GROUP_TEARDOWN_BUCKETS_S = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class BudgetStat:
    """One budgeted engine tree as the guard last measured it (guard.budgets): exported per engine by telemetry."""

    root_pid: int
    kind: str
    name: str
    budget_bytes: int
    footprint_bytes: int | None
    footprint_source: str | None
    peak_bytes: int
    budget_source: str  # "launch" | "config" | "peer" (another node's launch: guard.budgets)
    # (pid, start_ticks) of the tree's members while its footprint is at core.kill.budget.GPU_FAST_RATIO of its budget
    # or more: telemetry samples their GPU bytes at FAST_PERIOD_S (telemetry/gpufast.py). Empty: the cycle's reading
    # does.
    gpu_watch: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RecentKill:
    """One kill as the guard decided it, at the signal (the event follows after the reap and settle, a second or
    more later): what the node's agent tells its peers (telemetry.peerdoc)."""

    ts: float  # wall clock of the signal
    trigger: str
    reason: str  # core.kill.killrecord.kill_reason
    pids: tuple[int, ...]  # the processes signalled


RECENT_KILLS = 16


@dataclass
class GuardStats:
    """Counters the guard and reaper update and the exporter reads (under the lock)."""

    mem: MemInfo | None = None
    fill_rate_bytes_per_s: float = 0.0
    poll_interval_s: float = 0.0
    armed: bool = True
    kills_total: dict[str, int] = field(default_factory=dict)  # trees signalled, by trigger; never in dry run
    would_kills_total: dict[str, int] = field(default_factory=dict)  # dry run: trees chosen and not signalled
    killed_processes_total: int = 0
    last_kill_timestamp_s: float | None = None
    kill_duration_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(KILL_DURATION_BUCKETS_S) + 1))
    kill_duration_sum_s: float = 0.0
    group_teardown_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(GROUP_TEARDOWN_BUCKETS_S) + 1))
    group_teardown_sum_s: float = 0.0
    meminfo_errors_total: int = 0
    last_error: str | None = None
    last_loop_monotonic: float = 0.0
    psi_trigger: bool = False
    phase: str = "watch"
    cancelled_total: int = 0
    kill_loops_total: int = 0
    budgets: list[BudgetStat] = field(default_factory=list)
    recent_kills: list[RecentKill] = field(default_factory=list)  # the last RECENT_KILLS, oldest first

    def snapshot(self) -> GuardStats:
        """A copy that shares nothing mutable (taken under the owner's lock, read or sent after it)."""
        return replace(
            self,
            kills_total=dict(self.kills_total),
            would_kills_total=dict(self.would_kills_total),
            kill_duration_bucket_counts=list(self.kill_duration_bucket_counts),
            group_teardown_bucket_counts=list(self.group_teardown_bucket_counts),
            budgets=list(self.budgets),
            recent_kills=list(self.recent_kills),
        )

    def count_kill(self, trigger: str, dry_run: bool, processes: int, wall_s: float) -> None:
        """One decided kill: a kill, or in dry run a would-kill. A dry run moves no kill counter and no last-kill
        time, so nothing that alerts on kills (SparkwatchGuardKilled, the TP-peer rule) fires for a kill that
        never happened."""
        if dry_run:
            self.would_kills_total[trigger] = self.would_kills_total.get(trigger, 0) + 1
            return
        self.kills_total[trigger] = self.kills_total.get(trigger, 0) + 1
        self.killed_processes_total += processes
        self.last_kill_timestamp_s = wall_s

    def remember_kill(self, kill: RecentKill) -> None:
        self.recent_kills = [*self.recent_kills[-(RECENT_KILLS - 1) :], kill]

    def observe_kill_duration(self, seconds: float) -> None:
        _observe(self.kill_duration_bucket_counts, KILL_DURATION_BUCKETS_S, seconds)
        self.kill_duration_sum_s += seconds

    def observe_group_teardown(self, seconds: float) -> None:
        _observe(self.group_teardown_bucket_counts, GROUP_TEARDOWN_BUCKETS_S, seconds)
        self.group_teardown_sum_s += seconds


def _observe(counts: list[int], edges: tuple[float, ...], value: float) -> None:
    """One observation into a histogram's per-bucket (not cumulative) counts; the last is +Inf."""
    for i, edge in enumerate(edges):
        if value <= edge:
            counts[i] += 1
            return
    counts[-1] += 1


@dataclass
class KernelLogStats:
    """What the exporter reads (under `lock`)."""

    readable: bool = False
    reason: str | None = None
    lines_total: int = 0
    dropped_total: int = 0
    nvrm_errors_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(core.NVRM_KINDS, 0))
    xid_total: dict[int, int] = field(default_factory=dict)
    corroborated_fires_total: int = 0
    events_dropped_total: int = 0
    injected_ignored_total: int = 0  # NVRM lines a process wrote into the kernel log, ignored (not the driver's)
    recent_xids: list[tuple[float, int, str]] = field(default_factory=list)  # (wall time, code, name), last 16

    def snapshot(self) -> KernelLogStats:
        """A copy that shares nothing mutable (taken under the owner's lock)."""
        return replace(
            self,
            nvrm_errors_total=dict(self.nvrm_errors_total),
            xid_total=dict(self.xid_total),
            recent_xids=list(self.recent_xids),
        )
