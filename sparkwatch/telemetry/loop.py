"""The telemetry loop: one Snapshot a cycle (about every second), published by swapping one reference.

`Telemetry.collect()` runs one cycle. It keeps state between cycles (argv and environ caches, the JIT caches' per
directory totals, each engine's JIT state, the compiler-burst state) but never signals and never writes: `sparkwatch
status` runs it in a terminal without the daemon. Events it decides on (compile_burst, max_jobs_missing, jit_stalled,
jit_state) are queued; the daemon's `TelemetryLoop` drains them into the event log, `status` just drops them.

Each source is timed and wrapped: an exception in one becomes `CollectorStatus(success=False, error=…)` and leaves the
other parts of the Snapshot intact.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sparkwatch.common import logs, syscalls
from sparkwatch.common.enginerules import engine_rules, engine_scope
from sparkwatch.common.eventlog import make_event
from sparkwatch.common.launched import Declaration, LaunchedWatch
from sparkwatch.common.sources.buddyinfo import page_size_bytes, read_contiguous_free
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.common.sources.procs import IncrementalScanner
from sparkwatch.common.sources.psi import read_psi
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.engines import compile as compile_core
from sparkwatch.core.engines import jit as jit_core
from sparkwatch.core.engines import serving as serving_core
from sparkwatch.core.engines.identity import find_engine_trees, unknown_gpu_holders
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import (
    BootState,
    CollectorStatus,
    CompileCensus,
    DriverReport,
    EngineTree,
    Event,
    GpuHolder,
    GpuReport,
    JitCacheState,
    JitEngineState,
    MemInfo,
    Proc,
    ShmLeft,
    Snapshot,
)
from sparkwatch.telemetry.probewatch import ProbeWatch, Wedged
from sparkwatch.telemetry.sources.jitcache import ForeignRoot, JitCacheSource, foreign_root
from sparkwatch.telemetry.sources.nvml import NvmlSource
from sparkwatch.telemetry.sources.procenv import EnvironReader, read_wchan

if TYPE_CHECKING:
    from sparkwatch.common.dirwatch import DirWatch
    from sparkwatch.config.settings import Settings

log = logs.get("telemetry")
T = TypeVar("T")
# malloc_trim after the first cycle (what start-up left free: the imports, NVML's init, the first process table), then
# at most once a minute. By cycles it was every 60th, which a quiet box (a cycle per QUIET_INTERVAL_S) reaches after
# five minutes, and the first came only then.
TRIM_EVERY_S = 60.0
# A box with nothing to watch (no engine, no compiler, no GPU process, no launched boot, the guard far from the
# floor) is cycled once per QUIET_INTERVAL_S, the shipped scrape interval (data/grafana/prometheus.yml): each scrape
# still sees a fresh snapshot. Measured on an H100 host (bench/RESULTS-idle.md): the cycle's own thread took 42.7 ms
# per 30 s idle at 2 s, about 2.8 ms a cycle with NVML. The guard does not wait on telemetry for any kill; the first
# engine, compiler or GPU process seen brings the configured interval back at the next cycle.
QUIET_INTERVAL_S = 5.0


def quiet(snapshot: Snapshot) -> bool:
    """Whether a cycle saw nothing that needs the configured cadence (the guard's distance to the floor is the
    telemetry process's to add: it knows the guard's last MemAvailable)."""
    compile_ = snapshot.compile
    gpu = snapshot.gpu
    return (
        not snapshot.engines
        and not snapshot.boots
        and compile_ is not None
        and compile_.parallel_jobs == 0
        and compile_.outside_engines == 0
        and (gpu is None or not gpu.up or not gpu.processes)
    )


_WCHAN_PROBES_MAX = 64  # members whose wchan is read per engine per cycle; engines have tens of processes
FOREIGN_ROOTS_MAX = 16  # engine trees whose root is looked at per cycle for a container's own caches


class _Failed(Exception):
    """A source could not run because one it depends on failed this cycle."""


class Telemetry:
    def __init__(
        self,
        settings: Settings,
        gpu_source: Any | None = None,
        wall_clock: Callable[[], float] = time.time,
        driver: Callable[[], DriverReport | None] | None = None,
        shm: Callable[[], ShmLeft | None] | None = None,
        *,
        on_wedged: Callable[[Wedged], None] | None = None,
    ) -> None:
        """`gpu_source`: anything with collect() -> GpuReport (default NvmlSource). `driver`: the drift watcher's
        latest report, `shm`: the shm watch's last verdict (each a reference read, no I/O), put in the Snapshot as
        they are. `on_wedged`: the hand-over of an engine wedged for kill_wedged_after_s to the guard (the telemetry
        process's WedgedMsg), given here like every other collaborator: never assigned after construction."""
        self.settings = settings
        self.wall_clock = wall_clock
        self.rules = engine_rules(settings)
        self.scope = engine_scope(settings)
        self.scanner = IncrementalScanner(settings.proc_root)
        self._hot: set[int] = set()  # engine members and compilers: re-read every cycle
        self.last_procs: tuple[Proc, ...] = ()  # the last cycle's process table
        self.environ = EnvironReader(settings.proc_root, compile_core.MAX_JOBS_VARS)
        self.jitcache = JitCacheSource(list(settings.jit_cache_dirs), list(settings.vllm_cache_dirs))
        self.jit_params = jit_core.JitParams(stall_s=settings.jit_stall_s)
        # NvmlSource bounds every NVML call and never raises from collect(); pynvml is imported on its first cycle.
        self.gpu_source = gpu_source if gpu_source is not None else NvmlSource(proc_root=settings.proc_root)
        self.driver = driver
        self.shm = shm
        self.page_size_bytes = page_size_bytes()  # buddyinfo counts pages: 4 KiB, or 64 KiB on some arm64 kernels
        self._meminfo: MeminfoReader | None = None
        self._jit_tracks: dict[tuple[int, int], jit_core.JitTrack] = {}
        self._burst = compile_core.BurstState()
        self._cache_sizes: dict[str, tuple[int, int]] = {}
        self._cache_roots: frozenset[int] = frozenset()  # the engines whose own root the last cycle's caches came from
        # Per engine tree (root pid, start ticks), looked at once: its caches when its root is not ours (a container's)
        self._foreign: dict[tuple[int, int], ForeignRoot | None] = {}
        self._events: list[Event] = []
        self._lock = threading.Lock()  # collect() is one cycle at a time
        # (pid, start_ticks) of every process NVML listed last cycle: the guard reads it (a reference swap) when
        # `guard_gpu_holders` lets unmatched GPU holders be engines; see Guard.gpu_holders.
        self.gpu_holder_keys: frozenset[tuple[int, int]] = frozenset()
        # Engines `sparkwatch launch` declared (common.launched): their boot phase is exported, and their roots are
        # engine trees here as they are for the guard. Re-read only when a directory changed.
        self.launched = LaunchedWatch.of(os.environ, settings.state_dir, settings.proc_root)
        # The serving probe, on a thread of its own (a probe may take its timeout): its events join this loop's.
        self._probe_events: list[Event] = []
        self._probe_lock = threading.Lock()
        self.probes = ProbeWatch(
            str(settings.proc_root),
            serving_params(settings),
            kill_wedged_after_s=settings.kill_wedged_after_s,
            on_event=self._probe_event,
            on_wedged=on_wedged,
            wall_clock=wall_clock,
        )

    def _probe_event(self, event: Event) -> None:
        with self._probe_lock:
            self._probe_events.append(event)

    LIVE_KEYS = frozenset(
        {
            "engine_patterns",
            "protect_patterns",
            "guard_gpu_holders",
            "ancestor_pid",
            "jit_cache_dirs",
            "vllm_cache_dirs",
            "compile_jobs_alert",
            "jit_stall_s",
            "probe_interval_s",
            "probe_retry_s",
            "probe_timeout_s",
            "probe_failures_wedged",
            "kill_wedged_after_s",
        }
    )

    def reconfigure(self, settings: Settings) -> frozenset[str]:
        """Apply new settings between two cycles (SIGHUP). Returns the keys applied."""
        rules = engine_rules(settings)
        with self._lock:
            old = self.settings
            self.settings = settings
            self.rules = rules
            self.scope = engine_scope(settings)
            self.jit_params = jit_core.JitParams(stall_s=settings.jit_stall_s)
            self.probes.configure(serving_params(settings), settings.kill_wedged_after_s)
            if (old.jit_cache_dirs, old.vllm_cache_dirs) != (settings.jit_cache_dirs, settings.vllm_cache_dirs):
                self.jitcache = JitCacheSource(list(settings.jit_cache_dirs), list(settings.vllm_cache_dirs))
                self._cache_sizes = {}
        return self.LIVE_KEYS

    # --- one cycle
    def collect(self) -> Snapshot:
        with self._lock:
            return self._collect()

    def _collect(self) -> Snapshot:
        statuses: list[CollectorStatus] = []

        def run(name: str, fn: Callable[[], T]) -> T | None:
            t0 = time.perf_counter()
            try:
                value = fn()
            except _Failed as exc:
                statuses.append(CollectorStatus(name, False, time.perf_counter() - t0, str(exc)))
                return None
            except Exception as exc:
                statuses.append(CollectorStatus(name, False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"))
                return None
            statuses.append(CollectorStatus(name, True, time.perf_counter() - t0))
            return value

        mem = run("meminfo", self._read_meminfo)
        psi = run("psi", lambda: read_psi(self.settings.proc_root))
        contiguous = run("buddyinfo", lambda: read_contiguous_free(self.settings.proc_root, self.page_size_bytes))
        procs = run("procs", lambda: self.scanner.scan(self._hot).procs)
        if procs is not None:
            self.last_procs = procs  # the telemetry process reads it after the cycle (the group watch's raylets)
        trees: tuple[EngineTree, ...] = ()
        boots = run("launched", lambda: self._boots(procs)) or ()
        declared = {(b.root_pid, s): (b.kind, u) for b, s, u, _l in self._declared}
        launchers = {(b.root_pid, s): launcher for b, s, _u, launcher in self._declared}
        if procs is not None:
            trees = tuple(
                find_engine_trees(
                    procs, self.rules, self.scope, self.gpu_holder_keys, declared=declared, launchers=launchers
                )
            )
            self._hot = {pid for tree in trees for pid in tree.pids}
            self._hot.update(p.pid for p in procs if compile_core.is_compiler(p))
        census = run("compile", lambda: self._census(procs, trees))
        foreign = self._foreign_roots(trees)
        jit_result = run("jitcache", lambda: self.jitcache.collect(foreign=foreign))
        jit: tuple[JitCacheState, ...] = jit_result or ()
        partial = [j.error for j in jit if j.error]
        if jit_result is not None and partial:
            # The readable part is exported; the unreadable part is said: collector_success 0 with the reason.
            last = statuses.pop()
            statuses.append(CollectorStatus(last.name, False, last.duration_s, "; ".join(e for e in partial if e)))
        now = self.wall_clock()
        gpu = run("gpu", self.gpu_source.collect) if self.gpu_source is not None else None
        gpu_busy = _gpu_busy(gpu)
        gpu_unknown: tuple[GpuHolder, ...] = ()
        if isinstance(gpu, GpuReport) and gpu.up and procs is not None:
            used = {p.pid: p.used_gpu_memory_bytes for p in gpu.processes}
            self.gpu_holder_keys = frozenset(p.key for p in procs if p.pid in used)
            gpu_unknown = unknown_gpu_holders(procs, trees, used, self.rules)
        jit_states = (
            run("jit_state", lambda: self._jit_states(procs, trees, census, jit_result, now=now, gpu_busy=gpu_busy))
            or ()
        )
        if census is not None:
            self._burst_events(census, now)
        driver = self.driver() if self.driver is not None else None
        serving = self.probes.observe(trees, boots) if procs is not None else ()
        return Snapshot(
            ts=self.wall_clock(),
            mem=mem,
            engines=trees,
            compile=census,
            jit=jit,
            gpu=gpu,
            driver=driver,
            collectors=tuple(statuses),
            psi=psi,
            jit_states=jit_states,
            free_contiguous=contiguous or (),
            gpu_unknown=gpu_unknown,
            boots=boots,
            serving=serving,
            shm=self.shm() if self.shm is not None else None,
        )

    _declared: tuple[tuple[BootState, int, int, int], ...] = ()  # (boot, start ticks, uid, launcher pid)
    # The declarations whose root runs, as of the last cycle (their peak key and plan: telemetry.afterkill's gate)
    declarations: tuple[Declaration, ...] = ()

    def _boots(self, procs: tuple[Proc, ...] | None) -> tuple[BootState, ...]:
        """The declared engines whose root runs (same pid, start time and uid as declared), with their phase."""
        if procs is None:
            raise _Failed("no process table this cycle")
        by_pid = {p.pid: p for p in procs}
        out = []
        declared = []
        running = []
        for d in self.launched.poll():
            p = by_pid.get(d.root_pid)
            if d.exited_at is not None or p is None or p.start_ticks != d.start_ticks or p.uid != d.uid:
                continue
            running.append(d)
            boot = BootState(
                root_pid=d.root_pid,
                kind=d.kind,
                model=d.model,
                phase=str(d.phase),
                phase_since_ts=d.phase_since,
                launched_at=d.launched_at,
                ready_s=d.ready_s,
                budget_bytes=d.budget_bytes,
                peak_bytes=d.peak_bytes,
                probe_url=d.probe_url,
                first_token_s=d.first_token_s,
                worker_budget_bytes=d.worker_budget_bytes,
            )
            out.append(boot)
            declared.append((boot, d.start_ticks, d.uid, d.launcher_pid))
        self._declared = tuple(declared)
        self.declarations = tuple(running)
        return tuple(out)

    def drain_events(self) -> list[Event]:
        """Events decided since the last drain (compile_burst, max_jobs_missing, jit_*), oldest first."""
        with self._lock:
            events, self._events = self._events, []
        with self._probe_lock:
            events += self._probe_events
            self._probe_events = []
        return events

    # --- sources
    def _read_meminfo(self) -> MemInfo:
        if self._meminfo is None:
            self._meminfo = MeminfoReader(self.settings.proc_root)
        return self._meminfo.read()

    def _census(self, procs: tuple[Proc, ...] | None, trees: tuple[EngineTree, ...]) -> CompileCensus:
        if procs is None:
            raise _Failed("no process table this cycle (procs failed)")
        by_pid = {p.pid: p for p in procs}
        request = compile_core.environ_request(procs, trees)
        environ = {}
        for pid in request.pids:
            proc = by_pid.get(pid)
            if proc is not None:
                environ[pid] = compile_core.EnvReading(self.environ.read(pid, proc.start_ticks))
        self.environ.forget_dead(procs)
        return compile_core.census(procs, trees, environ)

    def _jit_states(
        self,
        procs: tuple[Proc, ...] | None,
        trees: tuple[EngineTree, ...],
        census: CompileCensus | None,
        jit: tuple[JitCacheState, ...] | None,
        *,
        now: float,
        gpu_busy: bool,
    ) -> tuple[JitEngineState, ...]:
        if procs is None or census is None:
            raise _Failed("no process table or census this cycle")
        growing = False
        if jit is not None:
            sizes = {j.path: (j.bytes, j.files) for j in jit}
            growing = any(self._cache_sizes.get(path, size) != size for path, size in sizes.items())
            # A new cache is growth; a container's cache first seen with its engine is not (it was there already).
            new = [
                j
                for j in jit
                if j.path not in self._cache_sizes and (not j.root_pid or j.root_pid in self._cache_roots)
            ]
            growing |= bool(new) and bool(self._cache_sizes)
            self._cache_sizes = sizes
            self._cache_roots = frozenset(j.root_pid for j in jit if j.root_pid)
        compilers = {e.root_pid: sum(e.tools.values()) for e in census.engines}
        observations = []
        for tree in trees:
            n = compilers.get(tree.root.pid, 0)
            all_asleep = all(p.state != "R" for p in tree.members)
            pipe_waiting = False
            track = self._jit_tracks.get((tree.root.pid, tree.root.start_ticks))
            compiled_before = track is not None and track.last_activity_ts is not None
            if n == 0 and all_asleep and compiled_before:  # only an engine that compiled can be stalled: no reads else
                for p in tree.members[:_WCHAN_PROBES_MAX]:
                    if read_wchan(self.settings.proc_root, p.pid) in jit_core.PIPE_WAIT_WCHANS:
                        pipe_waiting = True
                        break
            observations.append(
                jit_core.EngineObservation(
                    kind=tree.kind,
                    root_pid=tree.root.pid,
                    root_start_ticks=tree.root.start_ticks,
                    compilers=n,
                    pipe_waiting=pipe_waiting,
                    all_asleep=all_asleep,
                    gpu_busy=gpu_busy,
                )
            )
        self._jit_tracks, states, changes = jit_core.jit_step(
            self._jit_tracks, observations, growing, self.jit_params, now
        )
        for change in changes:
            kind = EventKind.JIT_STALLED if change.new == jit_core.STALLED else EventKind.JIT_STATE
            summary = f"{change.kind} engine {change.root_pid}: JIT {change.old} -> {change.new}: {change.reason}"
            if change.new == jit_core.STALLED:
                summary += ". It did compile, and nothing has moved since; check it before killing it."
            self._events.append(
                make_event(
                    kind,
                    summary,
                    {"engine": change.kind, "root_pid": change.root_pid, "from": change.old, "to": change.new},
                    ts=now,
                )
            )
        return states

    def _foreign_roots(self, trees: tuple[EngineTree, ...]) -> tuple[ForeignRoot, ...]:
        """The caches of the engines whose root directory is not ours (containers), each engine looked at once."""
        looked: dict[tuple[int, int], ForeignRoot | None] = {}
        for tree in trees[:FOREIGN_ROOTS_MAX]:
            key = tree.root.key
            if key in self._foreign:
                looked[key] = self._foreign[key]
                continue
            ref = tree.container
            where = f"container {ref.short_id}" if ref is not None else f"pid {tree.root.pid}'s root"
            looked[key] = foreign_root(self.settings.proc_root, tree.root.pid, tree.pids, tree.root.uid, where)
        self._foreign = looked
        return tuple(f for f in looked.values() if f is not None)

    def _burst_events(self, census: CompileCensus, now: float) -> None:
        self._burst, alerts = compile_core.burst_step(self._burst, census, self.settings.compile_jobs_alert, now)
        for alert in alerts:
            self._events.append(make_event(alert.kind, alert.summary, alert.fields, ts=now))

    def close(self) -> None:
        self.probes.stop()
        close_gpu = getattr(self.gpu_source, "close", None)
        if close_gpu is not None:
            close_gpu()
        if self._meminfo is not None:
            self._meminfo.close()
            self._meminfo = None


def serving_params(settings: Settings) -> serving_core.ServingParams:
    return serving_core.ServingParams(
        interval_s=settings.probe_interval_s,
        retry_s=settings.probe_retry_s,
        timeout_s=settings.probe_timeout_s,
        failures_wedged=settings.probe_failures_wedged,
    )


# A GPU above this utilization is doing work: an engine is not stalled while it runs (decode idles near 0).
GPU_BUSY_RATIO = 0.05


def _gpu_busy(gpu: object) -> bool:
    if not isinstance(gpu, GpuReport) or not gpu.up:
        return False
    return any(d.utilization_ratio is not None and d.utilization_ratio > GPU_BUSY_RATIO for d in gpu.devices)


def gpu_bytes_by_pid(snapshot: Snapshot | None) -> tuple[float, dict[int, int]] | None:
    """Per-pid GPU bytes from a snapshot, for the guard's ranking: (monotonic time of the reading, pid -> bytes).

    None when there is no snapshot or NVML is down. A pid whose share NVML cannot tell (NOT_AVAILABLE) is left out.
    The snapshot's wall-clock time is turned into monotonic time, so the guard can tell a stale reading.
    """
    if snapshot is None or snapshot.gpu is None or not snapshot.gpu.up:
        return None
    age_s = max(time.time() - snapshot.ts, 0.0)
    by_pid: dict[int, int] = {}
    for pid, used, _gpu in snapshot.gpu.processes:
        if used is not None:
            by_pid[pid] = by_pid.get(pid, 0) + used
    return time.monotonic() - age_s, by_pid


class TelemetryLoop:
    """Runs `collect()` about every `interval_s` in its own thread; `latest` is the last Snapshot (None at first).

    Readers take `loop.latest` once and use that object: the swap of one reference is atomic, so a scrape never sees
    half a cycle. Events go to `on_event` (the daemon appends them to the event log) on this thread, after the swap.
    """

    def __init__(
        self,
        telemetry: Telemetry,
        interval_s: float,
        on_event: Callable[[Event], None] | None = None,
        on_cycle: Callable[[], None] | None = None,
        is_quiet: Callable[[Snapshot], bool] | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.interval_s = interval_s
        self.is_quiet = is_quiet  # a quiet cycle waits QUIET_INTERVAL_S (or the interval, if longer) for the next
        self.on_event = on_event
        self.on_cycle = on_cycle  # after each cycle, on this thread (the telemetry process reports to the guard)
        self.latest: Snapshot | None = None
        self.cycles = 0
        self.errors_total = 0
        self._trimmed_at: float | None = None  # monotonic time of the last malloc_trim
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # stop() and hurry() end a wait
        self._quiet_wait = False  # the loop is waiting QUIET_INTERVAL_S (hurry() ends it)
        self._hurried = False  # hurry() was called since the last cycle began: the next quiet wait is skipped
        # the launch declarations' directories, which end a quiet wait when written (the daemon's Telemetry has them)
        self._launched: LaunchedWatch | None = getattr(telemetry, "launched", None)

    def start(self) -> None:
        self._stop.clear()
        if self._wake_r < 0:  # stopped before: a new pipe for the new thread
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = daemon_thread(self._run, "sparkwatch-telemetry")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._poke()
        if self._thread is not None:
            # A cycle blocked in a /proc read (a process whose mmap lock is held) must not hold up shutdown: the
            # thread is a daemon thread, and the guard never waits on it.
            self._thread.join(5)
        if self._thread is None or not self._thread.is_alive():  # a thread still in its cycle keeps its pipe
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        self.telemetry.close()

    def reconfigure(self, settings: Settings) -> frozenset[str]:
        self.interval_s = settings.telemetry_interval_s
        return self.telemetry.reconfigure(settings) | {"telemetry_interval_s"}

    def latest_engines(self) -> tuple[EngineTree, ...] | None:
        """The engine trees of the last cycle; None before the first."""
        latest = self.latest
        return None if latest is None else latest.engines

    def run_once(self) -> Snapshot:
        self._hurried = False  # this cycle is what a hurry() asked for
        snapshot = self.telemetry.collect()
        self.latest = snapshot
        self.cycles += 1
        now = time.monotonic()
        if self._trimmed_at is None or now - self._trimmed_at >= TRIM_EVERY_S:
            self._trimmed_at = now
            # Each cycle allocates and frees a process table; glibc keeps the freed pages in its arenas, and under
            # pid churn that showed as slow RSS growth. Handing them back once a minute costs well under 1 ms.
            syscalls.trim_heap()
        for event in self.telemetry.drain_events():
            if self.on_event is None:
                continue
            try:
                self.on_event(event)
            except Exception as exc:  # an unwritable event log is counted there; the loop goes on
                self.errors_total += 1
                log.error("could not record %s event: %s", event.kind, exc)
        return snapshot

    def hurry(self) -> None:
        """End a quiet wait now (the guard came near the floor, or told of a kill); a wait at the configured interval
        is left as it is. Safe from any thread: the flag is set before the wait is looked at, and the loop marks its
        wait before it looks at the flag, so one of the two sees the other."""
        self._hurried = True
        if self._quiet_wait:
            self._poke()

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full (a wake-up is pending already) or closed (the loop has ended)
            pass

    def _run(self) -> None:
        waker = self._waker()
        next_at = time.monotonic()
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    self.run_once()
                    if self.on_cycle is not None:
                        self.on_cycle()
                except Exception as exc:  # collect() wraps its sources; this is a bug, reported and survived
                    self.errors_total += 1
                    log.error("telemetry cycle failed: %s: %s", type(exc).__name__, exc)
                latest, is_quiet = self.latest, self.is_quiet
                slow = latest is not None and is_quiet is not None and is_quiet(latest)
                next_at += max(self.interval_s, QUIET_INTERVAL_S) if slow else self.interval_s
                delay = next_at - time.monotonic()
                if delay < 0:  # a slow cycle: start the next one now rather than bunching up to catch up
                    next_at = time.monotonic()
                    delay = 0
                if self._sleep(delay, slow, waker, not_before=started + self.interval_s):
                    next_at = time.monotonic()  # woken early: this cycle is the schedule's new start
        finally:
            if waker is not None:
                waker.close()

    def _waker(self) -> DirWatch | None:
        """What wakes a quiet wait when a launch declaration is written: without it the first cycle of a launched
        engine's boot came up to QUIET_INTERVAL_S late, and its first phases were never exported."""
        if self._launched is None:
            return None
        from sparkwatch.common.dirwatch import DirWatch  # noqa: PLC0415 - the daemon's loop only, not `status`

        try:
            return DirWatch()
        except OSError as exc:
            log.warning("telemetry: no inotify (%s): a quiet cycle waits its whole %g s", exc, QUIET_INTERVAL_S)
            return None

    def _sleep(self, delay_s: float, quiet: bool, waker: DirWatch | None, not_before: float = 0.0) -> bool:
        """The loop's one wait: `delay_s`, or less when stop() is called, or (a quiet wait) hurry() is or a
        declarations directory changes (`waker`). True when it ended early. A directory change ends it no sooner
        than `not_before` (monotonic: a cycle's start plus the configured interval), however often other users'
        files change there."""
        launched = self._launched
        self._quiet_wait = quiet
        try:
            if self._stop.is_set() or (quiet and self._hurried):
                return True
            if quiet and waker is not None and launched is not None:
                roots = [launched.users_root] if launched.users_root is not None else []
                if waker.arm(launched.all_dirs(), roots):
                    changed = waker.wait(delay_s, self._wake_r)
                    if self._drain():
                        return True
                    early_s = not_before - time.monotonic()
                    if changed and early_s > 0:
                        select.select([self._wake_r], [], [], early_s)
                        self._drain()
                    return changed
            ready, _, _ = select.select([self._wake_r], [], [], max(delay_s, 0.0))
            return self._drain() or bool(ready)
        finally:
            self._quiet_wait = False

    def _drain(self) -> bool:
        try:
            return bool(os.read(self._wake_r, 4096))
        except BlockingIOError:
            return False
