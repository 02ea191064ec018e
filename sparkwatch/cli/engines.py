"""`sparkwatch engines [--json]`: the engine trees the guard would kill now."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from sparkwatch.core.redact import safe_cmdline
from sparkwatch.model import EngineTree

if TYPE_CHECKING:
    from sparkwatch.config import Settings
    from sparkwatch.core.policy import Candidate
    from sparkwatch.sources.engines import EngineFinder


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("engines", parents=[parent], help="list the engine trees the guard would kill now")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--window", type=float, default=1.0, metavar="S", help="seconds to watch for growth before ranking (0: none)"
    )
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


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.sources.engines import EngineFinder

    # The trees the guard would kill now: this user's engines, or every user's when run as root.
    settings = settings_from(args)
    finder = EngineFinder.from_settings(settings)
    trees, ranking = kill_order_now(finder, settings, max(args.window, 0.0))
    from sparkwatch.tui.kill_order_view import kill_order_json, kill_order_view

    if args.json:
        print(json.dumps({"engines": [tree_json(t) for t in trees], "kill_order": kill_order_json(ranking)}, indent=2))
        return 0
    from rich.console import Group
    from rich.text import Text

    from sparkwatch.tui.console import emit
    from sparkwatch.tui.engines_view import engines_view

    emit(Group(engines_view(trees, finder.rules), *((Text(""), kill_order_view(ranking)) if trees else ())))
    return 0


def kill_order_now(
    finder: EngineFinder, settings: Settings, window_s: float
) -> tuple[list[EngineTree], tuple[Candidate, ...]]:
    """Two scans `window_s` apart, ranked as the guard ranks (core.policy; no GPU bytes: this command has no NVML)."""
    import time

    from sparkwatch.core import policy

    params = policy.PolicyParams.build(settings.kill_order, settings.kill_priority, settings.never_kill)
    history = policy.GrowthHistory()
    if window_s > 0:
        history = policy.observe(history, time.monotonic(), finder.find(), None)
        time.sleep(window_s)
    now = time.monotonic()
    trees = finder.find()
    history = policy.observe(history, now, trees, None)
    return trees, policy.rank(trees, history, now, None, params)
