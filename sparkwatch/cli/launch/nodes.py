"""The other nodes of an engine that spans nodes, as `sparkwatch launch` plans them (core.launch.nodeplan).

Each worker node's pool comes from its own agent (`peers`: the peer document's `memory`, read once with its
raylets, cli.peerread.read_peers), held above that node's own floor; where no agent answers, from Ray's dashboard
(its reporter's MemAvailable, marked `ray`, held above this node's floor); else the node's share is not checked, and
the plan says so. The head is this node: its plan is launch's own.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from sparkwatch.cli.launch.raycheck import HERE
from sparkwatch.core.launch.nodeplan import NodeInput, NodePlan, Role, ViewSource, plan_nodes
from sparkwatch.core.launch.plan import FreeSource, MemoryView, Plan, auto_budget

if TYPE_CHECKING:
    from sparkwatch.cli.launch.gather import PlanContext
    from sparkwatch.cli.launch.raycheck import RayletCheck
    from sparkwatch.cli.peerread import PeerReading
    from sparkwatch.config.settings import Settings


def node_plans(
    settings: Settings,
    plan: Plan,
    ctx: PlanContext,
    *,
    peers: Sequence[PeerReading],
    raylets: Sequence[RayletCheck],
    engine_reads: FreeSource | None = None,
    worker_budget: int | str | None = None,
) -> tuple[NodePlan, ...]:
    """The head (this node, launch's own plan) and span.nodes - 1 worker nodes: the peers whose agents answered,
    in the order `peers` lists them, then the nodes only Ray's dashboard knows, then those nothing answered for."""
    span = ctx.span
    if span is None:
        raise ValueError("node_plans: the engine spans no nodes")
    here = socket.gethostname()
    wanted = span.nodes - 1
    workers: list[NodeInput] = []
    for peer in peers:
        mem = peer.doc.memory if peer.doc is not None else None
        if peer.doc is None or mem is None:
            continue
        view = MemoryView(mem.total_bytes, mem.available_bytes, mem.free_bytes, mem.cached_bytes, mem.floor_bytes,
                          plan.view.margin_bytes, cpus=mem.cpus)  # fmt: skip
        workers.append(NodeInput(peer.doc.node, Role.WORKER, view, ViewSource.AGENT, _lines(raylets, peer.label)))
    if len(workers) < wanted and span.ray:
        workers += _ray_view(settings, plan, peers, raylets)
    silent = [p.label for p in peers if p.doc is None or p.doc.memory is None]
    while len(workers) < wanted:
        name = silent.pop(0) if silent else f"node {len(workers) + 1}"
        workers.append(NodeInput(name, Role.WORKER, None, ViewSource.NONE))
    head = NodePlan(here, Role.HEAD, ViewSource.LOCAL, plan, _lines(raylets, HERE))
    rest = plan_nodes(ctx.cmd, ctx.facts, span, workers[:wanted], jobs=plan.estimate.jobs,
                      engine_version=ctx.engine_version, engine_reads=engine_reads)  # fmt: skip
    if worker_budget is not None:  # one size for the role, as each worker node's guard holds it there
        rest = _with_budget(rest, worker_budget)
    return (head, *rest)


def _with_budget(workers: tuple[NodePlan, ...], budget: int | str) -> tuple[NodePlan, ...]:
    """`worker=SIZE` on every worker whose share is known; `worker=auto`: the largest share plus 10 % (one budget for
    the role: over Ray the workers' guards are told one size for the group)."""
    known = [n.plan for n in workers if n.plan is not None]
    if not known:
        return workers
    size = budget if isinstance(budget, int) else max(auto_budget(p.needs_bytes, p.view.margin_bytes) for p in known)
    return tuple(n if n.plan is None else replace(n, plan=replace(n.plan, budget_bytes=size)) for n in workers)


def _lines(raylets: Sequence[RayletCheck], node: str) -> tuple[str, ...]:
    return tuple(p.line() for where, _raylet, lacks, _fix in raylets if where == node for p in lacks)


def _ray_view(
    settings: Settings, plan: Plan, peers: Sequence[PeerReading], raylets: Sequence[RayletCheck]
) -> list[NodeInput]:
    """The nodes Ray's dashboard knows that are neither this one nor an answering peer's, as Ray's reporter last
    saw their memory (MemAvailable; MemFree unknown, taken as MemAvailable). Their floor is not known here: this
    node's stands in for it, and the node's line says whose figures they are."""
    from sparkwatch.telemetry.sources.raystate import RayStateError, RayStateSource

    local = {r.node for where, r, _lacks, _fix in raylets if where == HERE}  # this node's address, as Ray knows it
    # an answering peer's node, by the addresses its raylets serve (host names can repeat: containers, test hosts)
    answered = {r.node for p in peers if p.doc is not None and p.doc.memory is not None for r in p.doc.raylets}
    source = RayStateSource(settings.ray_dashboard_url)
    try:
        nodes = source.poll_node_memory()
    except RayStateError:
        return []
    finally:
        source.close()
    out = []
    for n in sorted(nodes, key=lambda n: n.node_ip):
        if n.node_ip in local or n.node_ip in answered:
            continue
        view = MemoryView(n.total_bytes, n.available_bytes, n.available_bytes, 0, plan.view.floor_bytes,
                          plan.view.margin_bytes, cpus=n.cpus)  # fmt: skip
        out.append(NodeInput(n.node_ip, Role.WORKER, view, ViewSource.RAY))
    return out
