"""The other nodes' agents (`peers`) as metrics (a collector of its own on the registry): whether each is lost and
whether its word is proven; and how long this agent's own port was held by another process (issue 37).

From telemetry.peerwatch's view of its peers (docs/multinode.md). A peer gets a series once it answered: before
that there is nothing it could have stopped saying. Lost: silent for 3 reads, or no document taken for
`peer_lost_after_s` (refused, an HTTP error, a bad proof); one Prometheus scraping every node alerts on a lost one
(SparkwatchPeerLost). Proven: its documents carry the pair's proof (peer_key_file) or come over mutual TLS; 0 is a
display-only peer, whose word moves nothing. Proof failures are counted in sparkwatch_internal_errors_total
(component peers, kind peer_errors_bad_proof).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sparkwatch.telemetry.exporter.families import gauge
from sparkwatch.telemetry.peerwatch import PeerState


class PeerCollector(Collector):
    def __init__(
        self, view: Callable[[], Iterable[PeerState]], port_taken_s: Callable[[], float] | None = None
    ) -> None:
        """`port_taken_s`: the metrics server's (exporter.server.MetricsServer.port_taken_s)."""
        self.view = view
        self.port_taken_s = port_taken_s

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.port_taken_s is not None:
            taken = gauge("listen_port_taken_seconds")
            taken.add_metric([], round(self.port_taken_s(), 3))
            yield taken
        peers = tuple(self.view())
        if not peers:
            return
        lost = gauge("peer_lost", labels=["peer", "node"])
        proven = gauge("peer_proven", labels=["peer", "node"])
        for p in peers:
            lost.add_metric([p.peer, p.node], 1 if p.lost else 0)
            proven.add_metric([p.peer, p.node], 1 if p.proven else 0)
        yield lost
        yield proven
