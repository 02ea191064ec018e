"""One read of an engine's progress counters, after a failed serving probe (core.engines.progress says what they are).

`GET /metrics` on the listening socket the engine owns, the one the probe dialled (telemetry/probewatch.py checks the
ownership first: another process's server on that port is never asked), with the probe's key in one header where the
engine checks one. One deadline for the whole exchange and a cap on the answer (telemetry.sources.httpget): a vLLM
exposition is ~100 KiB (its histograms' buckets); an answer past METRICS_MAX_BYTES is cut and, lacking its counters,
reads as no answer, never as an engine without counters. Read only after a failed probe, never on a good one.
"""

from __future__ import annotations

from sparkwatch.core.engines.progress import MetricsRead, Read, parse_counters

METRICS_PATH = "/metrics"
METRICS_MAX_BYTES = 4 << 20
METRICS_TIMEOUT_MAX_S = 5.0  # the probe thread waits this long at most for the counters, whatever probe_timeout_s is


def read_counters(host: str, port: int, *, prefix: str = "", key: str | None = None, timeout_s: float) -> MetricsRead:
    """The engine's progress counters; never raises for what the engine or the network does."""
    # h11 at the first failed probe only: telemetry with no engine failing a probe loads no HTTP client (0.5 MiB)
    from sparkwatch.telemetry.sources.httpget import HttpGet, HttpGetError  # noqa: PLC0415

    headers: tuple[tuple[str, str], ...] = (("User-Agent", "sparkwatch-probe"), ("Accept", "text/plain"))
    if key:
        headers += (("Authorization", f"Bearer {key}"),)
    client = HttpGet(host, port, headers=headers)
    try:
        status, body, cut = client.get(prefix + METRICS_PATH, min(timeout_s, METRICS_TIMEOUT_MAX_S), METRICS_MAX_BYTES)
    except HttpGetError as exc:
        return MetricsRead(Read.UNREAD, error=f"{METRICS_PATH}: {exc}")
    finally:
        client.close()
    if status in (401, 403):
        return MetricsRead(Read.UNREAD, error=f"{METRICS_PATH}: HTTP {status}")  # a key we do not know: says nothing
    if status in (404, 405, 501):  # not served: llama-cpp-python's server, llama-server without --metrics
        return MetricsRead(Read.NONE, error=f"{METRICS_PATH}: HTTP {status}")
    if status != 200:
        return MetricsRead(Read.UNREAD, error=f"{METRICS_PATH}: HTTP {status}")
    counters = parse_counters(body.decode("utf-8", "replace"))
    if counters is None:
        if cut:
            return MetricsRead(Read.UNREAD, error=f"{METRICS_PATH}: over {METRICS_MAX_BYTES >> 20} MiB")
        return MetricsRead(Read.NONE, error=f"{METRICS_PATH}: no progress counters")
    return MetricsRead(Read.COUNTERS, counters)
