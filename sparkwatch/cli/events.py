"""`sparkwatch events [-n N] [--json] [--system | --state-dir DIR]`: the last events from the event log.

Which log: `--state-dir` or a configured `state_dir` when given; else this user's own (the user unit's), and, when
that has none, the system unit's (/var/lib/sparkwatch, from the unit's own XDG_STATE_HOME: the engineer whose engine
the system unit killed is usually not root). `--system` asks for the system unit's. A line on stderr says which
one is shown whenever the choice was not the user's own log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sparkwatch.cli import argtypes

DESCRIPTION = (
    "Show the last events (kills, alerts, driver and kernel-log events), one line each in local time. Reads this "
    "user's event log, or the system unit's (/var/lib/sparkwatch/events.jsonl) when this user has none or with "
    "--system. Members of the config's events_group may read the system unit's."
)


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("events", parents=[parent], help="show the last events", description=DESCRIPTION)
    p.add_argument("-n", type=argtypes.count(0), default=20, metavar="N", help="how many (default 20)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--state-dir", metavar="DIR", help="where events.jsonl lives")
    where.add_argument("--system", action="store_true", help="the system unit's events (/var/lib/sparkwatch)")
    p.set_defaults(handler=handle)


def system_state_dir(root: Path) -> Path:
    """The system unit's state dir under `root`: its XDG_STATE_HOME (the unit template's Environment=) + sparkwatch,
    or the state_dir its config file (its XDG_CONFIG_HOME's sparkwatch/config.toml) sets, when readable."""
    import tomllib

    from sparkwatch.cli.install_service import system_unit_environment

    env = system_unit_environment()
    config = root / env.get("XDG_CONFIG_HOME", "/etc").lstrip("/") / "sparkwatch" / "config.toml"
    try:
        with open(config, "rb") as fh:
            configured = tomllib.load(fh).get("state_dir")
        if isinstance(configured, str) and configured.startswith("/"):
            return root / configured.lstrip("/")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        pass
    return root / env.get("XDG_STATE_HOME", "/var/lib").lstrip("/") / "sparkwatch"


def _has_events(path: Path) -> bool:
    """Whether an event log is there (unreadable counts as there: reading it then says why it cannot be read)."""
    from sparkwatch.common.eventlog import rotated_path

    for candidate in (path, rotated_path(path)):
        try:
            candidate.stat()
            return True
        except PermissionError:
            return True
        except OSError:
            continue
    return False


def choose_events_path(args: argparse.Namespace, state_dir: Path, configured: bool, root: Path) -> tuple[Path, str]:
    """(events.jsonl to show, a line for stderr saying whose it is, or "")."""
    own = state_dir / "events.jsonl"
    if args.system:  # asked for by name: a state_dir in this user's config or environment does not change whose
        system = system_state_dir(root) / "events.jsonl"
        return system, f"sparkwatch: the system unit's events ({system})"
    if args.state_dir is not None or configured:
        return own, ""
    system = system_state_dir(root) / "events.jsonl"
    if system == own:
        return own, ""
    own_has, system_has = _has_events(own), _has_events(system)
    if own_has or not system_has:
        also = f"sparkwatch: the system unit has events too: sparkwatch events --system ({system})"
        return own, also if own_has and system_has else ""
    return system, f"sparkwatch: no events of your own; the system unit's ({system})"


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.common.eventlog import read_events
    from sparkwatch.config.settings import default_state_dir
    from sparkwatch.tui.events_view import event_lines

    settings = settings_from(args, state_dir=args.state_dir)
    if args.n <= 0:
        return 0
    path, note = choose_events_path(args, settings.state_dir, settings.state_dir != default_state_dir(), settings.root)
    if note:
        print(note, file=sys.stderr)
    try:
        events = read_events(path, args.n)
    except PermissionError:
        print(
            f"sparkwatch: error: {path}: permission denied. The daemon that writes it can share it with a group: "
            "events_group in its config (docs/systemd.md); or read it with sudo",
            file=sys.stderr,
        )
        return 2
    if args.json:
        for event in events:
            print(json.dumps(event))
        return 0
    if not events:
        print(f"no events in {path}")
        return 0
    # Plain lines on purpose, also on a terminal: one event per line, never wrapped, so grep and less work on it.
    print("\n".join(event_lines(events)))
    return 0
