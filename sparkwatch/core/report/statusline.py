"""The one-line live summary systemd shows as `Status:` (sd_notify STATUS=) and `sparkwatch status` may reuse.

`MemAvailable 61.2 GiB, floor 8 GiB, 1 engine, compiling 7 jobs`. Parts that are unknown (telemetry off or not yet
run) are left out rather than shown as zero: a zero would be a claim.
"""

from __future__ import annotations

from sparkwatch.core.units import GiB, MiB

# systemd shows STATUS= in one line of `systemctl status`; it truncates nothing but a terminal does. Keep it short.
STATUS_MAX_CHARS = 200


def _size(num_bytes: int) -> str:
    if num_bytes >= GiB:
        value = num_bytes / GiB
        return f"{value:.0f} GiB" if value == int(value) or value >= 100 else f"{value:.1f} GiB"
    return f"{num_bytes / MiB:.0f} MiB"


def status_line(
    mem_available_bytes: int | None,
    floor_bytes: int,
    *,
    engines: int | None = None,
    compile_jobs: int | None = None,
    dry_run: bool = False,
    armed: bool = True,
    error: str | None = None,
) -> str:
    parts: list[str] = []
    if mem_available_bytes is None:
        parts.append("MemAvailable unknown")
    else:
        parts.append(f"MemAvailable {_size(mem_available_bytes)}")
    parts.append(f"floor {_size(floor_bytes)}")
    if engines is not None:
        parts.append(f"{engines} engine" + ("" if engines == 1 else "s"))
    if compile_jobs:
        parts.append(f"compiling {compile_jobs} job" + ("" if compile_jobs == 1 else "s"))
    if not armed:
        parts.append("disarmed until memory recovers")
    if dry_run:
        parts.append("DRY RUN")
    if error:
        parts.append(f"error: {error}")
    line = ", ".join(parts)
    return line if len(line) <= STATUS_MAX_CHARS else line[: STATUS_MAX_CHARS - 1] + "…"
