"""The one way into the guard process (`sparkwatch run` starts it so, and a guard over its RSS cap restarts so), and
the command line the guard's supervisor starts telemetry with.

Standard library only: `sparkwatch run` imports this module after validating the config, and execs.

The guard imports the standard library and sparkwatch alone, so it starts without `site` (`python -S`): the .pth
files of the environment it would otherwise run import whatever other packages hook in at start-up. On the H200
image a bare interpreter was 15.7 MiB RSS with site and 9.1 MiB without (numba-cuda's import redirector among them),
and all of it stays mlocked in the guard (bench/RESULTS-rss-gpu.md). sparkwatch's own directory goes first on its
path instead, so the guard runs the same code `sparkwatch run` loaded. Telemetry needs site-packages (prometheus_client,
pynvml): it starts without site too, on the path `sparkwatch run` ran on (site-packages and the directories .pth
files add, passed in the environment), so the .pth files' imports are not paid there either (bench/RESULTS-rss-gpu.md).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from sparkwatch.common.signals import DAEMON_SIGNALS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # …/sparkwatch/guard/start.py
# The path `sparkwatch run` (with site) ran on, as JSON, for telemetry's start without site (telemetry_argv).
SITE_PATH_ENV = "_SPARKWATCH_SITE_PATH"  # outside the settings' SPARKWATCH_ prefix (config/schema.py)


def exec_guard(payload: Mapping[str, Any], cli_args: Sequence[str]) -> None:
    """Become a fresh guard process, keeping this PID (systemd's main PID): the validated settings on a memfd, the
    daemon signals blocked across the exec (they stay pending until the new process installs its handlers). The one
    way into the guard: `sparkwatch run` starts it so, and a guard over its RSS cap restarts so."""
    fd = os.memfd_create("sparkwatch-settings", 0)  # not CLOEXEC: the new process reads it after the exec
    os.write(fd, json.dumps(payload).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, DAEMON_SIGNALS)
    # The first exec, from `sparkwatch run`, has site: its path (site-packages and what .pth files add) is kept for
    # telemetry. A guard restarting itself has no site and leaves it as it is.
    os.environ.setdefault(SITE_PATH_ENV, json.dumps([p for p in sys.path if p]))
    # Both daemon processes run in the C locale, and in Python's UTF-8 mode (nosite_argv) so that no text they read or
    # write depends on it. Under a UTF-8 locale glibc maps the locale's files into each: 0.42 MiB of the guard's RSS
    # on the H200 host, mlocked, for nothing (bench/RESULTS-rss-gpu.md). Neither formats by locale, and journalctl is
    # asked for C.UTF-8 itself (telemetry.sources.prevboot). Telemetry inherits it.
    os.environ["LC_ALL"] = "C"
    code = "from sparkwatch.guard.process import main; sys.exit(main())"
    os.execv(sys.executable, nosite_argv(code, [ROOT], ["--settings-fd", str(fd), "--", *cli_args]))


def nosite_argv(code: str, path: Sequence[str], args: Sequence[str]) -> list[str]:
    """`python -S -X utf8 -c CODE ARGS…` with `path` first on sys.path: how both sparkwatch processes start."""
    return [sys.executable, "-S", "-X", "utf8", "-c", f"import sys; sys.path[:0] = {list(path)!r}; {code}", *args]


def telemetry_argv(args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """`python -m sparkwatch.telemetry ARGS…`, without site where `sparkwatch run` left its path in the environment
    (SITE_PATH_ENV): telemetry's site-packages come as that path, without the .pth files' imports. A guard started
    otherwise (tests build one in-process) starts telemetry with site, as before."""
    try:
        path = json.loads(environ.get(SITE_PATH_ENV, ""))
    except ValueError:
        path = None
    if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
        return [sys.executable, "-m", "sparkwatch.telemetry", *args]
    code = "import runpy; runpy.run_module('sparkwatch.telemetry', run_name='__main__', alter_sys=True)"
    return nosite_argv(code, [ROOT, *path], args)
