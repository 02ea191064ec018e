"""`sparkwatch engines`: one table per engine tree, drawn as a tree (root, workers, compilers)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sparkwatch.core.engines import EngineRules
from sparkwatch.core.proctree import tree_rows
from sparkwatch.core.redact import redact
from sparkwatch.model import EngineTree
from sparkwatch.units import format_size

ROLE_STYLE = {"root": "bold", "worker": "cyan", "compiler": "yellow", "process": "dim"}


def tree_heading(tree: EngineTree) -> str:
    count = len(tree.members)
    return (
        f"{tree.kind}  root {tree.root.pid}  {count} process{'es' if count != 1 else ''}  "
        f"{format_size(tree.rss_bytes)} RSS"
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


def engines_view(trees: Sequence[EngineTree], rules: EngineRules) -> RenderableType:
    if not trees:
        return Text("no engine processes")
    parts: list[RenderableType] = []
    for i, tree in enumerate(trees):
        if i:
            parts.append(Text(""))
        parts.append(Text(tree_heading(tree), style="bold"))
        parts.append(tree_table(tree, rules))
    return Group(*parts)
