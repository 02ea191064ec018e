"""A custom prometheus_client Collector over the latest Snapshot and the guard's counters.

Scrape-time work is rendering only: no /proc, NVML or disk I/O. The Snapshot is taken once per scrape (one reference
read, so a scrape never mixes two cycles), and the guard's counters are copied under the lock of the RemoteGuard
that holds the guard process's last `state` message (telemetry.remote): a scrape sees one message, never half.

Names, types and labels are the contract in sparkwatch/telemetry/exporter/contract.py (tests hold this to it);
`promtool check metrics` lints the output in the tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client.metrics_core import (
    Metric,
)
from prometheus_client.registry import Collector

from sparkwatch import __version__
from sparkwatch.common.guardconfig import GuardConfig
from sparkwatch.common.stats import GROUP_TEARDOWN_BUCKETS_S, KILL_DURATION_BUCKETS_S, GuardStats, KernelLogStats
from sparkwatch.config.defaults import Derived
from sparkwatch.core.driver.nvrm import NVRM_KINDS, XID_CATALOGUE
from sparkwatch.core.engines.compile import TOOLS
from sparkwatch.core.enums import JitState, MaxJobsState
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.launch.bootphase import BootPhase
from sparkwatch.core.model import DriverReport, GpuReport, MemInfo, Snapshot
from sparkwatch.telemetry.exporter.families import counter, dropped_total, gauge, histogram
from sparkwatch.telemetry.exporter.gpu import gpu_families

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings

    # The keys the collector reads live: telemetry's settings (RemoteGuard; pydantic's Settings or the guard's wire
    # values, both Derived) or, with the pool watch in the same process, its GuardConfig; all name them alike.
    LiveConfig = Settings | GuardConfig

# Every trigger of core.kill.triggers, exported at 0 so increase() sees the first kill (or, in dry run, the first
# would-kill) of each from the start: SparkwatchGuardKilled relies on it. Read from the enum: a list typed here once
# lacked `wedged`, so the first wedged kill after a start fired no alert.
GUARD_TRIGGERS: tuple[str, ...] = tuple(Trigger)


class GuardLike(Protocol):
    stats: GuardStats
    lock: threading.Lock


class KernelLogLike(Protocol):
    stats: KernelLogStats
    lock: threading.Lock


class EventLogLike(Protocol):
    write_errors_total: int


class OutboxLike(Protocol):
    delivered_total: int
    failed_attempts_total: int
    spool_errors_total: int
    dropped_total: int
    quarantined_total: int
    worker_restarts_total: int
    last_delivery_timestamp_s: float | None

    @property
    def pending(self) -> int: ...


def _guard_copy(guard: GuardLike | None) -> tuple[GuardStats | None, LiveConfig | None]:
    """The guard's counters and its live settings (SIGHUP may change floor, warn headroom, dry run), under its lock."""
    if guard is None:
        return None, None
    with guard.lock:  # a handful of field copies: the guard never waits on a scrape for longer than that
        out = guard.stats.snapshot()
        settings = getattr(guard, "settings", None) or getattr(guard, "config", None)
    return out, settings


def _le(edge: float) -> str:
    return "+Inf" if edge == float("inf") else repr(float(edge))


def _histogram(name: str, edges: tuple[float, ...], counts: list[int], sum_s: float) -> Metric:
    """A histogram family from per-bucket counts (common.stats keeps them so; the last is +Inf)."""
    buckets = []
    cumulative = 0
    for edge, count in zip((*edges, float("inf")), counts, strict=True):
        cumulative += count
        buckets.append((_le(edge), cumulative))
    return histogram(name, buckets=buckets, sum_value=sum_s)


