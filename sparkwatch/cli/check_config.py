"""`sparkwatch check-config`: validate the configuration and print the effective settings."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "check-config",
        parents=[parent],
        help="validate config, print the effective settings",
        description="Validate the configuration (defaults < config file < SPARKWATCH_<KEY> environment < flags) "
        "and print the effective settings, secrets masked. A bad value or an unknown key is one line naming the "
        "key, exit 2. `sparkwatch assets write DIR` writes config.example.toml with every key.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from

    settings = settings_from(args, check_memory=True)
    for warning in settings.warnings():
        print(f"sparkwatch: WARNING {warning}", file=sys.stderr)
    peers = None
    if settings.peers:
        from sparkwatch.common.peerproof import settings_line

        peers, display_only = settings_line(settings)
        if display_only:  # the peers' word moves nothing: said where a human looks (issue 37)
            print(f"sparkwatch: WARNING {peers}", file=sys.stderr)
    data = settings.public_dict()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    width = max(len(k) for k in data)
    for key, value in data.items():
        shown = ", ".join(map(str, value)) if isinstance(value, list) else ("-" if value is None else value)
        print(f"{key:<{width}}  {shown}")
    if peers is not None:
        print(peers)
    print("config ok")
    return 0
