"""Metric families made from the contract: the name is the one list's (contract.py), and so is the `# HELP` text.
Every collector builds its families here, so no help text is written anywhere else.

And every label value passes through here, so /metrics holds to what events and logs hold to:
- redacted by core.redact (the one redactor): a model given as `https://user:pw@host/model`, a process title with
  `--api-key sk-…`, a cache directory named after a token leave as `<redacted>`;
- cut to LABEL_MAX_CHARS (after the redaction, so a cut never splits a secret out of the pattern that finds it);
- per family, at most SERIES_SETS_MAX label sets keyed by an engine, a pid, a model, a name or a JIT cache (the
  state-set labels `state` and `phase` do not count: one engine's 8 phases are one set). What is past the cap is
  left out and counted in `sparkwatch_metrics_series_dropped_total`, as is a series whose labels the cut or the
  redaction made equal to another's (the same series twice fails the scrape).
Measured with a real daemon: 64 launched declarations naming 9 KB models made a scrape 4.2 MB before, 100 of them
(two directories) 6.6 MB; now 149 KB and 150 KB.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Exemplar, Timestamp

from sparkwatch.core.redact import own_secrets, redact
from sparkwatch.telemetry.exporter.contract import PREFIX, help_of

LABEL_MAX_CHARS = 128
SERIES_SETS_MAX = 64  # a box runs a handful of engines; common.launched keeps 64 declarations per directory
# Labels whose values come from the processes, the declarations or the caches on the box: each value is one more
# series, so these families are capped.
_PER_THING_LABELS = frozenset({"engine", "pid", "model", "name", "cache"})
_STATE_LABELS = frozenset({"state", "phase"})
_CACHED_MAX_CHARS = 256  # label values this short are redacted once and remembered; longer ones every scrape

_dropped_lock = threading.Lock()
_dropped_total: dict[str, int] = {}  # family -> series left out, over every scrape of this process (one exporter)


def dropped_total() -> int:
    """Series left out by the cap so far, every family and scrape of this process together."""
    with _dropped_lock:
        return sum(_dropped_total.values())


@functools.lru_cache(maxsize=4096)
def _short_label(value: str, _own_secrets: tuple[str, ...]) -> str:
    """Remembered per value and per set of sparkwatch's own secrets (a reload may register a new webhook secret)."""
    return _cut(redact(value))


def _cut(text: str) -> str:
    return text if len(text) <= LABEL_MAX_CHARS else text[: LABEL_MAX_CHARS - 1] + "…"


def label_value(value: str) -> str:
    """A label value as /metrics may show it: redacted, one line, at most LABEL_MAX_CHARS characters."""
    return _short_label(value, own_secrets()) if len(value) <= _CACHED_MAX_CHARS else _cut(redact(value))


class _Bounded:
    """add_metric with every label value made safe, and the per-family cap on label sets."""

    _sets: set[tuple[str, ...]] | None = None
    _key_at: tuple[int, ...] = ()
    _emitted: set[tuple[str, ...]] | None = None
    name: str

    def _bound(self, labels: Sequence[str]) -> None:
        self._key_at = tuple(i for i, n in enumerate(labels) if n not in _STATE_LABELS)
        self._sets = set() if any(n in _PER_THING_LABELS for n in labels) else None
        self._emitted = set() if labels else None

    def _admit(self, values: Sequence[str]) -> list[str] | None:
        if self._sets is not None:
            key = tuple(values[i] for i in self._key_at)
            if key not in self._sets:
                if len(self._sets) >= SERIES_SETS_MAX:
                    self._drop()
                    return None
                self._sets.add(key)
        safe = [label_value(v) for v in values]
        if self._emitted is not None:
            # Two values the cut or the redaction made equal (two 9 KB names alike for 127 characters) would be one
            # series twice, which Prometheus refuses: the first stays.
            emitted = tuple(safe)
            if emitted in self._emitted:
                self._drop()
                return None
            self._emitted.add(emitted)
        return safe

    def _drop(self) -> None:
        with _dropped_lock:
            _dropped_total[self.name] = _dropped_total.get(self.name, 0) + 1


class _Gauge(_Bounded, GaugeMetricFamily):
    def __init__(self, name: str, documentation: str, value: float | None = None, **kwargs: Any) -> None:
        self._bound(kwargs.get("labels") or ())
        super().__init__(name, documentation, value, **kwargs)

    def add_metric(self, labels: Sequence[str], value: float, timestamp: Timestamp | float | None = None) -> None:
        safe = self._admit(labels)
        if safe is not None:
            super().add_metric(safe, value, timestamp)


class _Counter(_Bounded, CounterMetricFamily):
    def __init__(self, name: str, documentation: str, value: float | None = None, **kwargs: Any) -> None:
        self._bound(kwargs.get("labels") or ())
        super().__init__(name, documentation, value, **kwargs)

    def add_metric(
        self,
        labels: Sequence[str],
        value: float,
        created: float | None = None,
        timestamp: Timestamp | float | None = None,
        exemplar: Exemplar | None = None,
    ) -> None:
        safe = self._admit(labels)
        if safe is not None:
            super().add_metric(safe, value, created, timestamp, exemplar)


def gauge(name: str, value: float | None = None, **kwargs: Any) -> GaugeMetricFamily:
    """`sparkwatch_<name>` as a gauge: one value, or `labels=[…]` and add_metric (as prometheus_client takes them)."""
    return _Gauge(PREFIX + name, help_of(PREFIX + name), value, **kwargs)


def counter(name: str, value: float | None = None, **kwargs: Any) -> CounterMetricFamily:
    """`sparkwatch_<name>_total` as a counter (give the name without `_total`, as prometheus_client does)."""
    return _Counter(PREFIX + name, help_of(PREFIX + name), value, **kwargs)


def histogram(name: str, **kwargs: Any) -> HistogramMetricFamily:
    return HistogramMetricFamily(PREFIX + name, help_of(PREFIX + name), **kwargs)
