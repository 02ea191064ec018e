"""The `sparkwatch` command's first lines: nothing here may import more than the standard library.

`sparkwatch run` blocks SIGHUP, SIGTERM and SIGINT before anything else is imported. Loading and validating the
config takes a few hundred ms (pydantic); with the default dispositions a SIGHUP in that window (systemd's
ExecReload right after start) would kill the daemon. Blocked signals stay pending across the exec into the guard
process (`sparkwatch.guard`), which installs its handlers first and only then unblocks them, so an
early SIGHUP becomes a reload and an early SIGTERM a clean stop.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from sparkwatch.common.signals import DAEMON_SIGNALS


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["run"]:
        signal.pthread_sigmask(signal.SIG_BLOCK, DAEMON_SIGNALS)
    from sparkwatch.cli import main as cli_main  # noqa: PLC0415 - after the mask, on purpose

    return cli_main(argv)
