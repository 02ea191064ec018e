"""Run a command as the only child of a child subreaper, for tests/dockerd.py: containerd's shims leave their
parent as daemons do (fork, the middle exits), and the kernel hands them to the nearest subreaper above them, else to
PID 1. Under this one every container of the test session's daemon descends from the test process, so a guard that
`ancestor_pid` confines to the test's descendants sees them, and never anyone else's.

    python subreaper.py dockerd --host=…

SIGTERM, SIGINT and SIGHUP go to the command; every orphan handed here is reaped; it exits with the command's status
once the command is reaped (an orphan still alive then goes on to PID 1).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36


def main() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit(f"subreaper: prctl: {os.strerror(ctypes.get_errno())}")
    argv = sys.argv[1:]
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda n, _f: os.kill(pid, n))
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            raise SystemExit(1) from None
        if got == pid:
            code = os.waitstatus_to_exitcode(status)
            raise SystemExit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
