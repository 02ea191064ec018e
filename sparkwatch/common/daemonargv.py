"""The two daemon processes' command lines, which sparkwatch itself writes (guard/start.py, guard/supervisor.py): read
by hand. argparse, with the gettext and textwrap it loads, was 0.6 MiB resident in each process, mlocked in the
guard, for one fixed line (bench/RESULTS-rss-gpu.md)."""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence


def parse_daemon_argv(
    argv: Sequence[str],
    *,
    usage: str,
    numbers: Collection[str],
    switches: Collection[str] = (),
    required: Collection[str] = (),
) -> tuple[dict[str, int], list[str]]:
    """`--name N` for each of `numbers`, `--name` alone for each of `switches` (read as 1), then `--` and the rest,
    kept as they are. Anything else, or a required name missing, exits with `usage: …` (status 2, as argparse did)."""
    values: dict[str, int] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        if arg in switches:
            values[arg] = 1
            i += 1
        elif arg in numbers and i + 1 < len(argv) and argv[i + 1].isdigit():
            values[arg] = int(argv[i + 1])
            i += 2
        else:
            _refuse(usage, f"unexpected {arg!r}")
    missing = [name for name in required if name not in values]
    if missing:
        _refuse(usage, f"{missing[0]} is required")
    return values, list(argv[i + 1 :])


def _refuse(usage: str, why: str) -> None:
    sys.stderr.write(f"usage: {usage}\n{why}\n")
    raise SystemExit(2)
