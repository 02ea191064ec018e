"""The `sparkwatch` command. Each subcommand lives in its own module with `add_parser` (its arguments) and `handle`
(what it does); `COMMANDS` names them, in the order `--help` shows them.

A command's module is imported only when the command line names it (all of them for bare `--help`, none for
`--version`), and a module imports what its handler needs inside the handler: `sparkwatch --version` was 0.5 s of
imports (pydantic, rich, every command's dependencies) for one line (bench/RESULTS-startup.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkwatch import __version__

from . import argtypes

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings

# Command name -> its module under sparkwatch.cli, in the order `--help` shows them.
COMMANDS: dict[str, str] = {
    "run": "run",
    "launch": "launch.command",
    "engines": "engines",
    "doctor": "doctor",
    "events": "events",
    "postmortem": "postmortem",
    "status": "status",
    "wait-settled": "wait_settled",
    "check-config": "check_config",
    "peer-key": "peer_key",
    "install-service": "install_service",
    "assets": "assets",
}


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
    from sparkwatch.config.settings import load_settings

    flags = {"proc_root": args.proc_root, "root": args.root, **overrides}
    return load_settings(args.config, flags, check_memory=check_memory, require_meminfo=require_meminfo)


def named_commands(argv: Sequence[str] | None) -> list[str]:
    """The commands whose parsers `argv` needs: the one it names; none for `--version` alone; otherwise (bare
    `--help`, no command, an unknown one, `argv=None` for the tests that walk every parser) all of them, so that
    help and errors list every command."""
    if argv is None:
        return list(COMMANDS)
    for arg in argv:
        if arg in ("-h", "--help"):
            return list(COMMANDS)
        if arg == "--version":
            return []  # argparse prints it and exits when it reaches it, before any command is needed
        if not arg.startswith("-"):
            return [arg] if arg in COMMANDS else list(COMMANDS)
    return list(COMMANDS)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argtypes.Parser(
        prog="sparkwatch",
        description="Node agent for NVIDIA DGX Spark: guards the unified memory pool, exports telemetry.",
    )
    parser.add_argument("--version", action="version", version=f"sparkwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parent = common_parser()
    for name in named_commands(argv):
        importlib.import_module(f"{__name__}.{COMMANDS[name]}").add_parser(sub, parent)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.cli_argv = list(sys.argv[1:] if argv is None else argv)  # `run` hands them to the guard for reloads
    from sparkwatch.config.settings import ConfigError

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
