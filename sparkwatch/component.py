"""One interface for every long-running part of sparkwatch, in either process.

A `Part` is a component as the lifecycle sees it: start, stop, the keys it applies live, `apply(settings)` (returns
the keys it applied), and the internal counters it exports (`counters()`: name → count, exported as
`sparkwatch_internal_errors_total{process,component,counter}` unless the component already has its own metric).
The objects themselves (Guard, TelemetryLoop, Outbox, …) keep their own method names; a Part adapts them, so the
reload log's "applied live" and "needs a restart" lists come from the components, not from a list kept elsewhere.

Both processes start, stop and reload their parts the same way, through `start_parts`, `stop_parts` and `apply_parts`
here: in order, each failure logged with the part's name, the rest carrying on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from sparkwatch import logs

S = TypeVar("S")
log = logs.get("parts")


class Lifecycle(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


class Passive:
    """The lifecycle of a part that only exports counters (the event log, the channel): nothing to start or stop."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _no_counters() -> Mapping[str, int]:
    return {}


@dataclass
class Part(Generic[S]):
    name: str
    obj: Lifecycle
    live_keys: frozenset[str] = frozenset()
    applier: Callable[[S], object] | None = None
    counters: Callable[[], Mapping[str, int]] = field(default=_no_counters)

    def start(self) -> None:
        self.obj.start()

    def stop(self) -> None:
        self.obj.stop()

    def apply(self, settings: S) -> frozenset[str]:
        """Apply the keys this part takes live; the set it applied (its live_keys, or what its applier says)."""
        if self.applier is None:
            return frozenset()
        result: Any = self.applier(settings)
        if isinstance(result, (set, frozenset)):
            return frozenset(str(k) for k in result)
        return self.live_keys


def start_parts(parts: Sequence[Part[S]], *, essential: Collection[str] = ()) -> list[Part[S]]:
    """Start each part in order and return those that started. A part that fails is logged and left out, and the rest
    start; if it is `essential`, the parts already started are stopped again and its exception propagates."""
    started: list[Part[S]] = []
    for part in parts:
        try:
            part.start()
        except Exception as exc:
            if part.name in essential:
                log.error("%s did not start: %s", part.name, exc)
                stop_parts(started)
                raise
            log.error("%s did not start: %s; running without it", part.name, exc)
            continue
        started.append(part)
    return started


def stop_parts(started: Sequence[Part[S]]) -> None:
    """Stop the parts in reverse order; one that fails to stop is logged and the others still stop."""
    for part in reversed(started):
        try:
            part.stop()
        except Exception as exc:
            log.error("stopping %s: %s", part.name, exc)


def apply_parts(
    parts: Sequence[Part[S]], settings: S, *, skip: Collection[str] = ()
) -> tuple[dict[str, frozenset[str]], list[str]]:
    """Apply new settings to each part (but those in `skip`): the keys each applied, and one line per part that
    failed (that part keeps its old settings; the others still apply theirs)."""
    applied: dict[str, frozenset[str]] = {}
    errors: list[str] = []
    for part in parts:
        if part.name in skip:
            continue
        try:
            applied[part.name] = part.apply(settings)
        except Exception as exc:
            errors.append(f"{part.name} could not apply the new config: {exc}")
    return applied, errors
