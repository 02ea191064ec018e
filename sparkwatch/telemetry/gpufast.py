"""Fast GPU samples of near-budget engines: NVML's per-process bytes for their pids alone, every FAST_PERIOD_S, on a
thread of its own in the telemetry process.

The guard names the pids in its state (`BudgetStat.gpu_watch`: the members of each engine tree whose footprint is
at core.kill.budget.GPU_FAST_RATIO of its budget or more). This thread reads the process lists of every GPU (two calls a
GPU through NvmlSource's one guarded worker, `process_bytes`), keeps the watched pids, and sends a
`GpuSampleMsg` to the guard when their bytes changed. The guard lays them over the cycle's reading and looks at the
budget at once (guard.gpuboard, guard.budgets): a GPU runaway that takes gigabytes in one step is seen within one
period, where the telemetry cycle's reading is a second apart (bench/RESULTS-gpu-runaway.md).

Bounded: at most MAX_GPU_WATCH_PIDS pids (more are counted in `pids_over_limit` and left to the cycle); with none
watched the thread sleeps on an event and costs nothing. NVML failures and timeouts are counted (`nvml_errors`),
never raised: a failed sample is no sample, and the cycle's reading stays. A pid whose start time no longer matches
the guard's (reused) is left out.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection

from sparkwatch.common.messages import MAX_GPU_WATCH_PIDS, GpuSampleMsg
from sparkwatch.common.sources.procs import parse_stat
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.kill.budget import FAST_PERIOD_S

ProcessBytes = Callable[[], dict[int, int] | None]
# With no reading (NVML not initialised yet by a telemetry cycle, down, or stuck) the next try waits this long: the
# cycle's own reading and its report of NVML's state stand meanwhile, and a dead NVML costs no 20 Hz of futile tries.
NO_READING_RETRY_S = 1.0


def start_ticks(proc_root: str, pid: int) -> int | None:
    try:
        fd = os.open(f"{proc_root}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        return parse_stat(pid, data)[4]
    except (OSError, ValueError):
        return None


class GpuFastSampler:
    """`watch(keys)` sets the (pid, start_ticks) to sample (from each state message); `send` takes each sample."""

    def __init__(
        self,
        process_bytes: ProcessBytes | None,
        send: Callable[[GpuSampleMsg], object],
        *,
        proc_root: str = "/proc",
        period_s: float = FAST_PERIOD_S,
    ) -> None:
        self.process_bytes = process_bytes  # None: NVML is off in this process, nothing is ever sampled
        self.send = send
        self.proc_root = proc_root
        self.period_s = period_s
        self.samples_total = 0
        self.sends_total = 0
        self.nvml_errors_total = 0  # a sample that got no reading (NVML not up, stuck, or a call failed)
        self.pids_over_limit_total = 0
        self._pids: frozenset[int] = frozenset()
        self._keys: frozenset[tuple[int, int]] = frozenset()
        self._last: dict[int, int] | None = None
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def counters(self) -> dict[str, int]:
        """Errors and drops, for sparkwatch_internal_errors_total{component="gpu_fast"}."""
        return {"nvml_errors": self.nvml_errors_total, "pids_over_limit": self.pids_over_limit_total}

    def watch(self, keys: Collection[tuple[int, int]]) -> None:
        """The pids to sample from now on (the guard's near-budget members); an empty set stops sampling."""
        wanted = frozenset(keys)
        with self._lock:
            if wanted == self._keys:
                return
        if len(wanted) > MAX_GPU_WATCH_PIDS:
            self.pids_over_limit_total += len(wanted) - MAX_GPU_WATCH_PIDS
            wanted = frozenset(sorted(wanted)[:MAX_GPU_WATCH_PIDS])
        # The guard's (pid, start time): a pid reused since is not the engine's (read once per change of the set).
        pids = frozenset(pid for pid, start in wanted if start_ticks(self.proc_root, pid) == start)
        with self._lock:
            self._keys, self._pids, self._last = frozenset(keys), pids, None
        self._changed.set()

    @property
    def watched(self) -> frozenset[int]:
        with self._lock:
            return self._pids

    def start(self) -> None:
        if self.process_bytes is None:
            return
        self._thread = daemon_thread(self._run, "sparkwatch-gpufast")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.watched:
                self._changed.wait()
                self._changed.clear()
                continue
            started = time.monotonic()
            errors = self.nvml_errors_total
            self.sample()
            period_s = self.period_s if self.nvml_errors_total == errors else NO_READING_RETRY_S
            self._stop.wait(max(0.0, started + period_s - time.monotonic()))

    def sample(self) -> GpuSampleMsg | None:
        """One sample of the watched pids; the message sent, if their bytes changed (None otherwise)."""
        with self._lock:
            pids = self._pids
        if not pids or self.process_bytes is None:
            return None
        ts = time.time()
        try:
            reading = self.process_bytes()
        except Exception:  # the source never raises; a sample is no reason for this thread to end
            reading = None
        self.samples_total += 1
        if reading is None:
            self.nvml_errors_total += 1
            return None
        mine = {pid: reading.get(pid, 0) for pid in sorted(pids)}
        with self._lock:
            if pids != self._pids or mine == self._last:
                return None
            self._last = mine
        msg = GpuSampleMsg(ts, mine)
        self.send(msg)
        self.sends_total += 1
        return msg
