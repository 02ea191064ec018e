"""One interface for every long-running part of sparkwatch, in either process.

A `Part` is a component as the lifecycle sees it: start, stop, the keys it applies live, `apply(settings)` (returns
the keys it applied), and the internal counters it exports (`counters()`: name → count, exported as
`sparkwatch_internal_errors_total{process,component,counter}` unless the component already has its own metric).
The objects themselves (Guard, TelemetryLoop, Outbox, …) keep their own method names; a Part adapts them, so the
reload log's "applied live" and "needs a restart" lists come from the components, not from a list kept elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

S = TypeVar("S")


class Lifecycle(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


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
