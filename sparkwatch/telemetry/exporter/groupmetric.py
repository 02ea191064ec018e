"""Engine groups over Ray as metrics (a collector of its own on the registry, beside the internal counters): how many
members each group has alive and dead on each node, which Ray nodes are up, and what this node's group watch did.

From telemetry.raywatch's last view of Ray's state (docs/multinode.md). Nothing here while no raylet runs on this
node: a box without Ray exports none of these families. One Prometheus scraping both Sparks sees each group from
both nodes' agents; the alert rules compare them by `cluster` (docs/multinode.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sparkwatch.telemetry.exporter.families import counter, gauge
from sparkwatch.telemetry.raywatch import GroupView

ALIVE_STATES = frozenset({"ALIVE", "RUNNING"})  # a rank's actor state, a driver's job state


class GroupCollector(Collector):
    def __init__(self, view: Callable[[], GroupView | None]) -> None:
        self.view = view

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        view = self.view()
        if view is None:
            return
        alive: Counter[tuple[str, str, str]] = Counter()
        dead: Counter[tuple[str, str, str]] = Counter()
        for row in view.rows:
            for m in row.members:
                key = (row.group, m.node_ip or m.node_id, m.role)
                (alive if m.state in ALIVE_STATES else dead)[key] += 1
        members = gauge("group_members", labels=["group", "node", "role"])
        dead_members = gauge("group_dead_members", labels=["group", "node", "role"])
        for key in sorted(alive.keys() | dead.keys()):
            members.add_metric(list(key), alive[key])
            dead_members.add_metric(list(key), dead[key])
        yield members
        yield dead_members
        # Ray keeps a dead node's record after the node comes back under a new id at the same address: one series
        # per address, up while any of its records is alive.
        nodes: dict[str, bool] = {}
        for node in view.nodes:
            where = node.node_ip or node.node_id
            nodes[where] = nodes.get(where, False) or node.alive
        up = gauge("ray_node_up", labels=["node"])
        for where in sorted(nodes):
            up.add_metric([where], 1 if nodes[where] else 0)
        yield up
        yield counter("group_teardown_requests", value=view.teardowns_sent_total)
        yield counter("group_placement_groups_removed", value=view.pg_removed_total)
