"""`sparkwatch engines [--json]`: the engine trees the guard would kill now."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sparkwatch.core.redact import redact, safe_cmdline
from sparkwatch.model import EngineTree


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("engines", parents=[parent], help="list the engine trees the guard would kill now")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=handle)


def tree_json(tree: EngineTree) -> dict[str, object]:
    return {
        "root_pid": tree.root.pid,
        "engine": tree.kind,
        "rss_bytes": tree.rss_bytes,
        "members": [
            {
                "pid": p.pid,
                "ppid": p.ppid,
                "name": redact(p.display_name),
                "rss_bytes": p.rss_bytes,
                "cmdline": safe_cmdline(p.argv),
            }
            for p in tree.members
        ],
    }


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.sources.engines import EngineFinder

    # The trees the guard would kill now: this user's engines, or every user's when run as root.
    finder = EngineFinder.from_settings(settings_from(args))
    trees = finder.find()
    if args.json:
        print(json.dumps({"engines": [tree_json(t) for t in trees]}, indent=2))
        return 0
    from sparkwatch.tui.console import emit
    from sparkwatch.tui.engines_view import engines_view

    emit(engines_view(trees, finder.rules))
    return 0
