"""Metric families made from the contract: the name is the one list's (contract.py), and so is the `# HELP` text.
Every collector builds its families here, so no help text is written anywhere else."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from sparkwatch.telemetry.exporter.contract import PREFIX, help_of


def gauge(name: str, value: float | None = None, **kwargs: Any) -> GaugeMetricFamily:
    """`sparkwatch_<name>` as a gauge: one value, or `labels=[…]` and add_metric (as prometheus_client takes them)."""
    return GaugeMetricFamily(PREFIX + name, help_of(PREFIX + name), value, **kwargs)


def counter(name: str, value: float | None = None, **kwargs: Any) -> CounterMetricFamily:
    """`sparkwatch_<name>_total` as a counter (give the name without `_total`, as prometheus_client does)."""
    return CounterMetricFamily(PREFIX + name, help_of(PREFIX + name), value, **kwargs)


def histogram(name: str, **kwargs: Any) -> HistogramMetricFamily:
    return HistogramMetricFamily(PREFIX + name, help_of(PREFIX + name), **kwargs)
