"""The endpoint's encoders (exporter/exposition.py) are prometheus_client's, without its exposition module: held here
to prometheus_client's own `choose_encoder` byte for byte, Content-Type and body, Accept header by Accept header, over
the golden scenario's registry and over families that use what the scenario does not (escapes, exemplars, created
samples, timestamps, info and stateset families, names only UTF-8 escaping allows)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import exposition as upstream
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    SummaryMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from sparkwatch.telemetry.exporter import exposition
from sparkwatch.telemetry.exporter.server import build_registry
from tests.helpers.scenario import (
    StaticEvents,
    StaticGuard,
    StaticKernelLog,
    build_scenario,
    guard_stats,
    kernel_log_stats,
)
from tests.test_telemetry_golden import GOLDEN, scenario_exposition

ACCEPT = [
    "",
    "*/*",
    "text/plain",
    "text/plain; version=0.0.4",
    "text/plain; version=1.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain; version=1.0.0; escaping=dots",
    "text/plain; version=1.0.0; escaping=values",
    "text/plain; version=1.0.0; escaping=bogus",
    "application/openmetrics-text",
    "application/openmetrics-text; version=0.0.1",
    "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=dots",
    # what Prometheus 3 sends by default
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
    "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "text/html, application/json",
]


class Odd(Collector):
    """Families the scenario does not have."""

    def collect(self) -> list[Metric]:
        counter = CounterMetricFamily("odd_events", "help with \\ and\nnewline", labels=["path", "kind"], created=5.0)
        counter.add_metric(['a "quoted"\\path\n', "x"], 3, timestamp=1700000000.5, created=12.25)
        counter.add_metric(["ünïcode", "y"], 1e-9)
        gauge = GaugeMetricFamily("odd.dotted:name", "a name only UTF-8 escaping keeps", labels=["le.vel"])
        gauge.add_metric(["1"], float("inf"))
        gauge.add_metric(["2"], float("nan"))
        histogram = HistogramMetricFamily("odd_seconds", "h", labels=["q"])
        histogram.add_metric(
            ["1"], [("0.5", 1), ("+Inf", 2)], sum_value=0.75,
            timestamp=None,
        )  # fmt: skip
        exemplary = HistogramMetricFamily("odd_exemplar_seconds", "h")
        exemplary.add_metric([], [("1.0", 1, Exemplar({"trace": "t"}, 0.3, 1.5)), ("+Inf", 1)], sum_value=0.3)
        gauge_histogram = GaugeHistogramMetricFamily("odd_gh", "gh", buckets=[("+Inf", 4)], gsum_value=7)
        info = InfoMetricFamily("odd_build", "info", value={"version": "1", "commit": "c"})
        stateset = StateSetMetricFamily("odd_state", "ss", value={"up": True, "down": False})
        summary = SummaryMetricFamily("odd_summary", "s", count_value=2, sum_value=3.5)
        unknown = UnknownMetricFamily("odd_unknown", "u", value=-0.0)
        return [counter, gauge, histogram, exemplary, gauge_histogram, info, stateset, summary, unknown]


def scenario_registry(tmp_path: Path) -> CollectorRegistry:
    settings = build_scenario(tmp_path)
    registry = build_registry(
        settings,
        lambda: None,
        StaticGuard(guard_stats()),
        StaticEvents(),
        kernel_log=StaticKernelLog(kernel_log_stats()),
    )
    registry.register(Odd())
    return registry


@pytest.mark.parametrize("accept", ACCEPT)
def test_the_encoders_are_prometheus_clients_byte_for_byte(tmp_path: Path, accept: str) -> None:
    registry = scenario_registry(tmp_path)
    ours, our_type = exposition.choose_encoder(accept)
    theirs, their_type = upstream.choose_encoder(accept)
    assert our_type == their_type
    assert ours(registry) == theirs(registry)


def test_the_golden_scenario_renders_as_prometheus_client_renders_it(tmp_path: Path) -> None:
    assert scenario_exposition(tmp_path / "golden") == GOLDEN.read_bytes()  # now rendered by generate_text
    registry = scenario_registry(tmp_path / "odd")
    assert exposition.generate_text(registry) == upstream.generate_latest(registry)
