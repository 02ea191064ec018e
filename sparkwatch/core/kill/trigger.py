"""The guard's decision: when to fire, when to kill the next tree, and how long to sleep before the next look.

Pure: the caller passes the monotonic time and MemAvailable; `step` returns the next state and a decision. After each
firing the caller reports what came of it (`fired`), and when its victims are reaped (`reaped`). The config's keys come
as keyword arguments named as the guard's GuardConfig names them (common.guardconfig, the one declaration): `floor`
(bytes), `kill_budget_s`, `debounce_samples`, `poll_min_s`, `poll_max_s`, `rearm_headroom` (bytes) and
`kill_settle_s` (after the reap, how long memory may take to show up before the next tree dies: on this project's VM
freed pages sat in per-CPU lists and MemAvailable rose over ~1 s after a 1.3 GiB tree was reaped).

The phases of an episode (it starts at the first firing and ends when MemAvailable is back above
floor + rearm_headroom):
- WATCH: fire on the floor or on the predicted crossing, each debounced;
- TEARDOWN: a victim was signalled and is not reaped yet. Its memory is not back until the reap, so the next kill
  waits, unless memory is under the floor and another tree is itself growing (`growing_only`). A teardown that
  outlives its deadline (a victim stuck in D state) counts as done;
- SETTLE: victims reaped; a short bounded wait for MemAvailable to show it. Still at or under the floor: the next tree;
- HUNT: fired and found nothing to kill. Stays armed: every LOOK_EVERY_S while under the floor it looks again, so an
  engine that appears then is killed at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from sparkwatch.core.kill.triggers import TRIGGERS, Recovery, Trigger
from sparkwatch.core.units import GiB, MiB

# earlyoom sizes its sleep for a 6000 MiB/s fill rate (the rate `stress` reaches). The field saw faster:
# 34.0 -> 12.7 GiB in about 1.5 s on a Spark (14 GiB/s). We use earlyoom's figure as a floor under the measured rate
# and sleep half the predicted time to the floor, so at 6 GiB/s we look at least twice before crossing it.
REFERENCE_FILL_RATE_BYTES_PER_S = 6000 * MiB

# Smoothing time constant for the fill rate. MemAvailable noise is ~100 MiB per 5 s with single-sample excursions over
# 1 GiB; 0.3 s keeps one excursion from looking like a fill, while a real 4 GiB/s fill registers within ~2 samples.
FILL_RATE_TAU_S = 0.3

# While under the floor with nothing (or nothing growing) to kill, look again at most this often: each look is one
# /proc scan (3.9 ms warm for 113 processes, measured here), so 4 looks a second cost about 1.6 % of a core.
LOOK_EVERY_S = 0.25

# How long a victim's teardown may take before it counts as stuck. Measured on a real H200 after SIGKILL: GPU-only
# memory (1-120 GiB HBM) was back 0.14-0.20 s after the signal, but driver-held host memory came back at about
# 7.8 GiB/s (16.7 GiB in 2.13 s, 49.4 GiB in 6.36 s). On a GB10 every GPU allocation is driver-held, so an engine
# holding 77 GiB needs about 10 s. Deadline: 1 s plus twice the time at that rate, capped at 30 s.
TEARDOWN_BASE_S = 1.0
DRIVER_RELEASE_BYTES_PER_S = 7.8 * GiB
TEARDOWN_MAX_S = 30.0


def teardown_deadline_s(victim_bytes: int) -> float:
    """Seconds to wait for victims holding `victim_bytes` (RSS + GPU) to be reaped before treating them as stuck."""
    return min(TEARDOWN_BASE_S + 2.0 * max(victim_bytes, 0) / DRIVER_RELEASE_BYTES_PER_S, TEARDOWN_MAX_S)


class Phase(StrEnum):
    WATCH = "watch"
    TEARDOWN = "teardown"
    SETTLE = "settle"
    HUNT = "hunt"


class Outcome(StrEnum):
    """What a firing came to, as the caller reports it to `fired`."""

    KILLED = "killed"  # a tree was signalled (or, in dry-run, would have been)
    NONE = "none"  # nothing the policy allows to kill now
    CANCELLED = "cancelled"  # MemAvailable recovered between the decision and the signal: nothing signalled


@dataclass(frozen=True, slots=True)
class GuardState:
    last_t: float | None = None
    last_available_bytes: int | None = None
    fill_rate_bytes_per_s: float = 0.0  # positive while MemAvailable falls
    below_count: int = 0
    predict_count: int = 0
    phase: Phase = Phase.WATCH
    phase_until: float | None = None  # TEARDOWN: deadline of the reap; SETTLE: end of the settle time
    next_look_t: float = 0.0  # TEARDOWN/HUNT: earliest time of the next look for a victim
    in_episode: bool = False  # fired since MemAvailable was last above floor + rearm_headroom

    @property
    def armed(self) -> bool:
        """True outside an episode. Within one the guard still fires (escalation, hunting), never goes blind."""
        return not self.in_episode


@dataclass(frozen=True, slots=True)
class Decision:
    trigger: Trigger | None  # floor, predicted, escalate (next tree) or hunt (look again) when to act now
    next_interval_s: float
    rearmed: bool = False  # the episode ended: MemAvailable back above floor + rearm_headroom
    seconds_to_floor: float | None = None
    growing_only: bool = False  # a teardown is in progress: only a tree that is itself growing may die


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


def interval_for(headroom_bytes: int, rate_bytes_per_s: float, poll_min_s: float, poll_max_s: float) -> float:
    """Half the predicted time to use up `headroom_bytes` at the faster of the measured rate and the reference rate,
    within the poll bounds: the one rule for how soon to look again (the floor here, a budget in core.kill.budget)."""
    rate = max(rate_bytes_per_s, REFERENCE_FILL_RATE_BYTES_PER_S)
    return min(max(max(headroom_bytes, 0) / rate / 2.0, poll_min_s), poll_max_s)


def next_interval(
    available_bytes: int,
    fill_rate_bytes_per_s: float,
    counting: bool,
    *,
    floor: int,
    poll_min_s: float,
    poll_max_s: float,
) -> float:
    if counting:
        return poll_min_s
    return interval_for(available_bytes - floor, fill_rate_bytes_per_s, poll_min_s, poll_max_s)


def step(
    state: GuardState,
    t: float,
    available_bytes: int,
    *,
    floor: int,
    kill_budget_s: float,
    debounce_samples: int,
    poll_min_s: float,
    poll_max_s: float,
    rearm_headroom: int,
    kill_settle_s: float,
) -> tuple[GuardState, Decision]:
    """Feed one MemAvailable sample taken at monotonic time `t`."""
    rate = smooth_fill_rate(state, t, available_bytes)
    eta = seconds_to_floor(available_bytes, floor, rate)
    under = available_bytes <= floor
    below = state.below_count + 1 if under else 0
    predicted = eta is not None and eta <= kill_budget_s
    predict = state.predict_count + 1 if predicted else 0
    phase, until, in_episode, next_look = state.phase, state.phase_until, state.in_episode, state.next_look_t
    rearmed = False
    trigger: Trigger | None = None
    growing_only = False

    if phase == Phase.TEARDOWN and until is not None and t >= until:
        phase, until = Phase.SETTLE, t + kill_settle_s  # not reaped in time: stuck, count it as done
    if phase == Phase.SETTLE and until is not None and t >= until:
        if under:
            trigger = Trigger.ESCALATE  # still at or under the floor after the settle time: the next tree
        else:
            phase, until = Phase.WATCH, None
    if phase == Phase.HUNT and not under:
        phase = Phase.WATCH
    if phase == Phase.WATCH:
        if in_episode and available_bytes >= floor + rearm_headroom:
            in_episode, rearmed = False, True
        if below >= debounce_samples:
            trigger = Trigger.FLOOR
        elif predict >= debounce_samples:
            trigger = Trigger.PREDICTED
    elif phase == Phase.TEARDOWN:
        if below >= debounce_samples and t >= next_look:
            trigger, growing_only = Trigger.ESCALATE, True
    elif phase == Phase.HUNT and t >= next_look:
        trigger = Trigger.HUNT
    if trigger is not None:
        below, predict, next_look = 0, 0, t + LOOK_EVERY_S

    new_state = replace(
        state,
        last_t=t,
        last_available_bytes=available_bytes,
        fill_rate_bytes_per_s=rate,
        below_count=below,
        predict_count=predict,
        phase=phase,
        phase_until=until,
        next_look_t=next_look,
        in_episode=in_episode,
    )
    counting = phase != Phase.WATCH or below > 0 or predict > 0
    return new_state, Decision(
        trigger=trigger,
        # next_interval, inlined: this runs on every tick, and a keyword call costs ~0.3 µs here.
        next_interval_s=poll_min_s if counting else interval_for(available_bytes - floor, rate, poll_min_s, poll_max_s),
        rearmed=rearmed,
        seconds_to_floor=eta,
        growing_only=growing_only,
    )


def fired(state: GuardState, t: float, outcome: Outcome, teardown_s: float = 0.0) -> GuardState:
    """What the firing `step` asked for came to. `teardown_s`: the victims' reap deadline (teardown_deadline_s)."""
    if outcome == Outcome.KILLED:
        until = t + teardown_s
        if state.phase == Phase.TEARDOWN and state.phase_until is not None:
            until = max(until, state.phase_until)  # an escalation during a teardown waits for both
        return replace(state, phase=Phase.TEARDOWN, phase_until=until, in_episode=True, below_count=0, predict_count=0)
    if outcome == Outcome.NONE:
        if state.phase == Phase.TEARDOWN:
            return state  # nothing growing: keep waiting for the reap, look again after LOOK_EVERY_S
        return replace(state, phase=Phase.HUNT, phase_until=None, in_episode=True)
    # CANCELLED: memory came back on its own; a teardown in progress goes on, else watch again.
    if state.phase == Phase.TEARDOWN:
        return state
    return replace(state, phase=Phase.WATCH, phase_until=None)


