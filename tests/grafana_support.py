"""What the Grafana/Prometheus tests share: the committed artefacts, their queries, and the metric contract."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
GRAFANA = REPO / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "sparkwatch-node.json"
ALERTS = GRAFANA / "alerts.yml"
ALERTS_TEST = GRAFANA / "alerts_test.yml"
DESIGN = REPO.parent / "shared" / "DESIGN.md"

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}

# sparkwatch_* series the dashboard and rules use beyond DESIGN.md's list (the exporter must publish them; the
# queries fall back where they can, see docs/grafana.md).
EXTRA_METRICS = {
    "memory_warn_headroom_bytes": "the warn line and SparkwatchHeadroomLow (fallback: the 4 GiB default)",
    "guard_loop_age_seconds": "SparkwatchGuardStuck and the poll-interval panel: a stuck guard grows it",
    "telemetry_last_cycle_timestamp_seconds": "SparkwatchTelemetryStale",
    "compile_max_jobs": "state set {engine,pid,state=set|unset|unknown}: MAX_JOBS in an engine tree's environment",
    "alerts_pending": "SparkwatchAlertsUndelivered: alerts spooled, not yet acknowledged by the webhook",
    "alert_delivery_failures_total": "SparkwatchAlertsUndelivered: failed webhook attempts",
    "memory_free_contiguous_bytes": "the driver's-view row: free memory in blocks >= 2 MiB / 64 KiB (/proc/buddyinfo)",
    "kernel_log_readable": "SparkwatchKernelLogUnreadable: NVRM/Xid lines cannot be seen (dmesg_restrict)",
    "kernel_log_dropped_lines_total": "the driver's-view row: kernel-log records lost to the ring or the rate bound",
    "kernel_nvrm_errors_total": "SparkwatchDriverAllocFailed: NVRM allocation failures by kind",
    "kernel_xid_total": "SparkwatchGpuXid / SparkwatchGpuXidNeedsReset: Xid events by code",
}

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


def design_metrics(text: str) -> set[str]:
    """The metric names of DESIGN.md's "Metrics" section, braces expanded, labels dropped, histogram series added."""
    section = text.split("### Metrics", 1)[1].split("\n### ", 1)[0]
    names: set[str] = set()
    for quoted in re.findall(r"`([^`]+)`", section):
        # A brace group followed by more name is an alternation (memory_{total,used}_bytes); at the end, labels.
        token = re.sub(r"\{[^}]*\}$", "", quoted.split(" ")[0])
        if not re.fullmatch(r"[a-z0-9_{},]+", token) or "_" not in token or token.startswith("sparkwatch"):
            continue  # prose in backticks: `promtool check metrics`, the prefix `sparkwatch_`
        expanded = [""]
        for literal, group in re.findall(r"([a-z0-9_]*)(?:\{([^}]*)\})?", token):
            options = group.split(",") if group else [""]
            expanded = [e + literal + o for e in expanded for o in options]
        names.update(expanded)
    names.discard("")
    histograms = {"guard_kill_duration_seconds"}
    for h in histograms & names:
        names.update({f"{h}_bucket", f"{h}_sum", f"{h}_count"})
    return {f"sparkwatch_{n}" for n in names}
