"""The previous boot's verdict as a metric (a collector of its own on the registry, beside the internal counters).

`sparkwatch_previous_boot_end_timestamp_seconds{class}`: when the previous boot ended, labelled with how
(core.postmortem.verdict.BootEnd). Present once the telemetry process judged it, or found this boot's verdict in
`<state_dir>/postmortem.json` (telemetry.postmortemtask); the dashboard marks that time with an annotation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sparkwatch.telemetry.exporter.families import gauge
from sparkwatch.telemetry.postmortemtask import Judged


class PostmortemCollector(Collector):
    def __init__(self, result: Callable[[], Judged | None]) -> None:
        self.result = result

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        judged = self.result()
        if judged is None:
            return
        family = gauge("previous_boot_end_timestamp_seconds", labels=["class"])
        family.add_metric([str(judged.boot_class)], judged.ended_at)
        yield family
