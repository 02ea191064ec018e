"""The metrics endpoint's encoders, without prometheus_client's exposition module.

prometheus_client's text encoder and its Accept-header choice live in `prometheus_client.exposition`, which imports
ssl, urllib.request, http.server, wsgiref and gzip at its top for its push gateway and its own servers, none of
which telemetry uses: about 9.6 MiB RSS on the 2-core VM (bare python 10.6 -> 20.0), libcrypto's 3.4 MiB mapping
among them on the H200 (bench/RESULTS-rss-gpu.md). And the package's `__init__` imports that module whatever
submodule is asked for. So:
- `defer_package_init` (exporter/__init__.py, run before the exporter's first prometheus_client import) registers
  the package without running its `__init__`: submodules (metrics_core, registry, openmetrics.exposition) import as
  usual, and the first attribute asked of the package itself (`from prometheus_client import generate_latest`, as
  tests and other tools do) runs the real `__init__` then, so nothing else sees a difference;
- `choose_encoder` and `generate_text` are prometheus_client 0.26's `choose_encoder` and text `generate_latest`,
  step for step, over its own escaping helpers (openmetrics.exposition, a light module); OpenMetrics is its own
  encoder. tests/test_metrics_exposition.py holds them to prometheus_client's output byte for byte, Accept header
  by Accept header.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import TYPE_CHECKING

from prometheus_client.openmetrics import exposition as om
from prometheus_client.utils import floatToGoString, parse_version

try:  # the internals the copies below use, as prometheus_client 0.26 has them
    from prometheus_client.validation import _is_valid_legacy_metric_name

    _LIGHT = all(hasattr(om, a) for a in ("ALLOWUTF8", "UNDERSCORES", "escape_metric_name", "escape_label_name"))
except ImportError:
    _LIGHT = False

if TYPE_CHECKING:
    from prometheus_client.registry import Collector
    from prometheus_client.samples import Sample

CONTENT_TYPE_PLAIN_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_PLAIN_1_0_0 = "text/plain; version=1.0.0; charset=utf-8"

Encoder = Callable[["Collector"], bytes]
_go_float: Callable[[float], str] = floatToGoString  # untyped upstream


# A scrape escapes a metric and a label name per sample (about 400 samples, a few dozen distinct names, all the
# exporter's own): each is escaped once and remembered. The regex checks behind them were a fifth of a render's time
# (1.7 ms on the 2-core VM for the golden scenario's 407 lines).
_metric_name = lru_cache(maxsize=1024)(om.escape_metric_name)
_label_name = lru_cache(maxsize=1024)(om.escape_label_name)


def _escape_value(value: str) -> str:
    return str(om._escape(value, om.ALLOWUTF8, False))  # type: ignore[arg-type] # as upstream calls it


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def generate_text(registry: Collector, escaping: str = "underscores") -> bytes:
    """The Prometheus text format: prometheus_client 0.26's `exposition.generate_latest`, unchanged."""

    def sample_line(samples: Sample) -> str:
        if samples.labels:
            # Label values always support UTF-8
            labelstr = ",".join(
                f'{_label_name(k, escaping)}="{_escape_value(v)}"' for k, v in sorted(samples.labels.items())
            )
        else:
            labelstr = ""
        timestamp = ""
        if samples.timestamp is not None:
            # Convert to milliseconds.
            timestamp = f" {int(float(samples.timestamp) * 1000):d}"
        if escaping != om.ALLOWUTF8 or _is_valid_legacy_metric_name(samples.name):
            if labelstr:
                labelstr = f"{{{labelstr}}}"
            return f"{_metric_name(samples.name, escaping)}{labelstr} {_go_float(samples.value)}{timestamp}\n"
        maybe_comma = ""
        if labelstr:
            maybe_comma = ","
        return (
            f"{{{_metric_name(samples.name, escaping)}{maybe_comma}{labelstr}}} {_go_float(samples.value)}{timestamp}\n"
        )

    output = []
    for metric in registry.collect():
        try:
            mname = metric.name
            mtype = metric.type
            # Munging from OpenMetrics into Prometheus format.
            if mtype == "counter":
                mname = mname + "_total"
            elif mtype == "info":
                mname = mname + "_info"
                mtype = "gauge"
            elif mtype == "stateset":
                mtype = "gauge"
            elif mtype == "gaugehistogram":
                # A gauge histogram is really a gauge,
                # but this captures the structure better.
                mtype = "histogram"
            elif mtype == "unknown":
                mtype = "untyped"

            output.append(f"# HELP {_metric_name(mname, escaping)} {_escape_help(metric.documentation)}\n")
            output.append(f"# TYPE {_metric_name(mname, escaping)} {mtype}\n")

            om_samples: dict[str, list[str]] = {}
            for s in metric.samples:
                for suffix in ["_created", "_gsum", "_gcount"]:
                    if s.name == metric.name + suffix:
                        # OpenMetrics specific sample, put in a gauge at the end.
                        om_samples.setdefault(suffix, []).append(sample_line(s))
                        break
                else:
                    output.append(sample_line(s))
        except Exception as exception:
            exception.args = (exception.args or ("",)) + (metric,)
            raise

        for suffix, lines in sorted(om_samples.items()):
            name = _metric_name(metric.name + suffix, escaping)
            output.append(f"# HELP {name} {_escape_help(metric.documentation)}\n")
            output.append(f"# TYPE {name} gauge\n")
            output.extend(lines)
    return "".join(output).encode("utf-8")


