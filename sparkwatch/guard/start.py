"""The one way into the guard process: `sparkwatch run` starts it so, and a guard over its RSS cap restarts so.

Standard library only: `sparkwatch run` imports this module after validating the config, and execs.
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
    argv = [sys.executable, "-m", "sparkwatch.guard", "--settings-fd", str(fd), "--", *cli_args]
    os.execv(sys.executable, argv)
