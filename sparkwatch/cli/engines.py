"""`sparkwatch engines [--json]`: the engine trees the guard would kill now."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from sparkwatch.core.redact import safe_cmdline
from sparkwatch.model import EngineTree
from sparkwatch.units import format_size


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
                "name": p.display_name,
                "rss_bytes": p.rss_bytes,
                "cmdline": safe_cmdline(p.argv),
            }
            for p in tree.members
        ],
    }


def current_trees(args: argparse.Namespace) -> list[EngineTree]:
    from sparkwatch.cli import settings_from
    from sparkwatch.core.engines import EngineRules, Scope, find_engine_trees
    from sparkwatch.sources.procs import ProcScanner

    settings = settings_from(args)
    rules = EngineRules.build(settings.engine_patterns, settings.protect_patterns)
    scope = Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=settings.ancestor_pid)
    return find_engine_trees(ProcScanner(settings.proc_root).scan().procs, rules, scope)


def handle(args: argparse.Namespace) -> int:
    trees = current_trees(args)
    if args.json:
        print(json.dumps({"engines": [tree_json(t) for t in trees]}, indent=2))
        return 0
    if not trees:
        print("no engine processes")
        return 0
    for tree in trees:
        print(f"{tree.kind}  root {tree.root.pid}  {len(tree.members)} processes  {format_size(tree.rss_bytes)} RSS")
        for p in tree.members:
            print(f"  {p.pid:>8}  {format_size(p.rss_bytes):>10}  {p.display_name}")
    return 0
