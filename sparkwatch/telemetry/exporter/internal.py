"""Internal counters of both processes, and each process's RSS, as metrics (a second collector on the registry).

`sparkwatch_internal_errors_total{process,component,counter}`: every error or drop counter a component keeps
(`Component.counters()`), so a failing journal, notify socket, driver check or channel shows on a dashboard, not only
in a log. `sparkwatch_process_resident_bytes{process}`: the guard's RSS and telemetry's, side by side.
`sparkwatch_telemetry_restarts_total`: the guard restarted the telemetry process. `sparkwatch_guard_psi_trigger`:
1 while the guard sleeps on a PSI memory trigger (0: plain timed polls).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sparkwatch.telemetry.exporter.families import counter, gauge

# process → component → counter → count
Counters = Mapping[str, Mapping[str, Mapping[str, int]]]


class InternalCollector(Collector):
    def __init__(
        self,
        counters: Callable[[], Counters],
        rss: Callable[[], Mapping[str, int]],
        psi_trigger: Callable[[], bool | None],
        restarts: Callable[[], int | None],
    ) -> None:
        self.counters = counters
        self.rss = rss
        self.psi_trigger = psi_trigger
        self.restarts = restarts

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        errors = counter(
            "internal_errors",
            labels=["process", "component", "counter"],
        )
        for process, components in sorted(self.counters().items()):
            for component, counts in sorted(components.items()):
                for name, value in sorted(counts.items()):
                    errors.add_metric([process, component, name], value)
        yield errors
        rss = gauge("process_resident_bytes", labels=["process"])
        for process, value in sorted(self.rss().items()):
            rss.add_metric([process], value)
        yield rss
        restarts = self.restarts()
        if restarts is not None:
            yield counter("telemetry_restarts", value=restarts)
        psi = self.psi_trigger()
        if psi is not None:
            yield gauge("guard_psi_trigger", value=int(psi))