def reaped(state: GuardState, t: float, *, kill_settle_s: float) -> GuardState:
    """Every victim signalled so far has exited: give memory `kill_settle_s` to show up."""
    if state.phase != Phase.TEARDOWN:
        return state
    return replace(state, phase=Phase.SETTLE, phase_until=t + kill_settle_s)


# A prediction is cancelled only when memory came back, not when it paused. A hog's fill comes in bursts (250-1,700
# MiB/s on these VMs, with pauses between), and between the decision and the re-read (~10 ms) MemAvailable often does
# not move at all. The first rule, "cancel once it stopped falling", cancelled a kill in 4 of 6 episodes of
# bench/guard_bench.py, and in 4 of 15 the floor was then crossed (by 12-43 MiB), where earlier builds never crossed
# it. The prediction fired with the floor at most one kill budget away at the smoothed fill rate; it is cancelled when
# the re-read puts the floor more than this many budgets away at that rate (a rise of at least one budget's fill).
RECOVERED_AFTER_BUDGETS = 2.0


def should_cancel(
    trigger: Trigger,
    decided_available_bytes: int,
    available_now_bytes: int,
    fill_rate_bytes_per_s: float,
    *,
    floor: int,
    kill_budget_s: float,
) -> bool:
    """Re-read right before the signal, as earlyoom does: cancel when memory recovered since the decision, as the
    trigger's row says (core.kill.triggers, `recovery`). For the floor, escalation and hunting: MemAvailable is above
    the floor now. For a prediction (made above the floor): at the fill rate it was made with, the floor is now more
    than RECOVERED_AFTER_BUDGETS kill budgets away. A driver allocation failure, a budget, a group teardown and a
    wedged engine are never cancelled (the row gives each one's reason)."""
    if available_now_bytes <= floor:
        return False
    recovery = TRIGGERS[trigger].recovery
    if recovery == Recovery.NEVER:
        return False
    if recovery == Recovery.FLOOR_FAR:
        if available_now_bytes <= decided_available_bytes:
            return False  # still falling, or a pause in a bursty fill
        eta = seconds_to_floor(available_now_bytes, floor, fill_rate_bytes_per_s)
        return eta is None or eta > RECOVERED_AFTER_BUDGETS * kill_budget_s
    return True
