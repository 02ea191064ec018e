"""What the Grafana/Prometheus tests share: the committed artefacts, their queries, and the metric contract.

The contract is sparkwatch/telemetry/exporter/contract.py's METRICS: the one list of families, which the exporter is
held to as well (tests/test_contract.py).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sparkwatch.telemetry.exporter.contract import METRICS, series_names

REPO = Path(__file__).resolve().parent.parent
GRAFANA = REPO / "grafana"  # build.py (the dashboard's generator) and alerts_test.yml: the repository's, not shipped
ASSETS = REPO / "sparkwatch" / "data" / "grafana"  # what the wheel ships and `sparkwatch assets write` writes out
DASHBOARD = ASSETS / "dashboards" / "sparkwatch-node.json"
ALERTS = ASSETS / "sparkwatch-alerts.yml"
ALERTS_TEST = GRAFANA / "alerts_test.yml"

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}

# Grafana unit ids (packages/grafana-data/src/valueFormats/categories.ts) this dashboard may use.
GRAFANA_UNITS = {
    "bytes",
    "binBps",
    "percentunit",
    "s",
    "short",
    "none",
    "watt",
    "celsius",
    "hertz",
    "dateTimeFromNow",
    "joule",
}
# Core panel types of Grafana 10.
GRAFANA_PANEL_TYPES = {"row", "timeseries", "stat", "state-timeline", "table", "bargauge", "gauge", "text"}

SELECTOR_RE = re.compile(r"\b(sparkwatch_[a-z0-9_]+|up)\b(\{[^}]*\})?")


@dataclass(frozen=True)
class Query:
    where: str  # "panel 'Title' A", "annotation 'Guard kills'", "rule SparkwatchDown"
    expr: str


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def load_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def dashboard_queries(dashboard: dict[str, Any]) -> list[Query]:
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            out.append(Query(f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for ann in dashboard["annotations"]["list"]:
        if "expr" in ann:
            out.append(Query(f"annotation {ann['name']!r}", ann["expr"]))
    return out


def rule_queries() -> list[Query]:
    return [Query(f"rule {rule['alert']}", rule["expr"]) for rule in load_rules()]


def substitute(
    expr: str, *, job: str, instance: str | list[str], rate_interval: str, interval: str, range_: str
) -> str:
    """Interpolate Grafana's variables the way Grafana does for a multi-value variable: (a|b), each value escaped."""

    def regex_group(values: str | list[str]) -> str:
        values = [values] if isinstance(values, str) else values
        return "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in values) + ")"

    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__interval", interval)
        .replace("$__range", range_)
        .replace("$job", regex_group(job))
        .replace("$instance", regex_group(instance))
    )


def selectors(expr: str) -> list[str]:
    """Every series selector in a PromQL expression (metric name plus its matchers)."""
    return [name + (labels or "") for name, labels in SELECTOR_RE.findall(expr)]


def metric_names(expr: str) -> set[str]:
    return {name for name, _labels in SELECTOR_RE.findall(expr) if name.startswith("sparkwatch_")}


def contract_series() -> set[str]:
    """Every series name the exporter may publish: the contract's families, a histogram's _bucket/_sum/_count."""
    return {name for spec in METRICS for name in series_names(spec)}


def alerts_over_scrapes(
    scrapes: list[tuple[str, int]], eval_time: str, expect: dict[str, list[str]], tmp: Path, promtool: str
) -> subprocess.CompletedProcess[str]:
    """Run the shipped rules over real scrapes with `promtool test rules`: each (exposition text, samples) holds for
    that many 15 s samples, one after the other, as instance "dut:9847" of job "sparkwatch". `expect` maps an alert
    name to the instances it must fire for at `eval_time` (an empty list: it must not fire); each alert's summary and
    description are the rule's, rendered for that instance (only `$labels.instance` is templated in them)."""
    from prometheus_client.parser import text_string_to_metric_families

    parsed: list[dict[str, float]] = []
    for text, _n in scrapes:
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if math.isfinite(s.value):
                    labels = {"job": "sparkwatch", "instance": "dut:9847", **s.labels}
                    inner = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
                    values[f"{s.name}{{{inner}}}"] = s.value
        parsed.append(values)
    series = sorted({name for values in parsed for name in values})
    input_series = [
        {
            "series": name,
            "values": " ".join(
                f"{values[name]!r}x{n - 1}" if name in values else f"_x{n - 1}"
                for values, (_t, n) in zip(parsed, scrapes, strict=True)
            ),
        }
        for name in series
    ]
    rules = {r["alert"]: r for r in load_rules()}
    tests = []
    for alert, instances in expect.items():
        rule = rules[alert]
        exp = [
            {
                "exp_labels": {"job": "sparkwatch", "instance": inst, **rule.get("labels", {})},
                "exp_annotations": {
                    k: v.replace("{{ $labels.instance }}", inst) for k, v in rule["annotations"].items()
                },
            }
            for inst in instances
        ]
        tests.append({"eval_time": eval_time, "alertname": alert, "exp_alerts": exp})
    doc = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "15s",
        "tests": [{"name": "real scrapes", "interval": "15s", "input_series": input_series, "alert_rule_test": tests}],
    }
    path = tmp / "scrapes_test.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
