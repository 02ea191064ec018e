"""A custom prometheus_client Collector over the latest Snapshot and the guard's counters.

Scrape-time work is rendering only: no /proc, NVML or disk I/O. The Snapshot is taken once per scrape (one reference
read, so a scrape never mixes two cycles), and the guard's counters are copied under its lock, which the guard holds
only for a few field assignments: a scrape during a kill sees the counters before or after it, never half.

Names, types and labels are the contract in sparkwatch/exporter/contract.py (tests hold this to it);
`promtool check metrics` lints the output in the tests.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sparkwatch import __version__
from sparkwatch.config import Settings
from sparkwatch.core.compile import TOOLS
from sparkwatch.core.kernlog import NVRM_KINDS, XID_CATALOGUE
from sparkwatch.core.states import JitState, MaxJobsState
from sparkwatch.exporter.gpu import gpu_families
from sparkwatch.loops.guard import KILL_DURATION_BUCKETS_S, GuardStats
from sparkwatch.loops.kernlog import KernelLogStats
from sparkwatch.model import DriverReport, GpuReport, MemInfo, Snapshot

P = "sparkwatch_"
# core.guard's triggers and core.kernlog's: exported at 0 so rate() works from the start
GUARD_TRIGGERS = ("floor", "predicted", "driver_alloc_failed")


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


def _guard_copy(guard: GuardLike | None) -> tuple[GuardStats | None, Settings | None]:
    """The guard's counters and its live settings (SIGHUP may change floor, warn headroom, dry run), under its lock."""
    if guard is None:
        return None, None
    with guard.lock:  # a handful of field copies: the guard never waits on a scrape for longer than that
        stats = guard.stats
        out = copy.copy(stats)
        out.kills_total = dict(stats.kills_total)
        out.kill_duration_bucket_counts = list(stats.kill_duration_bucket_counts)
        settings = getattr(guard, "settings", None)
    return out, settings


