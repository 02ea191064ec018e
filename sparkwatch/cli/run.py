"""`sparkwatch run [--dry-run]`: the daemon."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[parent], help="run the daemon: guard, telemetry, exporter, alerts")
    p.add_argument("--dry-run", action="store_true", default=None, help="decide and record, signal nothing")
    p.add_argument("--floor", metavar="SIZE", help="MemAvailable kill floor, e.g. 8GiB")
    p.add_argument("--listen", metavar="HOST:PORT", help="metrics address")
    p.add_argument("--state-dir", metavar="DIR", help="where events.jsonl and the alert outbox live")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.config import Settings
    from sparkwatch.daemon import Daemon

    def load() -> Settings:
        # The same file, environment and flags as at start: SIGHUP re-runs exactly this.
        return settings_from(
            args,
            require_meminfo=True,
            dry_run=args.dry_run,
            floor=args.floor,
            listen=args.listen,
            state_dir=args.state_dir,
        )

    from sparkwatch.actuators.logstream import RedactingStream

    settings = load()  # registers the webhook URL and secret with the redaction before any line is logged
    sys.stderr = RedactingStream(sys.stderr)
    return Daemon(settings, loader=load).run()
