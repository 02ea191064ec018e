"""Rates from short histories, for people watching a terminal: how fast the pool fills, how fast a JIT build goes.

The guard has its own fill rate (core.kill.trigger.smooth_fill_rate, a 0.3 s time constant for 50 ms polling near the
floor). A view refreshing once a second wants a steadier figure: a least-squares slope over the last few seconds,
so MemAvailable's ~100 MiB per 5 s noise (measured on Sparks) reads as about 0.02 GiB/s rather than a flicker of
±0.1 GiB/s.

Pure: callers pass (monotonic time, value) samples, oldest first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparkwatch.core.kill.trigger import seconds_to_floor

# A slope needs this much history before it is shown at all: two samples 0.1 s apart are mostly noise.
MIN_SPAN_S = 1.5


def slope_per_s(samples: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of value against time; None without MIN_SPAN_S of history."""
    if len(samples) < 2 or samples[-1][0] - samples[0][0] < MIN_SPAN_S:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in samples)
    if var_t <= 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in samples) / var_t


@dataclass(frozen=True, slots=True)
class PoolTrend:
    fill_rate_bytes_per_s: float | None  # positive while MemAvailable falls (the guard's sign); None: too little data
    seconds_to_floor: float | None  # None unless falling


def pool_trend(available_samples: Sequence[tuple[float, float]], floor_bytes: int) -> PoolTrend:
    slope = slope_per_s(available_samples)
    if slope is None:
        return PoolTrend(None, None)
    rate = -slope
    eta = seconds_to_floor(int(available_samples[-1][1]), floor_bytes, rate)
    return PoolTrend(rate, eta)


@dataclass(frozen=True, slots=True)
class BuildRate:
    objects_per_s: float | None  # None: too little history to say
    eta_s: float | None  # None: no rate, or nothing left
    idle_s: float  # how long objects_done has not moved (0 if it just did)


def build_rate(done_samples: Sequence[tuple[float, float]], total: int) -> BuildRate:
    """Objects finished per second over the history, and the time left at that pace.

    Objects finish in steps (a whole nvcc job at a time), so this uses the endpoints of the history, not a fit; a
    count that went down (a cache cleared, a new build.ninja) restarts the history at the drop.
    """
    if not done_samples:
        return BuildRate(None, None, 0.0)
    start = 0
    for i in range(1, len(done_samples)):
        if done_samples[i][1] < done_samples[i - 1][1]:
            start = i
    samples = done_samples[start:]
    t_last, done = samples[-1]
    moved_at = samples[0][0]
    for i in range(len(samples) - 1, 0, -1):
        if samples[i][1] != samples[i - 1][1]:
            moved_at = samples[i][0]
            break
    idle = t_last - moved_at
    span = t_last - samples[0][0]
    if span < MIN_SPAN_S:
        return BuildRate(None, None, idle)
    rate = (done - samples[0][1]) / span
    left = total - done
    eta = left / rate if rate > 0 and left > 0 else None
    return BuildRate(rate, eta, idle)
