"""`sparkwatch run [--dry-run]`: the daemon.

This process validates the whole config (the one loader, `sparkwatch.config.settings`), then execs into the guard
process (`python -m sparkwatch.guard`, through guard.start), keeping its PID, so systemd's main PID is the guard. The
validated values travel on a memfd; the daemon signals stay blocked across the exec (`sparkwatch.entry`).
`--print-settings` (used by the guard on SIGHUP) validates the same way and prints the values as JSON instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "run",
        parents=[parent],
        help="run the daemon: guard, telemetry, exporter, alerts",
        description="Run the daemon: the guard, which SIGKILLs an engine tree before MemAvailable crosses the floor "
        "(default 8GiB), and the telemetry process (Prometheus metrics on 127.0.0.1:9847, alerts). This is an armed "
        "killer: for a first look use --dry-run, which decides and records every kill it would make and signals "
        "nothing. `sparkwatch engines` shows what it would kill now. SIGHUP reloads the config; SIGTERM stops it.",
    )
    p.add_argument("--dry-run", action="store_true", default=None, help="decide and record, signal nothing")
    p.add_argument("--floor", metavar="SIZE", help="MemAvailable kill floor, e.g. 8GiB")
    p.add_argument("--listen", metavar="HOST:PORT", help="metrics address")
    p.add_argument("--state-dir", metavar="DIR", help="where events.jsonl and the alert outbox live")
    p.add_argument("--print-settings", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.config.settings import settings_to_wire

    # The same file, environment and flags as at start: SIGHUP re-runs exactly this (with --print-settings).
    settings = settings_from(
        args,
        require_meminfo=True,  # a guard without /proc/meminfo cannot run: one line, exit 2
        dry_run=args.dry_run,
        floor=args.floor,
        listen=args.listen,
        state_dir=args.state_dir,
    )
    # What the daemon will write and later trust must be its own, or another user could forge events and alerts
    # (common.durable): refused here, one line and exit 2 (at start, and on reload through --print-settings).
    from sparkwatch.common.durable import refuse_foreign
    from sparkwatch.common.eventlog import rotated_path
    from sparkwatch.common.spool import BAD

    for path in (
        settings.state_dir,
        settings.outbox_dir,
        settings.outbox_dir / BAD,
        settings.events_path,
        rotated_path(settings.events_path),
    ):
        refuse_foreign(path)
    # `secrets`: what the guard process's log redaction must know (the webhook URL's secret parts, the HMAC key).
    payload = {"wire": settings_to_wire(settings), "public": settings.public_dict(), "secrets": settings.secrets()}
    if args.print_settings:
        sys.stdout.buffer.write(json.dumps(payload).encode())
        sys.stdout.flush()
        return 0
    from sparkwatch.guard.start import exec_guard

    exec_guard(payload, [a for a in getattr(args, "cli_argv", ["run"]) if a != "--print-settings"])
    return 1  # exec_guard does not return
