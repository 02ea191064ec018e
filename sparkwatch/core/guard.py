"""The guard's decision: when to fire, and how long to sleep before the next look at /proc/meminfo.

Pure: the caller passes the monotonic time and MemAvailable; `step` returns the next state and a decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sparkwatch.units import MiB

# earlyoom sizes its sleep for a 6000 MiB/s fill rate (the rate `stress` reaches). The field saw faster:
# 34.0 -> 12.7 GiB in about 1.5 s on a Spark (14 GiB/s). We use earlyoom's figure as a floor under the measured rate
# and sleep half the predicted time to the floor, so at 6 GiB/s we look at least twice before crossing it.
REFERENCE_FILL_RATE_BYTES_PER_S = 6000 * MiB

# Smoothing time constant for the fill rate. MemAvailable noise is ~100 MiB per 5 s with single-sample excursions over
# 1 GiB; 0.3 s keeps one excursion from looking like a fill, while a real 4 GiB/s fill registers within ~2 samples.
FILL_RATE_TAU_S = 0.3


@dataclass(frozen=True, slots=True)
class GuardParams:
    floor_bytes: int
    kill_budget_s: float = 0.25
    debounce_samples: int = 2
    poll_min_s: float = 0.05
    poll_max_s: float = 1.0
    rearm_headroom_bytes: int = 1024 * MiB


@dataclass(frozen=True, slots=True)
class GuardState:
    last_t: float | None = None
    last_available_bytes: int | None = None
    fill_rate_bytes_per_s: float = 0.0  # positive while MemAvailable falls
    below_count: int = 0
    predict_count: int = 0
    armed: bool = True


@dataclass(frozen=True, slots=True)
class Decision:
    trigger: str | None  # "floor" or "predicted" when the guard must kill now
    next_interval_s: float
    rearmed: bool = False
    seconds_to_floor: float | None = None


def smooth_fill_rate(state: GuardState, t: float, available_bytes: int) -> float:
    if state.last_t is None or state.last_available_bytes is None or t <= state.last_t:
        return state.fill_rate_bytes_per_s
    dt = t - state.last_t
    instant = (state.last_available_bytes - available_bytes) / dt
    alpha = 1.0 - math.exp(-dt / FILL_RATE_TAU_S)
    return state.fill_rate_bytes_per_s + alpha * (instant - state.fill_rate_bytes_per_s)


def seconds_to_floor(available_bytes: int, floor_bytes: int, fill_rate_bytes_per_s: float) -> float | None:
    """Predicted time until MemAvailable reaches the floor at the current rate; None while not falling."""
    if fill_rate_bytes_per_s <= 0:
        return None
    return max(available_bytes - floor_bytes, 0) / fill_rate_bytes_per_s


def next_interval(params: GuardParams, available_bytes: int, fill_rate_bytes_per_s: float, counting: bool) -> float:
    if counting:
        return params.poll_min_s
    headroom = max(available_bytes - params.floor_bytes, 0)
    rate = max(fill_rate_bytes_per_s, REFERENCE_FILL_RATE_BYTES_PER_S)
    return min(max(headroom / rate / 2.0, params.poll_min_s), params.poll_max_s)


def step(state: GuardState, params: GuardParams, t: float, available_bytes: int) -> tuple[GuardState, Decision]:
    """Feed one MemAvailable sample taken at monotonic time `t`."""
    rate = smooth_fill_rate(state, t, available_bytes)
    eta = seconds_to_floor(available_bytes, params.floor_bytes, rate)
    armed = state.armed
    rearmed = False
    if not armed and available_bytes >= params.floor_bytes + params.rearm_headroom_bytes:
        armed, rearmed = True, True

    below = state.below_count + 1 if available_bytes <= params.floor_bytes else 0
    predicted = eta is not None and eta <= params.kill_budget_s
    predict = state.predict_count + 1 if predicted else 0

    trigger = None
    if armed:
        if below >= params.debounce_samples:
            trigger = "floor"
        elif predict >= params.debounce_samples:
            trigger = "predicted"
    if trigger is not None:
        armed, below, predict = False, 0, 0

    new_state = replace(
        state,
        last_t=t,
        last_available_bytes=available_bytes,
        fill_rate_bytes_per_s=rate,
        below_count=below if armed else 0,
        predict_count=predict if armed else 0,
        armed=armed,
    )
    counting = armed and (below > 0 or predict > 0)
    return new_state, Decision(
        trigger=trigger,
        next_interval_s=next_interval(params, available_bytes, rate, counting),
        rearmed=rearmed,
        seconds_to_floor=eta,
    )
