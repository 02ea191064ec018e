"""Per-engine memory budgets: when a tree that has one dies, and how soon the guard looks at it again. Pure.

A budget comes from `sparkwatch launch --budget` (the declaration) or the config (`engine_budgets`, matched like
`kill_priority`: core.kill.policy owns the pattern syntax). The guard feeds each budgeted tree's footprint
(core.kill.footprint) to `budget_step` on its pool-watch tick:
- over `budget + margin` for `debounce_samples` consecutive samples: kill that tree alone (trigger `budget`), however
  far the pool is from the floor. The margin (BUDGET_MARGIN_RATIO of the budget, at least BUDGET_MARGIN_MIN_BYTES)
  absorbs the sampling noise of a footprint read from several sources at slightly different times;
- at WARN_RATIO of the budget: one `budget_near` event, again only after it fell back under REARM_RATIO. The warning
  may also come from `warn_bytes` (the pool's drop while the engine boots alone, core.kill.footprint), which never
  kills;
- at GPU_FAST_RATIO of the budget or more, the tree's GPU bytes are sampled every FAST_PERIOD_S (telemetry samples
  NVML for its pids alone, telemetry/gpufast.py) and each new sample is looked at at once (guard.budgets), so a GPU
  runaway that takes gigabytes in one step is caught within about one fast period and the debounce, not the
  telemetry cycle's second;
- the next look comes after half the predicted time to the limit at the faster of the tree's measured growth and
  trigger.REFERENCE_FILL_RATE_BYTES_PER_S, clamped to the guard's poll bounds: the floor loop's rule
  (core.kill.trigger.interval_for), applied to the distance to the budget instead of to the floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sparkwatch.core.kill.trigger import FILL_RATE_TAU_S, interval_for
from sparkwatch.core.units import MiB

BUDGET_MARGIN_RATIO = 0.02
BUDGET_MARGIN_MIN_BYTES = 256 * MiB
WARN_RATIO = 0.90
REARM_RATIO = 0.80
GPU_FAST_RATIO = 0.80
# 20 Hz: a step is seen within 50 ms, and with the debounce's second look (poll_min_s later) killed within about
# 100 ms. One nvmlDeviceGetComputeRunningProcesses costs 2-9 us of CPU on an H200 (bench/RESULTS-idle.md); the thread's
# wake-ups are the cost, and only while an engine is near its budget.
FAST_PERIOD_S = 0.05


@dataclass(frozen=True, slots=True)
class BudgetParams:
    debounce_samples: int = 2
    poll_min_s: float = 0.05
    poll_max_s: float = 1.0
    margin_ratio: float = BUDGET_MARGIN_RATIO
    margin_min_bytes: int = BUDGET_MARGIN_MIN_BYTES
    warn_ratio: float = WARN_RATIO
    rearm_ratio: float = REARM_RATIO


@dataclass(frozen=True, slots=True)
class BudgetState:
    last_t: float | None = None
    last_bytes: int | None = None
    growth_bytes_per_s: float = 0.0  # smoothed, positive while the footprint grows
    over_count: int = 0
    warned: bool = False
    peak_bytes: int = 0


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    kill: bool
    warn: bool
    next_interval_s: float
    limit_bytes: int  # budget + margin: what the footprint must exceed to count as over
    over_bytes: int  # footprint - budget (negative: under)


def limit_bytes(budget_bytes: int, params: BudgetParams) -> int:
    return budget_bytes + max(params.margin_min_bytes, math.ceil(budget_bytes * params.margin_ratio))


def memory_high_bytes(budget_bytes: int, params: BudgetParams = BudgetParams()) -> int:
    """The `MemoryHigh=` of launch's scope: one margin above the guard's kill limit. The kernel throttles host-side
    growth past MemoryHigh (reclaim, then stalls), so at the budget itself it would hold a runaway just under the
    limit, slowed and never killed; above the limit the guard's kill (recorded, said on the terminal) comes first,
    and the throttle stays the backstop for a box whose guard is not running."""
    return 2 * limit_bytes(budget_bytes, params) - budget_bytes


def budget_step(
    state: BudgetState,
    params: BudgetParams,
    t: float,
    footprint_bytes: int,
    budget_bytes: int,
    *,
    warn_bytes: int | None = None,
) -> tuple[BudgetState, BudgetDecision]:
    """Feed one footprint sample of one tree, taken at monotonic time `t`. `footprint_bytes` is what the tree itself
    holds: the kill, the growth and the peak rest on it alone. `warn_bytes`, when larger, may raise the warning."""
    rate = state.growth_bytes_per_s
    if state.last_t is not None and state.last_bytes is not None and t > state.last_t:
        dt = t - state.last_t
        instant = (footprint_bytes - state.last_bytes) / dt
        rate += (1.0 - math.exp(-dt / FILL_RATE_TAU_S)) * (instant - rate)
    limit = limit_bytes(budget_bytes, params)
    over = footprint_bytes > limit
    count = state.over_count + 1 if over else 0
    kill = count >= params.debounce_samples
    warn = False
    warned = state.warned
    seen = max(footprint_bytes, warn_bytes or 0)
    if not warned and seen >= params.warn_ratio * budget_bytes:
        warn, warned = True, True
    elif warned and seen < params.rearm_ratio * budget_bytes:
        warned = False
    counting = count > 0
    if counting:
        interval = params.poll_min_s
    else:
        interval = interval_for(limit - footprint_bytes, rate, params.poll_min_s, params.poll_max_s)
    new = replace(
        state,
        last_t=t,
        last_bytes=footprint_bytes,
        growth_bytes_per_s=rate,
        over_count=0 if kill else count,
        warned=warned,
        peak_bytes=max(state.peak_bytes, footprint_bytes),
    )
    return new, BudgetDecision(kill, warn, interval, limit, footprint_bytes - budget_bytes)