def _le(edge: float) -> str:
    return "+Inf" if edge == float("inf") else repr(float(edge))


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
    ) -> None:
        self.latest = latest
        self.outbox = outbox
        self.settings = settings  # what was configured at start; the guard's own copy wins once there is a guard
        self.guard = guard
        self.events = events
        self.kernel_log = kernel_log if kernel_log is not None else getattr(guard, "kernlog", None)
        self.monotonic = monotonic

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked registration: the families depend on what the snapshot holds

    def collect(self) -> Iterator[Metric]:
        snap = self.latest()
        stats, live = _guard_copy(self.guard)
        yield from self._families(snap, stats, live if isinstance(live, Settings) else self.settings)

    # --- rendering
    def _families(self, snap: Snapshot | None, stats: GuardStats | None, settings: Settings) -> Iterator[Metric]:
        info = GaugeMetricFamily(P + "build_info", "sparkwatch version, always 1", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        mem: MemInfo | None = stats.mem if stats is not None and stats.mem is not None else None
        if mem is None and snap is not None:
            mem = snap.mem
        yield from self._memory(mem, snap, stats, settings)
        if stats is not None:
            yield from self._guard(stats, settings.dry_run)
        if self.kernel_log is not None:
            yield from _kernel_log_families(self.kernel_log)
        if self.events is not None:
            yield CounterMetricFamily(
                P + "event_log_write_errors",
                "Events that could not be made durable in events.jsonl (unwritable or full state dir)",
                value=self.events.write_errors_total,
            )
        if self.outbox is not None:
            yield from _outbox_families(self.outbox)
        if snap is None:
            return
        yield from self._engines(snap)
        yield from self._compile(snap)
        yield from self._jit(snap)
        success = GaugeMetricFamily(P + "collector_success", "1 if the source worked this cycle", labels=["collector"])
        duration = GaugeMetricFamily(
            P + "collector_duration_seconds", "Time the source took this cycle", labels=["collector"]
        )
        for status in snap.collectors:
            success.add_metric([status.name], 1 if status.success else 0)
            duration.add_metric([status.name], status.duration_s)
        yield success
        yield duration
        yield GaugeMetricFamily(
            P + "telemetry_last_cycle_timestamp_seconds", "When the telemetry cycle served here finished", value=snap.ts
        )
        yield from gpu_families(snap.gpu)
        if snap.driver is not None:
            yield from _driver_families(snap.driver)

    def _memory(
        self, mem: MemInfo | None, snap: Snapshot | None, stats: GuardStats | None, settings: Settings
    ) -> Iterator[Metric]:
        if mem is not None:
            for name, value, text in (
                ("total", mem.total_bytes, "MemTotal: the unified CPU+GPU pool"),
                ("available", mem.available_bytes, "MemAvailable: what the guard compares with the floor"),
                ("free", mem.free_bytes, "MemFree"),
                ("cached", mem.cached_bytes, "Cached (page cache)"),
                ("used", mem.used_bytes, "MemTotal - MemAvailable: the honest used figure on a unified pool"),
            ):
                yield GaugeMetricFamily(f"{P}memory_{name}_bytes", text, value=value)
        yield GaugeMetricFamily(P + "memory_floor_bytes", "The guard's MemAvailable kill floor", value=settings.floor)
        yield GaugeMetricFamily(
            P + "memory_warn_headroom_bytes",
            "low_headroom alerts when MemAvailable is within this of the floor",
            value=settings.warn_headroom,
        )
        if stats is not None:
            yield GaugeMetricFamily(
                P + "memory_fill_rate_bytes_per_second",
                "Smoothed rate at which MemAvailable falls (positive: filling)",
                value=stats.fill_rate_bytes_per_s,
            )
        if snap is not None and snap.free_contiguous:
            contiguous = GaugeMetricFamily(
                P + "memory_free_contiguous_bytes",
                "Free memory in blocks of at least min_block (/proc/buddyinfo): what a large driver allocation can get",
                labels=["min_block"],
            )
            for label, size in snap.free_contiguous:
                contiguous.add_metric([label], size)
            yield contiguous
        if snap is not None and snap.psi is not None:
            psi = CounterMetricFamily(
                P + "memory_pressure_stalled_seconds",
                "Cumulative time tasks stalled on memory (PSI), some or all non-idle tasks",
                labels=["kind"],
            )
            psi.add_metric(["some"], snap.psi.some_us / 1e6)
            if snap.psi.full_us is not None:
                psi.add_metric(["full"], snap.psi.full_us / 1e6)
            yield psi

    def _guard(self, s: GuardStats, dry_run: bool) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            P + "guard_poll_interval_seconds", "The guard's current poll interval", s.poll_interval_s
        )
        kills = CounterMetricFamily(P + "guard_kills", "Kills of engine trees, by trigger", labels=["trigger"])
        for trigger in sorted(set(GUARD_TRIGGERS) | set(s.kills_total)):
            kills.add_metric([trigger], s.kills_total.get(trigger, 0))
        yield kills
        yield CounterMetricFamily(
            P + "guard_killed_processes", "Processes SIGKILLed by the guard", value=s.killed_processes_total
        )
        if s.last_kill_timestamp_s is not None:
            yield GaugeMetricFamily(
                P + "guard_last_kill_timestamp_seconds", "When the guard last fired", value=s.last_kill_timestamp_s
            )
        buckets = []
        cumulative = 0
        edges = (*KILL_DURATION_BUCKETS_S, float("inf"))
        for edge, count in zip(edges, s.kill_duration_bucket_counts, strict=True):
            cumulative += count
            buckets.append((_le(edge), cumulative))
        yield HistogramMetricFamily(
            P + "guard_kill_duration_seconds",
            "From detection to the last victim reaped",
            buckets=buckets,
            sum_value=s.kill_duration_sum_s,
        )
        yield GaugeMetricFamily(P + "guard_dry_run", "1 if the guard decides but signals nothing", 1 if dry_run else 0)
        yield GaugeMetricFamily(
            P + "guard_armed",
            "0 during a kill episode (until memory is back above floor + rearm_headroom)",
            int(s.armed),
        )
        yield CounterMetricFamily(
            P + "guard_kills_cancelled",
            "Firings cancelled because MemAvailable recovered between the decision and the signal",
            value=s.cancelled_total,
        )
        yield CounterMetricFamily(
            P + "guard_kill_loops",
            "Kill loops detected (an engine restarted into the same spike)",
            value=s.kill_loops_total,
        )
        yield CounterMetricFamily(
            P + "guard_meminfo_errors", "/proc/meminfo reads or parses that failed", value=s.meminfo_errors_total
        )
        if s.last_loop_monotonic:
            yield GaugeMetricFamily(
                P + "guard_loop_age_seconds",
                "Seconds since the guard loop last ran (a stuck guard grows this)",
                value=max(0.0, self.monotonic() - s.last_loop_monotonic),
            )

    def _engines(self, snap: Snapshot) -> Iterator[Metric]:
        procs = GaugeMetricFamily(P + "engine_processes", "Processes in engine trees, by engine", labels=["engine"])
        rss = GaugeMetricFamily(
            P + "engine_rss_bytes", "RSS of engine trees (GPU memory not included)", labels=["engine"]
        )
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
            gpu_mem = GaugeMetricFamily(
                P + "engine_gpu_memory_bytes",
                "GPU memory of engine trees (NVML per-process, summed per tree; 'other' for the rest): the share "
                "of the unified pool that RSS and cgroups cannot see",
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
            yield GaugeMetricFamily(
                P + "gpu_unknown_holders",
                "Processes NVML lists as holding GPU memory that match no engine rule and are in no engine tree",
                value=len(snap.gpu_unknown),
            )
            yield GaugeMetricFamily(
                P + "gpu_unknown_holder_memory_bytes",
                "GPU memory held by processes that match no engine rule (NVML per-process, where it says)",
                value=sum(h.used_gpu_memory_bytes or 0 for h in snap.gpu_unknown),
            )

    def _compile(self, snap: Snapshot) -> Iterator[Metric]:
        c = snap.compile
        if c is None:
            return
        tools = GaugeMetricFamily(P + "compile_processes", "Live compiler processes, by tool", labels=["tool"])
        for tool in TOOLS:
            tools.add_metric([tool], c.tools.get(tool, 0))
        yield tools
        yield GaugeMetricFamily(P + "compile_rss_bytes", "Total RSS of compiler processes", value=c.rss_bytes)
        yield GaugeMetricFamily(
            P + "compile_parallel_jobs", "nvcc + cicc processes: the parallelism MAX_JOBS bounds", value=c.parallel_jobs
        )
        arch = GaugeMetricFamily(
            P + "compile_arch_processes", "Compiler processes by the CUDA arch they target", labels=["arch"]
        )
        for name, count in c.archs.items():
            arch.add_metric([name], count)
        yield arch
        per_engine = GaugeMetricFamily(
            P + "compile_engine_processes", "Compiler processes inside each engine tree", labels=["engine", "pid"]
        )
        max_jobs = GaugeMetricFamily(
            P + "compile_max_jobs",
            "Whether MAX_JOBS is set in the environment an engine's compilers inherit (state set)",
            labels=["engine", "pid", "state"],
        )
        for e in c.engines:
            per_engine.add_metric([e.kind, str(e.root_pid)], sum(e.tools.values()))
            for state in MaxJobsState:
                max_jobs.add_metric([e.kind, str(e.root_pid), state], 1 if e.max_jobs_state == state else 0)
        yield per_engine
        yield max_jobs
        yield GaugeMetricFamily(
            P + "compile_outside_engine_processes",
            "Compiler processes in no engine tree (a pip build, a make)",
            value=c.outside_engines,
        )

    def _jit(self, snap: Snapshot) -> Iterator[Metric]:
        labels = ["cache", "version", "arch"]
        size = GaugeMetricFamily(P + "jit_cache_bytes", "Bytes in a JIT cache", labels=labels)
        files = GaugeMetricFamily(P + "jit_cache_files", "Files in a JIT cache", labels=labels)
        changed = GaugeMetricFamily(
            P + "jit_cache_last_change_timestamp_seconds", "Newest mtime in a JIT cache", labels=labels
        )
        objects = GaugeMetricFamily(
            P + "jit_build_objects", "Object files built against build.ninja targets", labels=[*labels, "state"]
        )
        modules = GaugeMetricFamily(
            P + "jit_build_modules", "JIT modules (build.ninja dirs) and those linked", labels=[*labels, "state"]
        )
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
        state = GaugeMetricFamily(
            P + "jit_state", "Per engine: idle, compiling or stalled (state set)", labels=["engine", "pid", "state"]
        )
        for e in snap.jit_states:
            for name in JitState:
                state.add_metric([e.kind, str(e.root_pid), name], 1 if e.state == name else 0)
        yield state


def _gpu_processes(gpu: GpuReport) -> list[tuple[int, int]]:
    """(pid, used bytes) from the GPU report; a process whose share NVML does not know is left out, not 0."""
    return [(p.pid, p.used_gpu_memory_bytes) for p in gpu.processes if p.used_gpu_memory_bytes is not None]


def _driver_families(d: DriverReport) -> Iterator[Metric]:
    """The drift verdict: driver_stranded, driver_next_boot_ok, reboot_required, driver_info."""
    yield GaugeMetricFamily(
        P + "driver_stranded",
        "1 when the running kernel has no NVIDIA modules left (an update removed them): reboot into the new kernel",
        value=int(d.stranded),
    )
    if d.next_boot_ok is not None:
        yield GaugeMetricFamily(
            P + "driver_next_boot_ok", "1 when the kernel that boots next has NVIDIA modules", value=int(d.next_boot_ok)
        )
    yield GaugeMetricFamily(P + "reboot_required", "1 when /run/reboot-required exists", value=int(d.reboot_required))
    yield GaugeMetricFamily(
        P + "driver_version_mismatch",
        "1 when the loaded module and the user-space library differ (NVML: version mismatch)",
        value=int(d.version_mismatch),
    )
    info = GaugeMetricFamily(
        P + "driver_info",
        "Driver identity and the drift verdict; always 1",
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
    yield GaugeMetricFamily(
        P + "kernel_log_readable",
        "1 when sparkwatch can read /dev/kmsg (system unit, or kernel.dmesg_restrict=0); doctor says why not",
        value=int(readable),
    )
    yield CounterMetricFamily(P + "kernel_log_lines", "Kernel log records read", value=lines)
    yield CounterMetricFamily(
        P + "kernel_log_dropped_lines",
        "Kernel log records not read: overwritten in the ring, or skipped over the line-rate bound",
        value=dropped,
    )
    yield CounterMetricFamily(
        P + "kernel_log_injected_lines",
        "NVRM lines written into the kernel log by a process, not printed by the driver: ignored (a test, logger, "
        "or someone pretending)",
        value=injected,
    )
    errors = CounterMetricFamily(
        P + "kernel_nvrm_errors",
        "NVRM error lines by kind (no_memory, insufficient_resources, alloc_failed: allocation failures)",
        labels=["kind"],
    )
    for kind in sorted(set(NVRM_KINDS) | set(nvrm)):
        errors.add_metric([kind], nvrm.get(kind, 0))
    yield errors
    xid = CounterMetricFamily(P + "kernel_xid", "NVIDIA Xid events in the kernel log, by code", labels=["code"])
    for code in sorted(set(XID_CATALOGUE) | set(xids)):
        xid.add_metric([str(code)], xids.get(code, 0))
    yield xid


def _outbox_families(box: OutboxLike) -> Iterator[Metric]:
    """The webhook outbox: a receiver that is down shows as pending alerts and climbing failures, never as silence."""
    yield GaugeMetricFamily(P + "alerts_pending", "Alerts spooled and not yet acknowledged by the webhook", box.pending)
    yield CounterMetricFamily(P + "alerts_delivered", "Alerts the webhook acknowledged (2xx)", box.delivered_total)
    yield CounterMetricFamily(
        P + "alert_delivery_failures", "Failed delivery attempts (refused, timeout, non-2xx)", box.failed_attempts_total
    )
    yield CounterMetricFamily(
        P + "alert_spool_errors", "Alerts that could not be spooled to disk (kept in memory)", box.spool_errors_total
    )
    yield CounterMetricFamily(
        P + "alerts_dropped", "Undelivered alerts dropped, oldest first, at the outbox cap", box.dropped_total
    )
    yield CounterMetricFamily(
        P + "alert_spool_quarantined",
        "Spool files moved to outbox/bad/ (not an event id, unparseable)",
        box.quarantined_total,
    )
    yield CounterMetricFamily(
        P + "alert_outbox_restarts", "Times the outbox worker crashed and was restarted", box.worker_restarts_total
    )
    if box.last_delivery_timestamp_s is not None:
        yield GaugeMetricFamily(
            P + "alert_last_delivery_timestamp_seconds",
            "When the webhook last acknowledged an alert",
            box.last_delivery_timestamp_s,
        )
