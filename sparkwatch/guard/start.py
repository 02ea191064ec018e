"""The one way into the guard process: `sparkwatch run` starts it so, and a guard over its RSS cap restarts so.

Standard library only: `sparkwatch run` imports this module after validating the config, and execs.

The guard imports the standard library and sparkwatch alone, so it starts without `site` (`python -S`): the .pth
files of the environment it would otherwise run import whatever other packages hook in at start-up. On the H200
image a bare interpreter was 15.7 MiB RSS with site and 9.1 MiB without (numba-cuda's import redirector among them),
and all of it stays mlocked in the guard (bench/RESULTS-rss-gpu.md). sparkwatch's own directory goes first on its
path instead, so the guard runs the same code `sparkwatch run` loaded. Telemetry, which needs site-packages, starts
with site as before.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from sparkwatch.common.signals import DAEMON_SIGNALS


def exec_guard(payload: Mapping[str, Any], cli_args: Sequence[str]) -> None:
    """Become a fresh guard process, keeping this PID (systemd's main PID): the validated settings on a memfd, the
    daemon signals blocked across the exec (they stay pending until the new process installs its handlers). The one
    way into the guard: `sparkwatch run` starts it so, and a guard over its RSS cap restarts so."""
    fd = os.memfd_create("sparkwatch-settings", 0)  # not CLOEXEC: the new process reads it after the exec
    os.write(fd, json.dumps(payload).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, DAEMON_SIGNALS)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # …/sparkwatch/guard/start.py
    code = f"import sys; sys.path.insert(0, {root!r}); from sparkwatch.guard.process import main; sys.exit(main())"
    argv = [sys.executable, "-S", "-c", code, "--settings-fd", str(fd), "--", *cli_args]
    os.execv(sys.executable, argv)
