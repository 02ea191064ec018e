"""The containers the after-kill gate holds paused, as the event log tells it (telemetry.afterkill records each
pause and each release): what `status` shows, and what a restarted telemetry takes up. Apart from the policy
(core.containerpolicy), so that `status` reads the log without loading the policy's settle and loop rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sparkwatch.core.eventkinds import EventKind

GATE_EVENTS = (EventKind.CONTAINER_GATED,)
# Events after which a container is no longer held paused.
UNGATE_EVENTS = (EventKind.CONTAINER_RELEASED, EventKind.CONTAINER_STOPPED, EventKind.CONTAINER_KILL_LOOP)


@dataclass(frozen=True, slots=True)
class GatedView:
    """A container held paused, as `status` shows it from the event log."""

    container_id: str
    name: str
    image: str | None
    since: str  # the gate event's ts (RFC 3339)
    need_bytes: int | None
    need_source: str | None


def gated_now(events: Iterable[Mapping[str, object]]) -> tuple[GatedView, ...]:
    """The containers a `container_gated` event (that paused it) left paused and no later release, stop or loop
    freed, oldest first: what `status` shows. Events oldest first."""
    held: dict[str, GatedView] = {}
    for e in events:
        kind, cid = e.get("kind"), e.get("container_id")
        if not isinstance(cid, str):
            continue
        if kind in GATE_EVENTS and not e.get("error"):
            need = e.get("need_bytes")
            source = e.get("need_source")
            held[cid] = GatedView(
                cid,
                str(e.get("container_name") or cid[:12]),
                str(e["image"]) if e.get("image") else None,
                str(e.get("ts", "")),
                need if isinstance(need, int) and not isinstance(need, bool) else None,
                str(source) if source else None,
            )
        elif kind in UNGATE_EVENTS:
            held.pop(cid, None)
    return tuple(held.values())
