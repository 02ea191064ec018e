"""The flight recorder's samples, when one is due, and what the last minute of them says. Pure: data in, data out.

The guard keeps the last minutes of pool samples in a fixed-size ring file (common.flightrec) so that, after a hard
reset, the next boot can say how the previous one ended (core.postmortem.verdict). A sample holds what the guard already
knows at that tick: it never scans /proc for the recorder. Near the floor its own scans (the scout's, once a second)
give the engine trees with their footprint; far from the floor the trees are the last ones the guard scanned, with
the age of that scan (`trees_age_s`), and the count telemetry sent (`engines`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparkwatch.core.units import format_size

# Far from the floor one sample a second; near it (the guard's near_floor band) every tick the guard makes.
SLOW_EVERY_S = 1.0
# A tick that comes a little early (the poll interval is 1 s far from the floor, and sleeps end a few ms early or
# late) still takes its sample: otherwise every other second would be skipped.
SLOW_JITTER_S = 0.05
TREES_KEPT = 6  # biggest first: a box runs a handful of engines
TREND_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class TreeFootprint:
    kind: str
    root_pid: int
    footprint_bytes: int | None  # RSS + GPU bytes from the guard's own scan; None: telemetry named the tree only


@dataclass(frozen=True, slots=True)
class LaunchedEngine:
    """An engine `sparkwatch launch` started, and its boot phase (loading weights, compiling, serving, …)."""

    name: str
    pid: int
    phase: str


@dataclass(frozen=True, slots=True)
class FlightSample:
    t: float  # wall clock, unix seconds
    available_bytes: int
    free_bytes: int
    cached_bytes: int  # page cache (meminfo Cached, which includes Shmem)
    shmem_bytes: int
    fill_rate_bytes_per_s: float  # the guard's smoothed fall rate of MemAvailable (+: filling)
    interval_s: float  # the guard's poll interval at this tick
    near_floor: bool
    guard_phase: str
    kills: int  # the guard's kills so far in this run
    # Free in blocks of at least 2 MiB / 64 KiB (buddyinfo), and the cumulative memory stall time (PSI `total=`).
    # None: unreadable, or not read for this sample (near the floor they are read four times a second, not each tick).
    free_2mib_bytes: int | None = None
    free_64kib_bytes: int | None = None
    psi_some_us: int | None = None
    psi_full_us: int | None = None
    engines: int | None = None  # engine trees in telemetry's last census; None: no word from telemetry yet
    trees: tuple[TreeFootprint, ...] = ()  # biggest footprint first
    trees_age_s: float | None = None  # age of the guard's scan the footprints come from; None: never scanned
    gpu_bytes: int | None = None  # per-pid GPU bytes summed, when telemetry's NVML reading is fresh
    launched: tuple[LaunchedEngine, ...] = ()  # empty where nothing was started with `sparkwatch launch`
    stopping: bool = False  # the last sample of a daemon that stopped in order (SIGTERM)


def sample_due(last_t: float | None, now: float, near_floor: bool) -> bool:
    """Whether the guard's tick at monotonic `now` takes a sample: every tick near the floor, else one a second."""
    return near_floor or last_t is None or now - last_t >= SLOW_EVERY_S - SLOW_JITTER_S


def biggest_first(trees: Sequence[TreeFootprint], keep: int = TREES_KEPT) -> tuple[TreeFootprint, ...]:
    return tuple(sorted(trees, key=lambda t: -(t.footprint_bytes or 0))[:keep])


@dataclass(frozen=True, slots=True)
class PoolTrend:
    """MemAvailable over the last minute of samples before `end_t`."""

    span_s: float
    samples: int
    first_available_bytes: int
    last_available_bytes: int
    min_available_bytes: int
    change_bytes_per_s: float  # (last - first) / span: negative while the pool drains
    last_fill_rate_bytes_per_s: float

    @property
    def words(self) -> str:
        if self.samples < 2 or self.span_s <= 0:
            return f"one sample: MemAvailable {format_size(self.last_available_bytes)}"
        rate = self.change_bytes_per_s
        if abs(rate) < 16 << 20:
            how = "steady"
        elif rate < 0:
            how = f"draining at {format_size(-rate)}/s"
        else:
            how = f"recovering at {format_size(rate)}/s"
        return (
            f"MemAvailable {format_size(self.first_available_bytes)} → {format_size(self.last_available_bytes)} "
            f"over {self.span_s:.0f} s ({how}; lowest {format_size(self.min_available_bytes)})"
        )


def pool_trend(samples: Sequence[FlightSample], window_s: float = TREND_WINDOW_S) -> PoolTrend | None:
    """The trend over the `window_s` before the last sample (samples oldest first), or None without samples."""
    if not samples:
        return None
    end_t = samples[-1].t
    recent = [s for s in samples if end_t - s.t <= window_s]
    first, last = recent[0], recent[-1]
    span = last.t - first.t
    return PoolTrend(
        span_s=span,
        samples=len(recent),
        first_available_bytes=first.available_bytes,
        last_available_bytes=last.available_bytes,
        min_available_bytes=min(s.available_bytes for s in recent),
        change_bytes_per_s=(last.available_bytes - first.available_bytes) / span if span > 0 else 0.0,
        last_fill_rate_bytes_per_s=last.fill_rate_bytes_per_s,
    )


def last_minute(samples: Sequence[FlightSample], window_s: float = TREND_WINDOW_S) -> tuple[FlightSample, ...]:
    """The samples of the `window_s` before the last one, oldest first."""
    if not samples:
        return ()
    end_t = samples[-1].t
    return tuple(s for s in samples if end_t - s.t <= window_s)
