"""The containers engine trees run in, as metrics (a collector of its own on the registry): one
`sparkwatch_container_info` series each, always 1, so a dashboard or an alert can name an engine's container the way
`docker ps` does (telemetry.containerboard). Nothing on a node whose engines run bare, or without a Docker API.

Its labels are the container's own words: the families module redacts each value (an image named
`user:token@registry/…` shows `<redacted>@registry/…`) and cuts it, and caps the family at SERIES_SETS_MAX containers
(the `name` label counts as one per container), the rest counted in sparkwatch_metrics_series_dropped_total.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sparkwatch.core.container import ContainerFacts
from sparkwatch.telemetry.exporter.families import gauge

LABELS = ["id", "name", "image", "compose_project", "compose_service", "restart_policy", "network_mode"]


class ContainerCollector(Collector):
    def __init__(self, view: Callable[[], Iterable[ContainerFacts]]) -> None:
        """`view`: the containers holding an engine tree (telemetry.containerboard.ContainerBoard.engine_containers)."""
        self.view = view

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        containers = tuple(self.view())
        if not containers:
            return
        info = gauge("container_info", labels=LABELS)
        for c in containers:
            values = [c.id, c.name, c.image, c.compose_project or "", c.compose_service or ""]
            info.add_metric([*values, c.restart_policy, c.network_mode], 1)
        yield info
