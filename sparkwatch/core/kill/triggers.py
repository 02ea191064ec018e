"""The guard's kill triggers: one value each, and one spec row that every reader of a trigger goes through.

A `Trigger` is a StrEnum: it compares equal to its string, so events, the `trigger` label of
sparkwatch_guard_kills_total and the docs keep the words they had. Every rule that used to test a trigger by its string
reads the row instead: core.kill.trigger.should_cancel (`recovery`), guard.killpath's kill-loop rule
(`counts_toward_loop`), the exporter's list (telemetry.exporter.collector, `tuple(Trigger)`: the commit that added
`wedged` touched 22 files and missed that list, so its counter was not exported at 0 and the first wedged kill after
a start did not fire SparkwatchGuardKilled). The reason sentences stay in core.kill.killrecord.kill_reason, which
matches every member (mypy's exhaustiveness check fails the lint when a member has none); docs/contract.md's table of
triggers is held equal to this one by tests/test_contract.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType


class Trigger(StrEnum):
    FLOOR = "floor"
    PREDICTED = "predicted"
    ESCALATE = "escalate"
    HUNT = "hunt"
    DRIVER_ALLOC_FAILED = "driver_alloc_failed"
    BUDGET = "budget"
    GROUP_TEARDOWN = "group_teardown"
    WEDGED = "wedged"


class Recovery(StrEnum):
    """What a pool that came back (the re-read right before the signal, as earlyoom does) does to a firing."""

    ABOVE_FLOOR = "above_floor"  # MemAvailable above the floor now: cancelled
    FLOOR_FAR = "floor_far"  # a prediction: cancelled once the floor is RECOVERED_AFTER_BUDGETS kill budgets away
    NEVER = "never"  # no pool condition: a pool with room lifts nothing


@dataclass(frozen=True, slots=True)
class TriggerSpec:
    """`recovery`: what a pool that came back does to it; `names_tree`: the request names its own tree (else the kill
    path chooses one by the policy); `counts_toward_loop`: its kills count toward a kill loop (core.kill.killloop);
    `wording`: what it is, in the words of the docs' table, the events and the alerts."""

    recovery: Recovery
    names_tree: bool
    counts_toward_loop: bool
    wording: str


TRIGGERS: MappingProxyType[Trigger, TriggerSpec] = MappingProxyType(
    {
        Trigger.FLOOR: TriggerSpec(Recovery.ABOVE_FLOOR, False, True, "MemAvailable at or under the floor"),
        Trigger.PREDICTED: TriggerSpec(
            Recovery.FLOOR_FAR, False, True, "the fill rate would reach the floor within the kill budget"
        ),
        Trigger.ESCALATE: TriggerSpec(
            Recovery.ABOVE_FLOOR, False, True, "still at or under the floor after the last kill: the next tree"
        ),
        Trigger.HUNT: TriggerSpec(
            Recovery.ABOVE_FLOOR, False, True, "under the floor, looking again after a look found no engine"
        ),
        # The driver already failed an allocation: MemAvailable is what lags there (a box showed 22.5 GiB available
        # while the driver logged NV_ERR_NO_MEMORY at 119.2 of 121.7 GiB used), so a re-read cannot cancel it.
        Trigger.DRIVER_ALLOC_FAILED: TriggerSpec(
            Recovery.NEVER, False, True, "the NVIDIA driver failed an allocation near the floor"
        ),
        # A budget is the engine's own limit, measured on its own tree: the pool having room says nothing about it
        # (a budget kill is made far above the floor by design), and it is no spike under the floor to call a loop.
        Trigger.BUDGET: TriggerSpec(Recovery.NEVER, True, False, "an engine's footprint over its budget"),
        # A member of the engine's group died on another node: the rest of the group is stuck whatever the pool holds.
        Trigger.GROUP_TEARDOWN: TriggerSpec(
            Recovery.NEVER, True, False, "a group spanning nodes lost a member: this node's members of it"
        ),
        # The engine stopped serving (guard.wedgewatch): that is no pool condition, and a pool with room lifts nothing.
        Trigger.WEDGED: TriggerSpec(
            Recovery.NEVER, True, False, "an engine up but not serving, its own progress counters stalled"
        ),
    }
)
