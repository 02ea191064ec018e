"""What a kill leaves behind: the greppable line and the fields of the `kill` event (docs/contract.md, Events)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparkwatch.core.redact import safe_cmdline
from sparkwatch.model import EngineTree, MemInfo, Proc
from sparkwatch.units import MiB, format_size


@dataclass(frozen=True, slots=True)
class KillFacts:
    """Everything known about one guard firing, measured by the guard and the reaper."""

    trigger: str
    mem: MemInfo
    floor_bytes: int
    fill_rate_bytes_per_s: float
    dry_run: bool
    trees: tuple[EngineTree, ...]
    victims: tuple[tuple[Proc, str], ...]  # (process, engine kind) actually signalled (or that would be)
    detect_to_signal_ms: float | None = None
    signal_to_reaped_ms: float | None = None
    reclaimed_bytes: int | None = None
    survivors: tuple[int, ...] = ()  # pids not reaped within the wait (D state, or not ours)
    method: str = "pidfd"


def _reason(facts: KillFacts) -> str:
    avail = facts.mem.available_bytes // MiB
    floor = facts.floor_bytes // MiB
    if facts.trigger == "predicted":
        return (
            f"MemAvailable {avail} MiB falling {format_size(facts.fill_rate_bytes_per_s)}/s, "
            f"predicted to cross floor {floor} MiB"
        )
    if facts.trigger == "driver_alloc_failed":  # core.kernlog's corroboration: the driver ran out first
        return f"NVIDIA driver allocation failed at MemAvailable {avail} MiB, within warn_headroom of floor {floor} MiB"
    return f"MemAvailable {avail} MiB <= floor {floor} MiB"


def kill_line(facts: KillFacts) -> str:
    """`sparkwatch: KILL vllm tree root=1234 (9 processes): MemAvailable 4726 MiB <= floor 8192 MiB`"""
    verb = "DRY-RUN would KILL" if facts.dry_run else "KILL"
    if not facts.trees:
        return f"sparkwatch: NO ENGINE TO KILL: {_reason(facts)}"
    parts = [f"{t.kind} tree root={t.root.pid} ({len(t.members)} processes)" for t in facts.trees]
    return f"sparkwatch: {verb} {', '.join(parts)}: {_reason(facts)}"


def kill_summary(facts: KillFacts) -> str:
    if not facts.trees:
        return f"Memory ran low ({_reason(facts)}) but no engine process was found to kill."
    names = ", ".join(f"{t.kind} (root pid {t.root.pid}, {len(t.members)} processes)" for t in facts.trees)
    head = "Would have killed" if facts.dry_run else "Killed"
    tail = ""
    if facts.reclaimed_bytes is not None and not facts.dry_run:
        tail = f"; {format_size(facts.reclaimed_bytes)} came back"
    if facts.survivors:
        tail += f"; {len(facts.survivors)} process(es) had not exited yet"
    return f"{head} {names}: {_reason(facts)}{tail}."


def kill_fields(facts: KillFacts) -> dict[str, object]:
    return {
        "trigger": facts.trigger,
        "mem_available_bytes": facts.mem.available_bytes,
        "floor_bytes": facts.floor_bytes,
        "fill_rate_bytes_per_second": round(facts.fill_rate_bytes_per_s),
        "dry_run": facts.dry_run,
        "method": facts.method,
        "victims": [
            {
                "pid": p.pid,
                "name": p.display_name,
                "engine": kind,
                "rss_bytes": p.rss_bytes,
                "cmdline": safe_cmdline(p.argv),
            }
            for p, kind in facts.victims
        ],
        "detect_to_signal_ms": _ms(facts.detect_to_signal_ms),
        "signal_to_reaped_ms": _ms(facts.signal_to_reaped_ms),
        "reclaimed_bytes": facts.reclaimed_bytes,
        "survivors": list(facts.survivors),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def victims_of(trees: Sequence[EngineTree]) -> tuple[tuple[Proc, str], ...]:
    return tuple((p, t.kind) for t in trees for p in t.members)
