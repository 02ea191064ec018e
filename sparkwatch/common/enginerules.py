"""The engine rules and the may-touch scope, built from settings: every component builds them here and nowhere else.

Its own small module: the guard (through GuardConfig), telemetry, `status`, `engines` and `doctor` all need these
two, and none of the others needs the guard's config to get them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from sparkwatch.core.engines.identity import EngineRules, Scope, rules_for


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
