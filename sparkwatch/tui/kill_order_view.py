"""`sparkwatch engines`: the order in which the guard would kill the engine trees now, and why (core.kill.policy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sparkwatch.core.redact import redact

if TYPE_CHECKING:
    from sparkwatch.core.kill.policy import Candidate


def kill_order_json(ranking: Sequence[Candidate]) -> list[dict[str, object]]:
    return [
        {
            "order": None if c.never_kill is not None else i + 1,
            "root_pid": c.tree.root.pid,
            "engine": c.tree.kind,
            "name": redact(c.tree.root.display_name),
            "growing": c.growing,
            "growth_bytes": c.growth_bytes,
            "rss_bytes": c.rss_bytes,
            "gpu_bytes": c.gpu_bytes,
            "kill_priority": c.priority,
            "never_kill": None if c.never_kill is None else redact(c.never_kill),
            "why": [redact(r) for r in c.reasons],
        }
        for i, c in enumerate(ranking)
    ]


def kill_order_view(ranking: Sequence[Candidate]) -> RenderableType:
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 2, 0, 0))
    table.add_column("KILL", justify="right", no_wrap=True)
    table.add_column("ROOT", no_wrap=True)
    table.add_column("ENGINE", no_wrap=True)
    table.add_column("NAME", no_wrap=True, overflow="ellipsis")
    table.add_column("WHY", overflow="fold")
    for i, c in enumerate(ranking):
        order = (
            Text("never", style="green")
            if c.never_kill is not None
            else Text(str(i + 1), style="bold red" if i == 0 else "")
        )
        name, why = redact(c.tree.root.display_name), redact("; ".join(c.reasons))  # titles are the user's: no secrets
        table.add_row(order, str(c.tree.root.pid), c.tree.kind, Text(name), Text(why))
    return Group(
        Text("kill order (one tree per firing, the next only if memory stays under the floor)", style="bold"), table
    )
