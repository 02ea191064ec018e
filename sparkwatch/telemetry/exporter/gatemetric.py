"""The containers the after-kill gate holds paused (telemetry.afterkill), as a metric: `sparkwatch_container_gated`,
1 per container while it is held, by its name and its id's 12 digits; absent when none is (docs/containers.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sparkwatch.core.containerpolicy import Gate
from sparkwatch.telemetry.exporter.families import gauge


class GateCollector(Collector):
    def __init__(self, gated: Callable[[], Iterable[Gate]]) -> None:
        """`gated`: telemetry.afterkill.AfterKillWatch.gated."""
        self.gated = gated

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        gates = tuple(self.gated())
        if not gates:
            return
        family = gauge("container_gated", labels=["name", "id"])
        for gate in gates:
            family.add_metric([gate.name, gate.container_id[:12]], 1)
        yield family
