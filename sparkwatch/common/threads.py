"""The one way sparkwatch starts a thread: a daemon thread whose name the kernel knows too.

`top -H`, `ps -L` and /proc/PID/task/TID/comm show `sw-supervisor`, `sw-guard`, `sw-nvml`… instead of the process's
name on every thread: an owner (or a bench) sees which thread spends what. The kernel keeps 15 bytes of a thread
name, so `sparkwatch-` becomes `sw-`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sparkwatch.common.syscalls import set_comm


def os_name(name: str) -> str:
    return ("sw-" + name.removeprefix("sparkwatch-"))[:15]


def daemon_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """A daemon thread (not started) running `target(*args)`, named `name` in Python and in the kernel."""

    def run() -> None:
        set_comm(os_name(name))  # PR_SET_NAME names the calling thread
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)