class SparkwatchCollector(Collector):
    def __init__(
        self,
        latest: Callable[[], Snapshot | None],
        *,
        settings: Settings,
        guard: GuardLike | None = None,
        events: EventLogLike | None = None,
        outbox: OutboxLike | None = None,
        kernel_log: KernelLogLike | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.latest = latest
        self.outbox = outbox
        self.settings = settings  # what was configured at start; the guard's own copy wins once there is a guard
        self.guard = guard
        self.events = events
        self.kernel_log = kernel_log if kernel_log is not None else getattr(guard, "kernlog", None)
        self.monotonic = monotonic
        self.wall_clock = wall_clock

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked registration: the families depend on what the snapshot holds

    def collect(self) -> Iterator[Metric]:
        snap = self.latest()
        stats, live = _guard_copy(self.guard)
        yield from self._families(snap, stats, live if isinstance(live, Derived | GuardConfig) else self.settings)
        # Last: it counts what the families above left out in this scrape too (telemetry.exporter.families).
        yield counter("metrics_series_dropped", value=dropped_total())

    # --- rendering
    def _families(self, snap: Snapshot | None, stats: GuardStats | None, settings: LiveConfig) -> Iterator[Metric]:
        info = gauge("build_info", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield from self._memory(self._freshest_mem(snap, stats), snap, stats, settings)
        if stats is not None:
            yield from self._guard(stats, settings.dry_run)
        if self.kernel_log is not None:
            yield from _kernel_log_families(self.kernel_log)
        if self.events is not None:
            yield counter(
                "event_log_write_errors",
                value=self.events.write_errors_total,
            )
        if self.outbox is not None:
            yield from _outbox_families(self.outbox)
        if snap is None:
            return
        yield from self._engines(snap)
        yield from _boot_families(snap)
        yield from _serving_families(snap)
        yield from self._compile(snap)
        yield from self._jit(snap)
        success = gauge("collector_success", labels=["collector"])
        duration = gauge("collector_duration_seconds", labels=["collector"])
        for status in snap.collectors:
            success.add_metric([status.name], 1 if status.success else 0)
            duration.add_metric([status.name], status.duration_s)
        yield success
        yield duration
        yield gauge(
            "telemetry_last_cycle_timestamp_seconds",
            value=snap.ts,
        )
        yield from gpu_families(snap.gpu)
        if snap.driver is not None:
            yield from _driver_families(snap.driver)

    def _freshest_mem(self, snap: Snapshot | None, stats: GuardStats | None) -> MemInfo | None:
        """The newer of two meminfo readings: the guard's (sent on change, four times a second near the floor) and
        telemetry's own (each cycle)."""
        guard_mem = stats.mem if stats is not None else None
        own_mem = snap.mem if snap is not None else None
        if guard_mem is None or own_mem is None or snap is None or stats is None:
            return guard_mem or own_mem
        guard_age_s = self.monotonic() - stats.last_loop_monotonic
        own_age_s = self.wall_clock() - snap.ts
        return guard_mem if guard_age_s <= own_age_s else own_mem

    def _memory(
        self, mem: MemInfo | None, snap: Snapshot | None, stats: GuardStats | None, settings: LiveConfig
    ) -> Iterator[Metric]:
        if mem is not None:
            for name, value in (
                ("total", mem.total_bytes),
                ("available", mem.available_bytes),
                ("free", mem.free_bytes),
                ("cached", mem.cached_bytes),
                ("used", mem.used_bytes),
            ):
                yield gauge(f"memory_{name}_bytes", value=value)
        yield gauge("memory_floor_bytes", value=settings.floor)
        yield gauge(
            "memory_warn_headroom_bytes",
            value=settings.warn_headroom,
        )
        if stats is not None:
            yield gauge(
                "memory_fill_rate_bytes_per_second",
                value=stats.fill_rate_bytes_per_s,
            )
        if snap is not None and snap.free_contiguous:
            contiguous = gauge(
                "memory_free_contiguous_bytes",
                labels=["min_block"],
            )
            for label, size in snap.free_contiguous:
                contiguous.add_metric([label], size)
            yield contiguous
        if snap is not None and snap.shm is not None and snap.shm.certain:  # an uncertain count is not known: absent
            yield gauge("shm_orphaned_bytes", value=snap.shm.held_bytes)
            yield gauge("shm_orphaned_files", value=len(snap.shm.orphans))
        if snap is not None and snap.psi is not None:
            psi = counter(
                "memory_pressure_stalled_seconds",
                labels=["kind"],
            )
            psi.add_metric(["some"], snap.psi.some_us / 1e6)
            if snap.psi.full_us is not None:
                psi.add_metric(["full"], snap.psi.full_us / 1e6)
            yield psi

    def _guard(self, s: GuardStats, dry_run: bool) -> Iterator[Metric]:
        yield gauge("guard_poll_interval_seconds", s.poll_interval_s)
        kills = counter("guard_kills", labels=["trigger"])
        for trigger in sorted(set(GUARD_TRIGGERS) | set(s.kills_total)):
            kills.add_metric([trigger], s.kills_total.get(trigger, 0))
        yield kills
        # A dry run's decisions: their own counter, so no rule or panel that reads kills sees one that never happened.
        would = counter("guard_would_kills", labels=["trigger"])
        for trigger in sorted(set(GUARD_TRIGGERS) | set(s.would_kills_total)):
            would.add_metric([trigger], s.would_kills_total.get(trigger, 0))
        yield would
        yield counter("guard_killed_processes", value=s.killed_processes_total)
        if s.last_kill_timestamp_s is not None:
            yield gauge(
                "guard_last_kill_timestamp_seconds",
                value=s.last_kill_timestamp_s,
            )
        yield _histogram("guard_kill_duration_seconds", KILL_DURATION_BUCKETS_S, s.kill_duration_bucket_counts,
                         s.kill_duration_sum_s)  # fmt: skip
        yield _histogram("guard_group_teardown_duration_seconds", GROUP_TEARDOWN_BUCKETS_S,
                         s.group_teardown_bucket_counts, s.group_teardown_sum_s)  # fmt: skip
        yield gauge("guard_dry_run", 1 if dry_run else 0)
        yield gauge(
            "guard_armed",
            int(s.armed),
        )
        yield counter(
            "guard_kills_cancelled",
            value=s.cancelled_total,
        )
        yield counter(
            "guard_kill_loops",
            value=s.kill_loops_total,
        )
        yield counter("guard_meminfo_errors", value=s.meminfo_errors_total)
        yield from _budget_families(s)
        if s.last_loop_monotonic:
            yield gauge(
                "guard_loop_age_seconds",
                value=max(0.0, self.monotonic() - s.last_loop_monotonic),
            )

    def _engines(self, snap: Snapshot) -> Iterator[Metric]:
        procs = gauge("engine_processes", labels=["engine"])
        rss = gauge("engine_rss_bytes", labels=["engine"])
        by_kind: dict[str, list[int]] = {}
        owner: dict[int, str] = {}
        for tree in snap.engines:
            agg = by_kind.setdefault(tree.kind, [0, 0])
            agg[0] += len(tree.members)
            agg[1] += tree.rss_bytes
            for pid in tree.pids:
                owner[pid] = tree.kind
        for kind, (count, size) in sorted(by_kind.items()):
            procs.add_metric([kind], count)
            rss.add_metric([kind], size)
        yield procs
        yield rss
        if snap.gpu is not None and snap.gpu.up:
            # NVML's per-process GPU memory summed per engine tree ('other': processes in no engine tree). The GPU
            # part exports it per pid as sparkwatch_gpu_process_memory_bytes; this is the same bytes by engine.
            gpu_mem = gauge(
                "engine_gpu_memory_bytes",
                labels=["engine"],
            )
            per: dict[str, int] = {}
            for pid, used in _gpu_processes(snap.gpu):
                kind = owner.get(pid, "other")
                per[kind] = per.get(kind, 0) + used
            for kind, used in sorted(per.items()):
                gpu_mem.add_metric([kind], used)
            yield gpu_mem
            # GPU holders no engine rule names: what the guard would not kill (unless guard_gpu_holders is on).
            # Two series, no per-process labels: the pids and names are in `sparkwatch engines --all` and `status`.
            yield gauge(
                "gpu_unknown_holders",
                value=len(snap.gpu_unknown),
            )
            yield gauge(
                "gpu_unknown_holder_memory_bytes",
                value=sum(h.used_gpu_memory_bytes or 0 for h in snap.gpu_unknown),
            )

    def _compile(self, snap: Snapshot) -> Iterator[Metric]:
        c = snap.compile
        if c is None:
            return
        tools = gauge("compile_processes", labels=["tool"])
        for tool in TOOLS:
            tools.add_metric([tool], c.tools.get(tool, 0))
        yield tools
        yield gauge("compile_rss_bytes", value=c.rss_bytes)
        yield gauge("compile_parallel_jobs", value=c.parallel_jobs)
        arch = gauge("compile_arch_processes", labels=["arch"])
        for name, count in c.archs.items():
            arch.add_metric([name], count)
        yield arch
        per_engine = gauge("compile_engine_processes", labels=["engine", "pid"])
        max_jobs = gauge(
            "compile_max_jobs",
            labels=["engine", "pid", "state"],
        )
        for e in c.engines:
            per_engine.add_metric([e.kind, str(e.root_pid)], sum(e.tools.values()))
            for state in MaxJobsState:
                max_jobs.add_metric([e.kind, str(e.root_pid), state], 1 if e.max_jobs_state == state else 0)
        yield per_engine
        yield max_jobs
        yield gauge(
            "compile_outside_engine_processes",
            value=c.outside_engines,
        )

    def _jit(self, snap: Snapshot) -> Iterator[Metric]:
        labels = ["cache", "version", "arch"]
        size = gauge("jit_cache_bytes", labels=labels)
        files = gauge("jit_cache_files", labels=labels)
        changed = gauge(
            "jit_cache_last_change_timestamp_seconds",
            labels=labels,
        )
        objects = gauge("jit_build_objects", labels=[*labels, "state"])
        modules = gauge("jit_build_modules", labels=[*labels, "state"])
        for j in snap.jit:
            key = [j.cache, j.version, j.arch]
            size.add_metric(key, j.bytes)
            files.add_metric(key, j.files)
            changed.add_metric(key, j.last_change_ts)
            objects.add_metric([*key, "done"], j.objects_done)
            objects.add_metric([*key, "total"], j.objects_total)
            modules.add_metric([*key, "built"], j.modules_built)
            modules.add_metric([*key, "total"], j.modules_total)
        yield size
        yield files
        yield changed
        yield objects
        yield modules
        state = gauge("jit_state", labels=["engine", "pid", "state"])
        for e in snap.jit_states:
            for name in JitState:
                state.add_metric([e.kind, str(e.root_pid), name], 1 if e.state == name else 0)
        yield state


_PHASES = tuple(p for p in BootPhase if p != BootPhase.EXITED)


def _boot_families(snap: Snapshot) -> Iterator[Metric]:
    """Each launched engine's boot phase (a state set) and when it entered it: the dashboard's boot timeline."""
    if not snap.boots:
        return
    phase = gauge("engine_boot_phase", labels=["engine", "pid", "model", "phase"])
    since = gauge("engine_boot_phase_since_timestamp_seconds", labels=["engine", "pid", "model"])
    ready = gauge("engine_ready_seconds", labels=["engine", "pid", "model"])
    any_ready = False
    for b in snap.boots:
        key = [b.kind, str(b.root_pid), b.model]
        for name in _PHASES:
            phase.add_metric([*key, name], 1 if b.phase == name else 0)
        since.add_metric(key, b.phase_since_ts)
        if b.ready_s is not None:
            ready.add_metric(key, b.ready_s)
            any_ready = True
    yield phase
    yield since
    if any_ready:
        yield ready


def _serving_families(snap: Snapshot) -> Iterator[Metric]:
    """Per probed engine: serving (1/0, absent while booting, not listening or not probed), the last good probe's
    latency, and the failures in a row (telemetry/probewatch.py)."""
    # not probed yet, booting, not listening, or its socket out of reach (not_probed): absent
    probed = [e for e in snap.serving if e.state not in ("unknown", "not_probed")]
    if not probed:
        return
    serving = gauge("engine_serving", labels=["engine", "pid"])
    latency = gauge("engine_probe_latency_seconds", labels=["engine", "pid"])
    failures = gauge("engine_probe_failures", labels=["engine", "pid"])
    counted = gauge("engine_progress_counters", labels=["engine", "pid"])
    for e in probed:
        key = [e.kind, str(e.root_pid)]
        if e.state in ("serving", "busy"):  # busy: the probe waited while its own counters moved
            serving.add_metric(key, 1)
        elif e.state in ("failing", "wedged"):
            serving.add_metric(key, 0)
        if e.latency_s is not None:
            latency.add_metric(key, e.latency_s)
        failures.add_metric(key, e.failures)
        if e.counted is not None:
            counted.add_metric(key, 1 if e.counted else 0)
    yield serving
    yield latency
    yield failures
    if counted.samples:  # looked at only after a failed probe
        yield counted


def _budget_families(s: GuardStats) -> Iterator[Metric]:
    """Budget and footprint per budgeted engine tree, as the guard last measured them (guard.budgets)."""
    if not s.budgets:
        return
    budget = gauge("engine_budget_bytes", labels=["engine", "pid", "name", "source"])
    footprint = gauge("engine_footprint_bytes", labels=["engine", "pid", "name"])
    peak = gauge("engine_footprint_peak_bytes", labels=["engine", "pid", "name"])
    for b in s.budgets:
        key = [b.kind, str(b.root_pid), b.name]
        budget.add_metric([*key, b.budget_source], b.budget_bytes)
        if b.footprint_bytes is not None:
            footprint.add_metric(key, b.footprint_bytes)
        peak.add_metric(key, b.peak_bytes)
    yield budget
    yield footprint
    yield peak


def _gpu_processes(gpu: GpuReport) -> list[tuple[int, int]]:
    """(pid, used bytes) from the GPU report; a process whose share NVML does not know is left out, not 0."""
    return [(p.pid, p.used_gpu_memory_bytes) for p in gpu.processes if p.used_gpu_memory_bytes is not None]


def _driver_families(d: DriverReport) -> Iterator[Metric]:
    """The drift verdict: driver_stranded, driver_next_boot_ok, reboot_required, driver_info."""
    yield gauge(
        "driver_stranded",
        value=int(d.stranded),
    )
    if d.next_boot_ok is not None:
        yield gauge("driver_next_boot_ok", value=int(d.next_boot_ok))
    yield gauge("reboot_required", value=int(d.reboot_required))
    yield gauge(
        "driver_version_mismatch",
        value=int(d.version_mismatch),
    )
    info = gauge(
        "driver_info",
        labels=["kernel", "module_version", "loaded_version", "library_version", "verdict"],
    )
    info.add_metric(
        [
            d.running_kernel or "",
            d.module_version or "",
            d.loaded_version or "",
            d.library_version or "",
            d.verdict,
        ],
        1,
    )
    yield info


def _kernel_log_families(source: KernelLogLike) -> Iterator[Metric]:
    """NVRM and Xid lines from /dev/kmsg (loops.kernlog). Known kinds and catalogued Xid codes are exported at 0."""
    with source.lock:
        s = source.stats
        readable, lines, dropped, injected = s.readable, s.lines_total, s.dropped_total, s.injected_ignored_total
        nvrm, xids = dict(s.nvrm_errors_total), dict(s.xid_total)
    yield gauge(
        "kernel_log_readable",
        value=int(readable),
    )
    yield counter("kernel_log_lines", value=lines)
    yield counter(
        "kernel_log_dropped_lines",
        value=dropped,
    )
    yield counter(
        "kernel_log_injected_lines",
        value=injected,
    )
    errors = counter(
        "kernel_nvrm_errors",
        labels=["kind"],
    )
    for kind in sorted(set(NVRM_KINDS) | set(nvrm)):
        errors.add_metric([kind], nvrm.get(kind, 0))
    yield errors
    xid = counter("kernel_xid", labels=["code"])
    for code in sorted(set(XID_CATALOGUE) | set(xids)):
        xid.add_metric([str(code)], xids.get(code, 0))
    yield xid


def _outbox_families(box: OutboxLike) -> Iterator[Metric]:
    """The webhook outbox: a receiver that is down shows as pending alerts and climbing failures, never as silence."""
    yield gauge("alerts_pending", box.pending)
    yield counter("alerts_delivered", box.delivered_total)
    yield counter("alert_delivery_failures", box.failed_attempts_total)
    yield counter("alert_spool_errors", box.spool_errors_total)
    yield counter("alerts_dropped", box.dropped_total)
    yield counter(
        "alert_spool_quarantined",
        box.quarantined_total,
    )
    yield counter("alert_outbox_restarts", box.worker_restarts_total)
    if box.last_delivery_timestamp_s is not None:
        yield gauge(
            "alert_last_delivery_timestamp_seconds",
            box.last_delivery_timestamp_s,
        )
