"""GuardConfig for tests, built as production builds it: pydantic Settings validated, then the one conversion
(config.schema.guard_config). `trigger_keys` hands core.kill.trigger the config's keys it takes, as the pool watch
does."""

from __future__ import annotations

from typing import Any

from sparkwatch.common.guardconfig import GuardConfig
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings


def guard_config_with(**overrides: Any) -> GuardConfig:
    return guard_config(load_settings(None, {"mlock": False, **overrides}))


def trigger_keys(config: GuardConfig) -> dict[str, Any]:
    """core.kill.trigger.step's keyword arguments from a config (guard.poolwatch passes the same fields)."""
    return {
        "floor": config.floor,
        "kill_budget_s": config.kill_budget_s,
        "debounce_samples": config.debounce_samples,
        "poll_min_s": config.poll_min_s,
        "poll_max_s": config.poll_max_s,
        "rearm_headroom": config.rearm_headroom,
        "kill_settle_s": config.kill_settle_s,
    }
