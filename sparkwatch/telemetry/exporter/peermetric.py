"""The other nodes' agents (`peers`) as metrics (a collector of its own on the registry): whether each is lost.

From telemetry.peerwatch's view of its peers (docs/multinode.md). A peer gets a series once it answered: before
that there is nothing it could have stopped saying. A refused connection (its agent stopped, its node alive) is not
a loss; one Prometheus scraping every node alerts on a lost one (SparkwatchPeerLost).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sparkwatch.telemetry.exporter.families import gauge
from sparkwatch.telemetry.peerwatch import PeerState


class PeerCollector(Collector):
    def __init__(self, view: Callable[[], Iterable[PeerState]]) -> None:
        self.view = view

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        peers = tuple(self.view())
        if not peers:
            return
        lost = gauge("peer_lost", labels=["peer", "node"])
        for p in peers:
            lost.add_metric([p.peer, p.node], 1 if p.lost else 0)
        yield lost
