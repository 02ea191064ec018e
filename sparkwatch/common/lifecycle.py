"""How both processes run their long-lived parts: one component interface, and one restart-with-backoff rule.

A `Component` is a part as the lifecycle sees it: start, stop, the keys it applies live, `apply(settings)` (returns
the keys it applied), and the internal counters it exports (`counters()`: name → count, exported as
`sparkwatch_internal_errors_total{process,component,counter}` unless the part already has its own metric). The
objects themselves (PoolWatch, TelemetryLoop, Outbox, …) keep their own method names; a Component adapts them, so the
reload log's "applied live" and "needs a restart" lists come from the parts, not from a list kept elsewhere.

Both processes start, stop and reload their components the same way, through `start_all`, `stop_all` and
`apply_all`: in order, each failure logged with the component's name, the rest carrying on.

`run_with_restarts` is the one way a worker that must never end for good is kept running: the telemetry process
under the guard's supervisor, the outbox's delivery thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from sparkwatch.common import logs

S = TypeVar("S")
log = logs.get("lifecycle")


class Lifecycle(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


class CountersOnly:
    """The lifecycle of a component that only exports counters (the event log, the channel): nothing to run."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _no_counters() -> Mapping[str, int]:
    return {}


@dataclass
class Component(Generic[S]):
    name: str
    obj: Lifecycle
    live_keys: frozenset[str] = frozenset()
    # Applies new settings; returns the keys it applied (or anything else: then `live_keys` were applied).
    apply_settings: Callable[[S], object] | None = None
    counters: Callable[[], Mapping[str, int]] = field(default=_no_counters)

    def start(self) -> None:
        self.obj.start()

    def stop(self) -> None:
        self.obj.stop()

    def apply(self, settings: S) -> frozenset[str]:
        """Apply the keys this component takes live; the set it applied."""
        if self.apply_settings is None:
            return frozenset()
        result: Any = self.apply_settings(settings)
        if isinstance(result, (set, frozenset)):
            return frozenset(str(k) for k in result)
        return self.live_keys


def start_all(components: Sequence[Component[S]], *, essential: Collection[str] = ()) -> list[Component[S]]:
    """Start each in order and return those that started. One that fails is logged and left out, and the rest
    start; if it is `essential`, those already started are stopped again and its exception propagates."""
    started: list[Component[S]] = []
    for component in components:
        try:
            component.start()
        except Exception as exc:
            if component.name in essential:
                log.error("%s did not start: %s", component.name, exc)
                stop_all(started)
                raise
            log.error("%s did not start: %s; running without it", component.name, exc)
            continue
        started.append(component)
    return started


def stop_all(started: Sequence[Component[S]]) -> None:
    """Stop in reverse order; one that fails to stop is logged and the others still stop."""
    for component in reversed(started):
        try:
            component.stop()
        except Exception as exc:
            log.error("stopping %s: %s", component.name, exc)


def apply_all(
    components: Sequence[Component[S]], settings: S, *, skip: Collection[str] = ()
) -> tuple[dict[str, frozenset[str]], list[str]]:
    """Apply new settings to each (but those in `skip`): the keys each applied, and one line per component that
    failed (it keeps its old settings; the others still apply theirs)."""
    applied: dict[str, frozenset[str]] = {}
    errors: list[str] = []
    for component in components:
        if component.name in skip:
            continue
        try:
            applied[component.name] = component.apply(settings)
        except Exception as exc:
            errors.append(f"{component.name} could not apply the new config: {exc}")
    return applied, errors


@dataclass
class Backoff:
    """Restart delays that double from `min_s` to `max_s`, back to `min_s` once a run lasted `healthy_after_s`."""

    min_s: float
    max_s: float
    healthy_after_s: float | None = None
    delay_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.delay_s = self.min_s

    def next_delay(self, ran_s: float) -> float:
        """The wait before the next start, after a run of `ran_s` seconds ended."""
        if self.healthy_after_s is not None and ran_s >= self.healthy_after_s:
            self.delay_s = self.min_s
        delay = self.delay_s
        self.delay_s = min(self.max_s, self.delay_s * 2)
        return delay


def run_with_restarts(
    body: Callable[[], str | None],
    stop: threading.Event,
    backoff: Backoff,
    on_restart: Callable[[str, float], None],
) -> None:
    """Run `body` until `stop` is set. `body` returns None when it finished for good, or why it ended; an exception is
    an ending too. After each ending (unless stopping) `on_restart(why, delay_s)` is told, and `body` runs again after
    the backoff. Nothing it raises ends the loop."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            why = body()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is None or stop.is_set():
            return
        delay = backoff.next_delay(time.monotonic() - started)
        try:
            on_restart(why, delay)
        except Exception as exc:  # a failing report must not end supervision
            log.error("restart report failed: %s", exc)
        stop.wait(delay)
