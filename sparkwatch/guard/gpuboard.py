"""What telemetry last said about the GPU, as the guard holds it: per-pid GPU bytes (NVML) and the GPU holders.

The guard never loads NVML: it takes telemetry's `tel` messages and treats them as hints, never as orders.
- Per-pid bytes only refine the ranking among trees the guard itself recognised as engines (core.kill.policy), and the
  policy ignores a reading that is too old: a stale or missing one never delays a kill.
- A GPU holder (with `guard_gpu_holders`) becomes a kill candidate only after the guard checked it again itself
  (`verified_holders`): the same pid and start time in its own /proc scan, still alive, an NVIDIA device still
  open, and allowed by its own rules (core.engines.identity.find_engine_trees applies may_touch). Telemetry's word alone
  never decides a kill.
- Fast samples (common.messages.GpuSampleMsg: the pids of near-budget engines, up to 20 times a second) are laid over
  the cycle's reading until a newer cycle reading replaces them; each wakes the pool watch (`on_sample`), whose budget
  watch looks at a near tree whose bytes moved at once (guard.budgets). The age `latest` reports stays the cycle
  reading's: never younger than the oldest figure in it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from sparkwatch.common.messages import GpuSampleMsg, TelMsg
from sparkwatch.common.sources.procs import holds_gpu_device


@dataclass
class GpuBoard:
    pids: dict[int, int] = field(default_factory=dict)
    read_at_s: float | None = None  # wall clock of the NVML reading
    # (pid, start_ticks) of every process NVML listed as holding GPU memory.
    holders: frozenset[tuple[int, int]] = frozenset()
    lock: threading.Lock = field(default_factory=threading.Lock)
    # pid -> (bytes, wall clock) from fast samples newer than the cycle's reading (at most MAX_GPU_WATCH_PIDS a message)
    fast: dict[int, tuple[int, float]] = field(default_factory=dict)
    on_sample: Callable[[], None] = lambda: None  # the pool watch's wake-up
    samples_total: int = 0

    def update(self, msg: TelMsg) -> None:
        with self.lock:
            if msg.gpu_ts is not None:
                self.pids, self.read_at_s = dict(msg.gpu_pids), msg.gpu_ts
                self.fast = {pid: v for pid, v in self.fast.items() if v[1] > msg.gpu_ts}
            self.holders = frozenset(msg.gpu_holders)

    def update_fast(self, msg: GpuSampleMsg) -> None:
        """A fast sample: these pids' bytes as NVML read them at `msg.ts` (the previous watch set's pids are
        replaced: a pid no longer watched falls back to the cycle's reading). Wakes the pool watch."""
        with self.lock:
            self.fast = {pid: (used, msg.ts) for pid, used in msg.pids.items()}
            self.samples_total += 1
        self.on_sample()

    def latest(self) -> tuple[float, dict[int, int]] | None:
        """For the kill policy (guard.poolwatch.GpuBytesSource): (monotonic time of the reading, pid -> bytes), or
        None before telemetry's NVML answered. The policy itself ignores a reading that is too old."""
        with self.lock:
            if self.read_at_s is None:
                return None
            age_s = max(time.time() - self.read_at_s, 0.0)
            by_pid = dict(self.pids)
            for pid, (used, ts) in self.fast.items():
                if ts >= self.read_at_s:
                    by_pid[pid] = used
            return time.monotonic() - age_s, by_pid

    def holder_keys(self) -> frozenset[tuple[int, int]]:
        with self.lock:
            return self.holders


def verified_holders(
    claimed: Collection[tuple[int, int]],
    scanned: Mapping[int, int],
    holds_device: Callable[[int], bool],
) -> frozenset[tuple[int, int]]:
    """The claimed (pid, start_ticks) holders the guard confirms itself: alive in its own scan with the same start
    time (`scanned`: pid -> start ticks), and with an NVIDIA device open now (`holds_device`)."""
    return frozenset(key for key in claimed if scanned.get(key[0]) == key[1] and holds_device(key[0]))


def device_check(proc_root: str) -> Callable[[int], bool]:
    return lambda pid: holds_gpu_device(proc_root, pid)