def choose_encoder(accept_header: str) -> tuple[Encoder, str]:
    """The encoder and Content-Type for an Accept header: prometheus_client 0.26's `exposition.choose_encoder`."""
    accept_header = accept_header or ""
    escaping = om.UNDERSCORES
    for accepted in accept_header.split(","):
        if accepted.split(";")[0].strip() == "application/openmetrics-text":
            toks = accepted.split(";")
            version = _get_version(toks)
            escaping = _get_escaping(toks)
            # Only return an escaping header if we have a good version and
            # mimetype.
            if not version:
                return (
                    partial(om.generate_latest, escaping=om.UNDERSCORES, version="1.0.0"),
                    om.CONTENT_TYPE_LATEST,
                )
            if version and parse_version(version) >= (1, 0, 0):
                return (
                    partial(om.generate_latest, escaping=escaping, version=version),
                    f"application/openmetrics-text; version={version}; charset=utf-8; escaping=" + str(escaping),
                )
        elif accepted.split(";")[0].strip() == "text/plain":
            toks = accepted.split(";")
            version = _get_version(toks)
            escaping = _get_escaping(toks)
            # Only return an escaping header if we have a good version and
            # mimetype.
            if version and parse_version(version) >= (1, 0, 0):
                return (
                    partial(generate_text, escaping=escaping),
                    CONTENT_TYPE_PLAIN_1_0_0 + "; escaping=" + str(escaping),
                )
    return generate_text, CONTENT_TYPE_PLAIN_0_0_4


def _get_version(accept_header: list[str]) -> str:
    for tok in accept_header:
        if "=" not in tok:
            continue
        key, value = tok.strip().split("=", 1)
        if key == "version":
            return value
    return ""


def _get_escaping(accept_header: list[str]) -> str:
    for tok in accept_header:
        if "=" not in tok:
            continue
        key, value = tok.strip().split("=", 1)
        if key != "escaping":
            continue
        if value in (om.ALLOWUTF8, om.UNDERSCORES, om.DOTS, om.VALUES):
            return str(value)
        return str(om.UNDERSCORES)
    return str(om.UNDERSCORES)


if not _LIGHT:  # another prometheus_client than the one these copy: its own exposition module, heavier and right
    from prometheus_client import exposition as _upstream

    choose_encoder = _upstream.choose_encoder
    generate_text = _upstream.generate_latest
