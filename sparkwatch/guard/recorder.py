"""The flight recorder in the guard process: the last minutes of pool samples, in a ring file that outlives a crash.

The pool watch offers each tick (`offer`: a time check, a list append and at most a queue put, on its own thread; it
never blocks). One sample a second is taken far from the floor, every tick near it (core.postmortem.flight.sample_due).
The writer thread does everything that can block or costs more than that: it reads buddyinfo and PSI, adds what the
guard already knows (telemetry's engine count and trees, the guard's own last scan with its footprints and age, GPU
bytes while fresh, the launched engines' phases), and pwrites one slot per sample (common.flightrec). A full disk or
a slow fsync stops this thread, never the pool watch: past QUEUE_MAX waiting batches the offers are dropped and
counted.

Near the floor the samples go to the writer in batches, at most every HANDOVER_EVERY_S: a wake-up of a Python thread
costs 0.2-1 ms of CPU on the bench VM, and one per 50 ms tick doubled the guard's CPU near the floor (+1.1 % of a
core, bench/RESULTS-recorder.md). Far from the floor each sample goes at once (they are a second apart anyway).

Sync policy (measured in bench/RESULTS-recorder.md): far from the floor no fsync; a record sits in the page cache,
which a killed process cannot lose, and the kernel's writeback puts it on disk within about 35 s
(vm.dirty_expire_centisecs 30 s + the flusher's 5 s period). Near the floor, where a wedge follows, fdatasync at
most once a second, so a power loss or a hard reset there loses at most the last second. A clean stop writes a last
sample marked `stopping` and syncs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.flightrec import RING_NAME, RingWriter, ring_capacity
from sparkwatch.common.sources.boot import read_boot_id
from sparkwatch.common.sources.buddyinfo import BuddyinfoReader, page_size_bytes
from sparkwatch.common.sources.psi import PsiReader
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.kill.policy import GPU_STALE_S, GpuBytes
from sparkwatch.core.model import EngineTree, MemInfo
from sparkwatch.core.postmortem.flight import FlightSample, LaunchedEngine, TreeFootprint, biggest_first, sample_due

log = logs.get("recorder")
QUEUE_MAX = 64  # batches waiting for a stuck writer; what is in the file stays, only new samples are dropped
# Near the floor the writer wakes at most this often (4 a second, the supervisor's near-floor state cadence): a killed
# guard loses at most this much of the samples, and the ring is on disk within SYNC_EVERY_S of a sample.
HANDOVER_EVERY_S = 0.25
SYNC_EVERY_S = 1.0  # near the floor: fdatasync at most this often
REOPEN_EVERY_S = 60.0  # a ring that could not be opened (full or read-only disk) is tried again this often
ERROR_LOG_EVERY_S = 60.0
STOP_JOIN_S = 2.0

# What the guard knows, read on the writer thread (each returns at once; none does I/O):
# the guard's last own scan (monotonic time, trees), telemetry's engine trees as (kind, root pid) (None: no word
# yet), per-pid GPU bytes (guard.gpuboard), and the engines `sparkwatch launch` started with their phase.
TreesSource = Callable[[], tuple[float, Sequence[EngineTree]] | None]
RootsSource = Callable[[], Sequence[tuple[str, int]] | None]
CountSource = Callable[[], int | None]
GpuSource = Callable[[], GpuBytes | None]
LaunchedSource = Callable[[], Sequence[LaunchedEngine]]


@dataclass(frozen=True, slots=True)
class Tick:
    """What the pool watch hands over: its own reading, nothing the writer could read itself."""

    monotonic: float
    wall: float
    mem: MemInfo
    fill_rate_bytes_per_s: float
    interval_s: float
    near_floor: bool
    guard_phase: str
    kills: int
    stopping: bool = False


_STOP = object()


def _nothing() -> None:
    return None


def _no_launched() -> Sequence[LaunchedEngine]:
    return ()


class FlightRecorder:
    def __init__(
        self,
        state_dir: Path,
        window_s: float,
        proc_root: Path,
        *,
        trees: TreesSource = _nothing,
        roots: RootsSource = _nothing,
        engines: CountSource = _nothing,
        gpu: GpuSource = _nothing,
        launched: LaunchedSource = _no_launched,
    ) -> None:
        self.path = state_dir / RING_NAME
        self.capacity = ring_capacity(window_s)
        self.proc_root = proc_root
        self.trees, self.roots, self.engines, self.gpu, self.launched = trees, roots, engines, gpu, launched
        self._queue: queue.SimpleQueue[list[Tick] | object] = queue.SimpleQueue()
        self._last_offer: float | None = None
        self._batch: list[Tick] = []  # the pool watch's own, until handed over
        self._last_handover = float("-inf")
        self._last_tick: Tick | None = None
        self._thread: threading.Thread | None = None
        # Opened on the writer thread at its first sample, kept open (two syscalls fewer a second each).
        self._buddyinfo = BuddyinfoReader(proc_root, page_size_bytes())
        self._psi = PsiReader(proc_root)
        self.writer: RingWriter | None = None
        self.samples_total = 0
        self.write_errors_total = 0
        self.dropped_total = 0
        self.syncs_total = 0
        self.handovers_total = 0  # writer wake-ups asked for
        self._last_sync = 0.0
        self._last_open_try: float | None = None
        self._last_error_logged = 0.0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    # --- on the pool watch's thread: never blocks
    def offer(self, tick: Tick) -> None:
        self._last_tick = tick
        if not self.enabled or not sample_due(self._last_offer, tick.monotonic, tick.near_floor):
            return
        self._last_offer = tick.monotonic
        self._batch.append(tick)
        if tick.near_floor and tick.monotonic - self._last_handover < HANDOVER_EVERY_S:
            return
        self._hand_over(tick.monotonic)

    def _hand_over(self, now: float) -> None:
        batch, self._batch = self._batch, []
        self._last_handover = now
        if not batch:
            return
        if self._queue.qsize() >= QUEUE_MAX:
            self.dropped_total += len(batch)
            return
        self._queue.put(batch)
        self.handovers_total += 1

    # --- lifecycle
    def start(self) -> None:
        if not self.enabled:
            log.info("flight recorder off (recorder_window_s = 0)")
            return
        self._thread = daemon_thread(self._run, "sparkwatch-recorder")
        self._thread.start()

    def stop(self) -> None:
        """A last sample marked `stopping` (what the pool watch saw last), synced; then the thread ends."""
        if self._thread is None:
            return
        last = self._last_tick
        if last is not None:  # the pool watch has stopped: its batch is ours now
            self._batch.append(replace(last, wall=time.time(), stopping=True))
            self._hand_over(last.monotonic)
        self._queue.put(_STOP)
        self._thread.join(STOP_JOIN_S)  # a writer stuck on a dead disk is a daemon thread: never wait on it long

    def counters(self) -> dict[str, int]:
        return {"write_errors": self.write_errors_total, "dropped": self.dropped_total}

    # --- the writer thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if not isinstance(item, list):
                break  # _STOP
            for i, tick in enumerate(item):
                self._write(tick, with_system=i == len(item) - 1)
        if self.writer is not None:
            try:
                self.writer.sync()
            except OSError as exc:
                self._error("sync at stop", exc)
            self.writer.close()
        self._buddyinfo.close()
        self._psi.close()

    def _writer(self, now: float) -> RingWriter | None:
        if self.writer is not None:
            return self.writer
        if self._last_open_try is not None and now - self._last_open_try < REOPEN_EVERY_S:
            return None
        self._last_open_try = now
        writer = RingWriter(self.path, self.capacity, read_boot_id(self.proc_root))
        try:
            writer.open()
        except OSError as exc:
            self.write_errors_total += 1
            self._error(f"cannot open {self.path}", exc)
            return None
        if writer.rotated:
            log.info("flight recorder: the previous boot's record kept as %s", writer.prev_path)
        self.writer = writer
        return writer

    def _write(self, tick: Tick, with_system: bool = True) -> None:
        writer = self._writer(tick.monotonic)
        if writer is None:
            return
        try:
            sample = self.sample(tick, with_system)
            writer.write(sample)
            self.samples_total += 1
            if tick.stopping or (tick.near_floor and tick.monotonic - self._last_sync >= SYNC_EVERY_S):
                writer.sync()
                self.syncs_total += 1
                self._last_sync = tick.monotonic
        except OSError as exc:
            self.write_errors_total += 1
            self._error("write failed", exc)

    def _error(self, what: str, exc: OSError) -> None:
        now = time.monotonic()
        if now - self._last_error_logged >= ERROR_LOG_EVERY_S:
            self._last_error_logged = now
            log.error("ERROR flight recorder: %s: %s (the guard keeps running)", what, exc.strerror or exc)

    def sample(self, tick: Tick, with_system: bool = True) -> FlightSample:
        """The sample for one tick. `with_system`: read buddyinfo and PSI for it (near the floor only the last sample
        of each batch reads them, 4 times a second: they were half of a sample's cost at 20 a second)."""
        mem = tick.mem
        free_2m = free_64k = None
        contiguous = self._buddyinfo.read() if with_system else None
        psi = self._psi.read() if with_system else None
        if contiguous is not None:
            free_2m, free_64k = contiguous.get("2MiB"), contiguous.get("64KiB")
        gpu = self._fresh_gpu(tick.monotonic)
        trees, age = self._trees(tick.monotonic, gpu)
        return FlightSample(
            t=tick.wall,
            available_bytes=mem.available_bytes,
            free_bytes=mem.free_bytes,
            cached_bytes=mem.cached_bytes,
            shmem_bytes=mem.shmem_bytes,
            fill_rate_bytes_per_s=round(tick.fill_rate_bytes_per_s, 1),
            interval_s=round(tick.interval_s, 3),
            near_floor=tick.near_floor,
            guard_phase=tick.guard_phase,
            kills=tick.kills,
            free_2mib_bytes=free_2m,
            free_64kib_bytes=free_64k,
            psi_some_us=None if psi is None else psi.some_us,
            psi_full_us=None if psi is None else psi.full_us,
            engines=self.engines(),
            trees=trees,
            trees_age_s=age,
            gpu_bytes=None if gpu is None else sum(gpu.values()),
            launched=tuple(self.launched()),
            stopping=tick.stopping,
        )

    def _fresh_gpu(self, now: float) -> dict[int, int] | None:
        reading = self.gpu()
        if reading is None or now - reading[0] > GPU_STALE_S:
            return None
        return dict(reading[1])

    def _trees(self, now: float, gpu: dict[int, int] | None) -> tuple[tuple[TreeFootprint, ...], float | None]:
        """The guard's last own scan, footprints included (RSS + fresh GPU bytes), kept to the trees telemetry still
        counts; the trees telemetry names that the scan did not see, by identity only."""
        scanned = self.trees()
        roots = self.roots()
        out: dict[int, TreeFootprint] = {}
        age = None
        if scanned is not None:
            at, trees = scanned
            age = round(max(now - at, 0.0), 1)
            live = None if roots is None else {pid for _kind, pid in roots}
            for tree in trees:
                if live is not None and tree.root.pid not in live:
                    continue
                gpu_bytes = sum(gpu.get(p.pid, 0) for p in tree.members) if gpu else 0
                out[tree.root.pid] = TreeFootprint(tree.kind, tree.root.pid, tree.rss_bytes + gpu_bytes)
        for kind, pid in roots or ():
            out.setdefault(pid, TreeFootprint(kind, pid, None))
        return biggest_first(list(out.values())), age
