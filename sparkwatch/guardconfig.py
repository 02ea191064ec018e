"""The guard process's view of the one Settings object, without pydantic.

`sparkwatch.config.Settings` (pydantic) stays the one schema and the one validation owner. The guard process must
stay small (pydantic and pydantic-settings alone cost about 21 MiB RSS, measured: bench/RESULTS-guard.md), so it
never imports them: `sparkwatch run` validates the whole config once with Settings, serialises the validated values
(`config.settings_to_wire`: plain JSON types, sizes in bytes) and execs into the guard process, which rebuilds them
here as a frozen dataclass without validating anything again. A reload (SIGHUP) runs the same validation in a short
child process (`sparkwatch run --print-settings`) and hands back the same wire form. The telemetry process turns
the wire form back into a Settings (`Settings.model_validate`), so both processes hold the same values.

Also the one place engine rules and the guard's scope are built from settings (`engine_rules`, `engine_scope`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from sparkwatch.core.engines import EngineRules, Scope, rules_for


class EngineSettings(Protocol):
    """What the engine rules and scope are built from (Settings and GuardConfig both have it)."""

    @property
    def engine_patterns(self) -> Sequence[str]: ...
    @property
    def protect_patterns(self) -> Sequence[str]: ...
    @property
    def ancestor_pid(self) -> int: ...
    @property
    def guard_gpu_holders(self) -> bool: ...


class GuardSettings(EngineSettings, Protocol):
    """The keys the guard loop reads."""

    @property
    def floor(self) -> int: ...
    @property
    def warn_headroom(self) -> int: ...
    @property
    def kill_budget_s(self) -> float: ...
    @property
    def debounce_samples(self) -> int: ...
    @property
    def poll_min_s(self) -> float: ...
    @property
    def poll_max_s(self) -> float: ...
    @property
    def rearm_headroom(self) -> int: ...
    @property
    def dry_run(self) -> bool: ...
    @property
    def proc_root(self) -> Path: ...
    @property
    def kill_order(self) -> Sequence[str]: ...
    @property
    def kill_priority(self) -> Sequence[str]: ...
    @property
    def never_kill(self) -> Sequence[str]: ...
    @property
    def kill_settle_s(self) -> float: ...
    @property
    def kernel_log_corroboration(self) -> bool: ...
    @property
    def kernel_log_path(self) -> Path: ...
    @property
    def kernel_log_accept_injected(self) -> bool: ...


def engine_rules(settings: EngineSettings) -> EngineRules:
    """The engine and protection rules from settings: every component builds them here and nowhere else."""
    return rules_for(settings.engine_patterns, settings.protect_patterns, settings.guard_gpu_holders)


def engine_scope(settings: EngineSettings, *, any_user: bool = False) -> Scope:
    """Which processes this process may consider: never itself or its ancestors, only its own uid unless root (or
    `any_user`, for read-only listings), only under `ancestor_pid` when set."""
    return Scope(
        self_pid=os.getpid(),
        own_uid=0 if any_user else os.geteuid(),
        ancestor_pid=settings.ancestor_pid,
    )


@dataclass(frozen=True)
class GuardConfig:
    """The validated settings as the guard process holds them. Built only from `wire` (already validated): each
    field is read from the wire key of its own name, converted by its type (`_FROM_WIRE`), so a new guard key is one
    line here (and one in `GuardSettings` if the guard loop reads it)."""

    floor: int
    warn_headroom: int
    kill_budget_s: float
    debounce_samples: int
    poll_min_s: float
    poll_max_s: float
    rearm_headroom: int
    dry_run: bool
    mlock: bool
    ancestor_pid: int
    engine_patterns: tuple[str, ...]
    protect_patterns: tuple[str, ...]
    guard_gpu_holders: bool
    kill_order: tuple[str, ...]
    kill_priority: tuple[str, ...]
    never_kill: tuple[str, ...]
    kill_settle_s: float
    proc_root: Path
    state_dir: Path
    events_max_bytes: int
    listen: str
    telemetry_interval_s: float
    kernel_log_corroboration: bool
    kernel_log_path: Path
    kernel_log_accept_injected: bool
    # The whole validated config, for the telemetry process, and as check-config shows it (secrets masked), for
    # the reload log. Excluded from ==: two configs are equal when their values are.
    wire: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    public: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], public: Mapping[str, Any] | None = None) -> GuardConfig:
        try:
            values: dict[str, Any] = {
                f.name: _FROM_WIRE[str(f.type)](wire[f.name]) for f in fields(cls) if f.name in _FROM_WIRE_KEYS
            }
            return cls(**values, wire=dict(wire), public=dict(public or {}))
        except (KeyError, TypeError, ValueError) as exc:  # a wire form from another version of sparkwatch
            raise ValueError(f"settings wire form unusable: {type(exc).__name__}: {exc}") from None

    @property
    def events_path(self) -> Path:
        return self.state_dir / "events.jsonl"


# How each field type of GuardConfig is rebuilt from its JSON value; the field list itself is the dataclass's.
_FROM_WIRE: dict[str, Callable[[Any], object]] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "Path": Path,
    "tuple[str, ...]": lambda values: tuple(str(v) for v in values),
}
_FROM_WIRE_KEYS = frozenset(f.name for f in fields(GuardConfig)) - {"wire", "public"}


def describe_wire_changes(
    old_wire: Mapping[str, Any],
    new_wire: Mapping[str, Any],
    old_public: Mapping[str, Any],
    new_public: Mapping[str, Any],
) -> list[tuple[str, str]]:
    """(key, 'key: old → new') for each changed setting, shown as check-config shows it (secrets masked)."""
    out: list[tuple[str, str]] = []
    for key in new_wire:
        if old_wire.get(key) == new_wire.get(key):
            continue
        before, after = old_public.get(key), new_public.get(key)
        if before == after:  # a secret, or a URL whose hidden part changed
            out.append((key, f"{key}: changed (value hidden)"))
        else:
            out.append((key, f"{key}: {_shown(before)} → {_shown(after)}"))
    return out


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
