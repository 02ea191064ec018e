"""The guard's published state, as a record, and the words `status`, `doctor` and `launch` say about it. Pure.

The guard process writes this record into its runtime dir (common.guardfile owns the file: where, how, and when a
reader may trust it); the terminal commands read it to say whether a guard runs, whether it would kill (armed) or
only records (dry run), at which floor, with how many budgets, and which launched engines it took. `launch` also
reads its `kills`: the guard's word that it killed (or in a dry run would have killed) a launched engine it took,
keyed by the declaration, so launch learns of a kill from the guard's own record by one route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparkwatch.core.units import format_size
from sparkwatch.core.words import plural

VERSION = 1
NO_GUARD = "no guard is running"
KILLS_PUBLISHED = 8  # the latest kills of launched engines: launch reads its own within seconds of the kill
SUMMARY_MAX = 400  # characters of a kill's summary in the state (a summary is ~250; the file stays small)


@dataclass(frozen=True, slots=True)
class KillWord:
    """The guard killed (or, `dry_run`, would have killed) the launched engine whose declaration is (root_pid,
    start_ticks): the trigger and the kill's summary (core.kill.killrecord.kill_summary), for launch's one line."""

    root_pid: int
    start_ticks: int
    trigger: str
    summary: str
    dry_run: bool

    @property
    def tree_key(self) -> tuple[int, int]:
        return (self.root_pid, self.start_ticks)


@dataclass(frozen=True, slots=True)
class GuardState:
    """What a running guard says of itself. `taken`: the (root pid, start ticks) of each launched engine's declaration
    it trusts and guards (guard.launchwatch: within its `ancestor_pid`), `declared_budgets` how many of those carry a
    budget. Launch says a budget is enforced only when its declaration is taken by an armed guard."""

    pid: int
    start_ticks: int  # the guard's own: with the pid, a reader tells a live guard from a dead one's file
    uid: int
    dry_run: bool
    floor_bytes: int
    budget_rules: int  # `engine_budgets` entries in its config
    declared_budgets: int
    taken: tuple[tuple[int, int], ...]
    written_at: float  # wall-clock seconds
    kills: tuple[KillWord, ...] = ()  # the latest KILLS_PUBLISHED kills of launched engines it took, oldest first
    version: int = VERSION

    @property
    def budgets(self) -> int:
        return self.budget_rules + self.declared_budgets

    @property
    def mode(self) -> str:
        return "dry run" if self.dry_run else "armed"

    @property
    def system(self) -> bool:
        return self.uid == 0

    def took(self, key: tuple[int, int]) -> bool:
        return key in self.taken

    def killed(self, key: tuple[int, int]) -> KillWord | None:
        """Its word that it killed the launched engine declared as `key` (None: it did not, or not yet)."""
        return next((k for k in reversed(self.kills) if k.tree_key == key), None)


def describe(state: GuardState) -> str:
    """`guard pid 1234 (uid 1000), armed, floor 8 GiB, 2 budgets, 1 launched engine`."""
    who = "root" if state.system else f"uid {state.uid}"
    mode = "DRY RUN (records, kills nothing)" if state.dry_run else "armed"
    parts = [
        f"guard pid {state.pid} ({who})",
        mode,
        f"floor {format_size(state.floor_bytes)}",
        plural(state.budgets, "budget") if state.budgets else "no budget",
    ]
    if state.taken:
        parts.append(plural(len(state.taken), "launched engine"))
    return ", ".join(parts)


def describe_all(states: Sequence[GuardState], not_running_why: str | None = None) -> str:
    """One line for every guard a reader found (usually one), or why none counts as running."""
    if not states:
        return NO_GUARD + (f" ({not_running_why})" if not_running_why else "")
    return "; ".join(describe(s) for s in states)


# --- what `sparkwatch launch` says of its declaration


def no_guard_line(budget_bytes: int | None) -> str:
    if budget_bytes:
        return f"{NO_GUARD}: the budget is not enforced"
    return f"{NO_GUARD}: nothing guards the pool while this engine runs (sparkwatch run, or install-service)"


def taken_line(state: GuardState, budget_bytes: int | None) -> str:
    head = f"guard pid {state.pid} ({'DRY RUN' if state.dry_run else 'armed'}) took it"
    if not budget_bytes:
        return head
    if state.dry_run:
        return f"{head}: its budget {format_size(budget_bytes)} is watched and recorded, nothing is killed"
    return f"{head}: its budget {format_size(budget_bytes)} is enforced"


def not_taken_line(states: Sequence[GuardState], budget_bytes: int | None, waited_s: float) -> str:
    pids = ", ".join(str(s.pid) for s in states)
    head = (
        f"guard pid {pids} has not taken it within {waited_s:.0f} s (it is outside the guard's ancestor_pid, or "
        "the guard does not read this runtime dir)"
    )
    return f"{head}: the budget is not enforced" if budget_bytes else head
