"""When has a killed engine finished letting go? The decision behind `sparkwatch wait-settled`.

The field: a relaunch 3 s after `pkill` failed its free-memory check, while 30 s later it started fine. Two things
race a relaunch: engine processes still exiting (a SIGKILLed vLLM worker can take seconds to be reaped while the
driver unmaps tens of GiB), and MemAvailable still climbing after they are gone. vLLM's start-up also asserts that
free memory never *rises* during profiling, so a launch into a rising pool can fail even with plenty free.

So the node is settled when no engine process is left AND MemAvailable has not risen by more than a tolerance for a
quiet period. Falling memory (someone else allocating) is not a reason to wait: waiting would not make it better.

Pure: the caller passes monotonic times, the count of live engine processes and MemAvailable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparkwatch.core.model import Proc
from sparkwatch.core.redact import safe_text
from sparkwatch.core.units import MiB, format_size
from sparkwatch.core.words import plural

# Quiet period. MemAvailable noise on a Spark was measured at ~100 MiB per 5 s, so a 5 s window is the span the
# noise figure was measured over; a teardown returns memory in a burst of GiB per second, which a 5 s flat stretch
# after the last process is gone reliably follows. The field's failed relaunch came 3 s after pkill, its good one 30 s.
DEFAULT_QUIET_FOR_S = 5.0
# 2.5x the ~100 MiB/5 s noise, and tiny next to what a teardown returns (tens of GiB). A rare >1 GiB excursion only
# restarts the quiet period: waiting a little longer is the safe side.
DEFAULT_TOLERANCE_BYTES = 256 * MiB
# 4x the 30 s after which the field's relaunch succeeded.
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class SettleParams:
    quiet_for_s: float = DEFAULT_QUIET_FOR_S
    tolerance_bytes: int = DEFAULT_TOLERANCE_BYTES


@dataclass(frozen=True, slots=True)
class SettleState:
    # (monotonic time, MemAvailable) since the last sample that saw an engine process, oldest first. Trimmed to the
    # quiet window plus one anchor sample older than it, so it stays a few dozen entries long.
    samples: tuple[tuple[float, int], ...] = ()
    # (monotonic time, -Shmem), kept the same way when the caller watches Shmem too: a falling Shmem is memory still
    # coming back (a torn-down engine's NCCL and IPC segments: ~62 GiB of mlocked shmem was still held when a
    # relaunch failed, MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks#193).
    shmem: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True, slots=True)
class SettleVerdict:
    settled: bool
    engine_processes: int
    steady_for_s: float  # how long MemAvailable has not risen beyond the tolerance (0 while engines remain)
    recent_rise_bytes: int  # the largest rise inside the samples kept, for the progress line
    available_bytes: int


def steady_suffix(samples: tuple[tuple[float, int], ...], tolerance_bytes: int) -> tuple[float, int]:
    """(start time, largest rise) of the longest run of samples, ending at the newest, that never rose > tolerance.

    A rise is any later sample above an earlier one; walking backwards we keep the maximum seen after each point.
    """
    if not samples:
        raise ValueError("no samples")
    start_t, later_max = samples[-1]
    rise = 0
    for t, avail in reversed(samples[:-1]):
        candidate = max(rise, later_max - avail)
        if candidate > tolerance_bytes:
            break
        rise = candidate
        start_t = t
        later_max = max(later_max, avail)
    return start_t, rise


def max_rise(samples: tuple[tuple[float, int], ...]) -> int:
    rise = 0
    low: int | None = None
    for _t, avail in samples:
        if low is not None:
            rise = max(rise, avail - low)
        low = avail if low is None else min(low, avail)
    return rise


def _window(samples: tuple[tuple[float, int], ...], t: float, quiet_for_s: float) -> tuple[tuple[float, int], ...]:
    """Keep the newest sample at or before the window start as an anchor, so a full window is provably covered."""
    window_start = t - quiet_for_s
    first = 0
    for i, (ts, _a) in enumerate(samples):
        if ts <= window_start:
            first = i
        else:
            break
    return samples[first:]


def settle_step(
    state: SettleState,
    params: SettleParams,
    t: float,
    engine_processes: int,
    available_bytes: int,
    *,
    shmem_bytes: int | None = None,
) -> tuple[SettleState, SettleVerdict]:
    """Feed one observation taken at monotonic time `t`. `engine_processes`: the processes still to wait for (every
    live engine process for `wait-settled`; exiting and orphaned ones for `launch`). With `shmem_bytes`, a falling
    Shmem holds the wait like a rising MemAvailable."""
    if engine_processes > 0:
        # The quiet period only starts once the last engine process is gone.
        return SettleState(), SettleVerdict(False, engine_processes, 0.0, 0, available_bytes)
    samples = _window((*state.samples, (t, available_bytes)), t, params.quiet_for_s)
    start_t, _ = steady_suffix(samples, params.tolerance_bytes)
    rise = max_rise(samples)
    shmem: tuple[tuple[float, int], ...] = ()
    if shmem_bytes is not None:
        shmem = _window((*state.shmem, (t, -shmem_bytes)), t, params.quiet_for_s)
        shmem_start, _ = steady_suffix(shmem, params.tolerance_bytes)
        start_t = max(start_t, shmem_start)
        rise = max(rise, max_rise(shmem))
    steady_for = t - start_t
    settled = steady_for >= params.quiet_for_s
    return SettleState(samples, shmem), SettleVerdict(settled, 0, steady_for, rise, available_bytes)


# Titles of engine processes that only ever run under their engine's own parent (vLLM's EngineCore and workers,
# SGLang's scheduler): `VLLM::Worker_TP0`, `sglang::scheduler_TP0` (core.engines.identity SHAPES). With PID 1 or the
# user's systemd as parent, their engine died and they are still letting go of the GPU.
def is_orphan_worker(title: str, parent_pid: int, parent_comm: str | None) -> bool:
    if "::" not in title:
        return False
    return parent_pid == 1 or parent_comm == "systemd"


NAMED_LEFT = 3  # the engine processes a line names; the rest are counted


def name_processes(procs: Sequence[Proc], limit: int = NAMED_LEFT) -> str:
    """`pid 1234 VLLM::EngineCore, pid 1240 VLLM::Worker_TP0 and 2 more`: what a wait is waiting for, by name, so
    an owner can look at it (or kill it) without another command. Titles are made safe for a terminal."""
    named = ", ".join(f"pid {p.pid} {safe_text(p.display_name)}" for p in procs[:limit])
    more = len(procs) - limit
    return f"{named} and {more} more" if more > 0 else named


def describe(verdict: SettleVerdict, params: SettleParams, left: Sequence[Proc] = ()) -> str:
    """One line for the progress display: what is being waited for (`left`: the engine processes, to name them)."""
    avail = f"MemAvailable {format_size(verdict.available_bytes)}"
    if verdict.engine_processes:
        names = f"; {name_processes(left)}" if left else ""  # last: a terminal too narrow cuts the names, not the pool
        return f"{plural(verdict.engine_processes, 'engine process')} left; {avail}{names}"
    if verdict.settled:
        return f"settled: no engine process, {avail} steady for {verdict.steady_for_s:.1f} s"
    rising = f", rose {format_size(verdict.recent_rise_bytes)} lately" if verdict.recent_rise_bytes else ""
    return (
        f"no engine process; {avail}{rising}; steady {verdict.steady_for_s:.1f}/{params.quiet_for_s:g} s "
        f"(within {format_size(params.tolerance_bytes)})"
    )
