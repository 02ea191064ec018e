"""`sparkwatch run`'s shape, in one place: the guard process (the unit's main PID) and the telemetry process.

- `sparkwatch.cli.run` validates the config (the one Settings schema) and execs into the guard process.
- `sparkwatch.loops.guard_process.GuardProcess`: the guard loop, the reaper and scout, sd_notify and the watchdog,
  the supervisor of telemetry; reloads on SIGHUP.
- `sparkwatch.supervisor.TelemetrySupervisor`: starts, feeds and restarts the telemetry process.
- `sparkwatch.loops.telemetry_process.TelemetryProcess`: NVML, the telemetry loop, metrics, outbox, driver drift,
  udev, low headroom.
- `sparkwatch.channel`: the socketpair between the two and its message format.
"""

from __future__ import annotations

from sparkwatch.config import Settings, settings_to_wire
from sparkwatch.guardconfig import describe_wire_changes


def describe_changes(old: Settings, new: Settings) -> list[tuple[str, str]]:
    """(key, 'key: old → new') for each changed setting, secrets masked as check-config masks them."""
    return describe_wire_changes(settings_to_wire(old), settings_to_wire(new), old.public_dict(), new.public_dict())
