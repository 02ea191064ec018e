"""The guard process's view of the one Settings object, without pydantic.

`sparkwatch.config.settings.Settings` (pydantic) stays the one schema and the one validation owner. The guard process
must stay small (pydantic and pydantic-settings alone cost about 21 MiB RSS, measured: bench/RESULTS-guard.md), so it
never imports them: `sparkwatch run` validates the whole config once with Settings, serialises the validated values
(`config.settings_to_wire`: plain JSON types, sizes in bytes) and execs into the guard process, which rebuilds them
here as a frozen dataclass without validating anything again. A reload (SIGHUP) runs the same validation in a short
child process (`sparkwatch run --print-settings`) and hands back the same wire form. The telemetry process turns
the wire form into a WireSettings (config.standins) the same way, so both processes hold the same values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sparkwatch.common.enginerules import engine_rules, engine_scope
from sparkwatch.common.wiretypes import WireError, from_json
from sparkwatch.core.engines.identity import EngineRules, Scope
from sparkwatch.core.kill.budget import BudgetParams
from sparkwatch.core.kill.policy import PolicyParams, parse_engine_budgets

# A key the guard process applies on SIGHUP without a restart (guard.poolwatch reads it each tick); the others
# (proc_root, state_dir, …) need a new process. GuardConfig is the one declaration of the guard's keys: their names
# and types here, their validation in config.schema.Settings (converted by config.schema.guard_config), and tests
# hold the two together.
LIVE: Mapping[str, bool] = {"live": True}


@dataclass(frozen=True)
class GuardConfig:
    """The validated settings as the guard process holds them, built only from `wire` (already validated): a new
    guard key is one line here (with LIVE if the guard applies it on reload). The guard's components take it (or the
    GuardSnapshot compiled from it) in their constructors; tests build it as production does (from_wire)."""

    floor: int = field(metadata=LIVE)
    warn_headroom: int
    kill_budget_s: float = field(metadata=LIVE)
    debounce_samples: int = field(metadata=LIVE)
    poll_min_s: float = field(metadata=LIVE)
    poll_max_s: float = field(metadata=LIVE)
    rearm_headroom: int = field(metadata=LIVE)
    dry_run: bool = field(metadata=LIVE)
    mlock: bool
    ancestor_pid: int = field(metadata=LIVE)
    engine_patterns: tuple[str, ...] = field(metadata=LIVE)
    protect_patterns: tuple[str, ...] = field(metadata=LIVE)
    guard_gpu_holders: bool = field(metadata=LIVE)
    kill_order: tuple[str, ...] = field(metadata=LIVE)
    kill_priority: tuple[str, ...] = field(metadata=LIVE)
    never_kill: tuple[str, ...] = field(metadata=LIVE)
    kill_settle_s: float = field(metadata=LIVE)
    proc_root: Path
    state_dir: Path
    events_max_bytes: int
    events_group: str | None  # a group that may read events.jsonl (common/sharing.py)
    listen: str
    telemetry_interval_s: float
    kernel_log_corroboration: bool = field(metadata=LIVE)
    kernel_log_path: Path
    kernel_log_accept_injected: bool = field(metadata=LIVE)
    engine_budgets: tuple[str, ...] = field(metadata=LIVE)
    kill_wedged_after_s: float = field(metadata=LIVE)  # 0: a wedged engine is never killed (guard/wedgewatch.py)
    recorder_window_s: float  # the ring's size is fixed when it is created: a restart applies a new window
    group_teardown: bool = field(metadata=LIVE)  # off: a group's teardown from telemetry is refused here too
    # The whole validated config, for the telemetry process, and as check-config shows it (secrets masked), for
    # the reload log. Excluded from ==: two configs are equal when their values are.
    wire: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    public: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], public: Mapping[str, Any] | None = None) -> GuardConfig:
        """Each field from the wire key of its own name, by its declared type (common.wiretypes). Raises ValueError
        for a wire form from another version of sparkwatch."""
        try:
            values = {f.name: wire[f.name] for f in fields(cls) if f.name not in ("wire", "public")}
            built: GuardConfig = from_json(cls, values, "settings")
        except KeyError as exc:
            raise ValueError(f"settings wire form unusable: KeyError: {exc}") from None
        except WireError as exc:
            raise ValueError(f"settings wire form unusable: {exc}") from None
        return replace(built, wire=dict(wire), public=dict(public or {}))

    @property
    def events_path(self) -> Path:
        return self.state_dir / "events.jsonl"

    @classmethod
    def live_keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls) if f.metadata.get("live"))


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


@dataclass(frozen=True)
class GuardSnapshot:
    """One GuardConfig with what the guard compiles from it (the budgets' parameters, the engine rules and scope, the
    kill policy's compiled patterns, the config's budgets), built whole at start and on each reload and swapped as
    one reference: the guard's tick reads it once, so every decision of a tick is made under one config."""

    config: GuardConfig
    budget_params: BudgetParams
    policy: PolicyParams
    rules: EngineRules
    scope: Scope
    engine_budgets: tuple[tuple[int, re.Pattern[str]], ...]

    @classmethod
    def of(cls, config: GuardConfig) -> GuardSnapshot:
        return cls(
            config=config,
            budget_params=BudgetParams(
                debounce_samples=config.debounce_samples, poll_min_s=config.poll_min_s, poll_max_s=config.poll_max_s
            ),
            policy=PolicyParams.build(config.kill_order, config.kill_priority, config.never_kill),
            rules=engine_rules(config),
            scope=engine_scope(config),
            engine_budgets=tuple(parse_engine_budgets(config.engine_budgets)),
        )


class SnapshotCell:
    """The guard's config snapshot in force: swapped whole on SIGHUP (guard.poolwatch.PoolWatch.reconfigure), read by
    whatever needs the rules of the moment (the pool watch's tick, the kernel-log hook, the group and wedge watches).
    Built before all of them, so none needs the pool watch built first. Calling it reads it (a reference read)."""

    __slots__ = ("current",)

    def __init__(self, config: GuardConfig) -> None:
        self.current = GuardSnapshot.of(config)

    def __call__(self) -> GuardSnapshot:
        return self.current
