"""`sparkwatch events [-n N] [--json]`: the last events from the event log."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("events", parents=[parent], help="show the last events")
    p.add_argument("-n", type=int, default=20, metavar="N", help="how many (default 20)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--state-dir", metavar="DIR", help="where events.jsonl lives")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.common.events import read_events
    from sparkwatch.tui.events_view import event_lines

    settings = settings_from(args, state_dir=args.state_dir)
    if args.n <= 0:
        return 0
    events = read_events(settings.events_path, args.n)
    if args.json:
        for event in events:
            print(json.dumps(event))
        return 0
    if not events:
        print(f"no events in {settings.events_path}")
        return 0
    # Plain lines on purpose, also on a terminal: one event per line, never wrapped, so grep and less work on it.
    print("\n".join(event_lines(events)))
    return 0
