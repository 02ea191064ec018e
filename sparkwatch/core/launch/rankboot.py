"""The boot of an engine across nodes, as launch shows it: besides the head's own phases (core.launch.bootphase),
where each of its ranks stands in Ray (issue 30).

A rank placed on another node boots there, in output the head never shows; the field's two-Spark boots hang for
minutes "waiting for creating a placement group" or with one rank PENDING_CREATION. Launch reads Ray's state while
the engine boots and names each rank's node and state when they change. Ready stays what it is on one node: the first
good completion at the head's API, which serves only once every rank is up.

Pure: the caller passes Ray's state (telemetry.sources.raystate) and the pids of the launched tree.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sparkwatch.core.kill.raygroup import RayState, groups


@dataclass(frozen=True, slots=True)
class RankView:
    group: str  # the placement group's id
    ranks: tuple[tuple[str, str], ...]  # (node address, actor state) of each rank, by address (Ray's order varies)

    @property
    def alive(self) -> int:
        return sum(1 for _node, state in self.ranks if state == "ALIVE")

    def line(self) -> str:
        each = ", ".join(f"{node} {state}" for node, state in self.ranks)
        return f"ranks: {self.alive} of {len(self.ranks)} alive ({each})"


def rank_view(state: RayState, tree_pids: Collection[int]) -> RankView | None:
    """The ranks of the group whose driver is in the launched tree; None before Ray lists one."""
    ips = {n.node_id: n.node_ip for n in state.nodes}
    for group in groups(state):
        if group.job is None or group.job.driver_pid not in tree_pids:
            continue
        return RankView(
            group.group, tuple(sorted((ips.get(a.node_id) or a.node_id[:12], a.state) for a in group.ranks))
        )
    return None
