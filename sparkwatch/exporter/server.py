"""The metrics endpoint: prometheus_client's own HTTP server on a private registry, with optional TLS/mTLS.

The registry holds only sparkwatch's collector (no process/platform/gc collectors: they would do /proc I/O at scrape
time and add names outside the contract).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import start_http_server

from sparkwatch.config import Settings
from sparkwatch.exporter.collector import EventLogLike, GuardLike, KernelLogLike, OutboxLike, SparkwatchCollector
from sparkwatch.model import Snapshot


def build_registry(
    settings: Settings,
    latest: Callable[[], Snapshot | None],
    guard: GuardLike | None = None,
    events: EventLogLike | None = None,
    outbox: OutboxLike | None = None,
    *,
    kernel_log: KernelLogLike | None = None,
) -> CollectorRegistry:
    """`kernel_log`: the guard's KernelLogWatch (taken from `guard.kernlog` when not given)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        SparkwatchCollector(latest, settings=settings, guard=guard, events=events, outbox=outbox, kernel_log=kernel_log)
    )
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


class MetricsServer:
    """A daemon component: serves `registry` on settings.listen until stopped."""

    def __init__(self, settings: Settings, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self._server: Any = None
        self._thread: Any = None

    @property
    def port(self) -> int:
        """The bound port (useful with listen port 0 in tests)."""
        if self._server is None:
            return self.settings.listen_port
        return int(self._server.server_address[1])

    def start(self) -> None:
        s = self.settings
        self._server, self._thread = start_http_server(
            s.listen_port,
            addr=s.listen_host,
            registry=self.registry,
            certfile=str(s.tls_cert_file) if s.tls_cert_file else None,
            keyfile=str(s.tls_key_file) if s.tls_key_file else None,
            client_cafile=str(s.tls_client_ca_file) if s.tls_client_ca_file else None,
            client_auth_required=s.tls_client_ca_file is not None,
        )

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
