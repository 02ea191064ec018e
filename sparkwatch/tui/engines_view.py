"""`sparkwatch engines`: one table per engine tree, drawn as a tree (root, workers, compilers); with --all, the GPU
holders no rule names (what the guard would not kill); the groups over Ray that span nodes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sparkwatch.core.engines.identity import EngineRules
from sparkwatch.core.engines.proctree import tree_rows
from sparkwatch.core.model import EngineTree, GpuHolder
from sparkwatch.core.redact import redact
from sparkwatch.core.units import format_size
from sparkwatch.core.words import plural

if TYPE_CHECKING:  # the groups' records: loaded by whoever found a group, never for a node without one
    from sparkwatch.core.kill.mpgroup import Member
    from sparkwatch.core.kill.raygroup import GroupRow

ROLE_STYLE = {"root": "bold", "worker": "cyan", "compiler": "yellow", "process": "dim"}


def tree_heading(tree: EngineTree) -> str:
    return (
        f"{tree.kind}  root {tree.root.pid}  {plural(len(tree.members), 'process')}  {format_size(tree.rss_bytes)} RSS"
    )


def tree_table(tree: EngineTree, rules: EngineRules) -> Table:
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 2, 0, 0))
    table.add_column("PID", no_wrap=True)
    table.add_column("RSS", justify="right", no_wrap=True)
    table.add_column("ROLE", no_wrap=True)
    table.add_column("NAME", no_wrap=True, overflow="ellipsis")
    for row in tree_rows(tree, rules):
        table.add_row(
            Text(f"{row.prefix}{row.proc.pid}"),
            format_size(row.proc.rss_bytes),
            Text(row.role, style=ROLE_STYLE.get(row.role, "")),
            Text(redact(row.proc.display_name) + (" <defunct>" if row.proc.state == "Z" else "")),
        )
    return table


def holders_view(holders: Sequence[GpuHolder], gpu_note: str | None) -> RenderableType:
    """The GPU holders no rule names; `gpu_note` says why none could be listed (NVML down)."""
    if gpu_note:
        return Text(f"GPU holders: {gpu_note}", style="dim")
    if not holders:
        return Text("GPU holders: every one is in an engine tree")
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 2, 0, 0))
    table.add_column("PID", no_wrap=True)
    table.add_column("GPU MEM", justify="right", no_wrap=True)
    table.add_column("NAME", no_wrap=True, overflow="ellipsis")
    for h in holders:
        used = "?" if h.used_gpu_memory_bytes is None else format_size(h.used_gpu_memory_bytes)
        table.add_row(str(h.proc.pid), used, Text(redact(h.proc.display_name)))
    heading = Text("GPU holders that are not engines (the guard does not kill them; see guard_gpu_holders)", "bold")
    return Group(heading, table)


def engines_view(
    trees: Sequence[EngineTree],
    rules: EngineRules,
    holders: Sequence[GpuHolder] | None = None,
    gpu_note: str | None = None,
    budgets: Mapping[int, str] | None = None,
    *,
    serving: Mapping[int, str] | None = None,
    containers: Mapping[int, str] | None = None,
    containers_note: str | None = None,
) -> RenderableType:
    """`containers`: root pid -> the line naming the tree's container (its root's parent is the runtime's shim);
    `containers_note`: why they are named by id only (the Docker socket could not be read), said once."""
    parts: list[RenderableType] = []
    if not trees:
        parts.append(Text("no engine processes"))
    if containers_note:
        parts.append(Text(containers_note, style="dim"))
    for i, tree in enumerate(trees):
        if i:
            parts.append(Text(""))
        parts.append(Text(tree_heading(tree), style="bold"))
        if containers and tree.root.pid in containers:
            parts.append(Text(containers[tree.root.pid], style="cyan"))
        if budgets and tree.root.pid in budgets:
            parts.append(Text(budgets[tree.root.pid]))
        if serving and tree.root.pid in serving:
            text = serving[tree.root.pid]
            parts.append(Text(text, style="bold red" if text.startswith("NOT SERVING") else ""))
        parts.append(tree_table(tree, rules))
    if holders is not None or gpu_note:
        parts.append(Text(""))
        parts.append(holders_view(holders or (), gpu_note))
    return Group(*parts) if len(parts) > 1 else parts[0]


def groups_view(groups: Sequence[GroupRow], note: str | None) -> RenderableType:
    """One table per group over Ray: its driver and ranks, each with its node and state, `here` for this node's."""
    if note:
        return Text(f"Groups over Ray: {note}", style="dim")
    parts: list[RenderableType] = []
    for group in groups:
        if parts:
            parts.append(Text(""))
        nodes = f"{plural(len(group.nodes), 'node')}: {', '.join(group.nodes)}"
        head = f"group {group.group[:12]}  job {group.job_id}  {nodes}"
        parts.append(Text(head, style="bold"))
        if group.death is not None:
            d = group.death
            where = d.node_ip or d.node_id[:12] or "no node (Ray never placed it)"
            parts.append(Text(f"lost a member: {d.cause} on {where} (pid {d.pid or '?'})", style="bold red"))
        table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 2, 0, 0))
        for column in ("ROLE", "NODE", "PID", "STATE", "NAME", ""):
            table.add_column(column, no_wrap=True)
        for m in group.members:
            state_style = "" if m.state in ("ALIVE", "RUNNING") else "red"
            table.add_row(
                m.role,
                m.node_ip or m.node_id[:12],
                str(m.pid or "?"),
                Text(m.state, style=state_style),
                Text(redact(m.name)),
                Text("here", style="cyan") if m.local else "",
            )
        parts.append(table)
    return Group(Text("Groups over Ray (engines that span nodes)", style="bold"), *parts)


def local_groups_view(members: Sequence[Member]) -> RenderableType:
    """This node's members of groups without Ray, one line each (the other nodes list theirs)."""
    from sparkwatch.core.kill.mpgroup import member_role  # noqa: PLC0415 - only with a group to draw

    lines = [Text("Groups without Ray (this node's members; the other nodes list theirs)", style="bold")]
    for m in members:
        rank = "rpc-server" if member_role(m) == "rpc-server" else f"node rank {m.node_rank}"
        lines.append(Text(f"group {m.key}  {rank}  pid {m.pid}  here"))
    return Group(*lines)
