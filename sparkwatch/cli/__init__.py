"""The `sparkwatch` command. Each subcommand lives in its own module with `add_parser` (its arguments) and `handle`
(what it does); `COMMANDS` lists them, in the order `--help` shows them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from sparkwatch import __version__
from sparkwatch.config.settings import ConfigError, Settings, load_settings

from . import (
    argtypes,
    assets,
    check_config,
    doctor,
    engines,
    events,
    install_service,
    launch,
    postmortem,
    run,
    status,
    wait_settled,
)

COMMANDS: tuple[ModuleType, ...] = (
    run,
    launch,
    engines,
    doctor,
    events,
    postmortem,
    status,
    wait_settled,
    check_config,
    install_service,
    assets,
)


def common_parser() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML config file (default: $XDG_CONFIG_HOME/sparkwatch/config.toml if present)",
    )
    parent.add_argument("--proc-root", type=Path, metavar="DIR", help="where /proc is read from (default /proc)")
    parent.add_argument(
        "--root", type=Path, metavar="DIR", help="root under which every other system path is read (default /)"
    )
    return parent


def settings_from(
    args: argparse.Namespace, *, check_memory: bool = False, require_meminfo: bool = False, **overrides: Any
) -> Settings:
    """Load settings with the command line on top. Raises ConfigError."""
    flags = {"proc_root": args.proc_root, "root": args.root, **overrides}
    return load_settings(args.config, flags, check_memory=check_memory, require_meminfo=require_meminfo)


def build_parser() -> argparse.ArgumentParser:
    parser = argtypes.Parser(
        prog="sparkwatch",
        description="Node agent for NVIDIA DGX Spark: guards the unified memory pool, exports telemetry.",
    )
    parser.add_argument("--version", action="version", version=f"sparkwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parent = common_parser()
    for module in COMMANDS:
        module.add_parser(sub, parent)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.cli_argv = list(sys.argv[1:] if argv is None else argv)  # `run` hands them to the guard for reloads
    try:
        code: int = args.handler(args)
    except ConfigError as exc:
        print(f"sparkwatch: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:
        # A file the command needs is missing, a directory, a FIFO, not ours: one line, and exit 2 so that systemd
        # (RestartPreventExitStatus=2) does not restart into the same error in a loop.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"sparkwatch: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    return code
