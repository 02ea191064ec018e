"""What a service sees of the kernel log: run as the ExecStart of a copy of a unit (tests/test_systemd_nspawn.py).

Prints three words: /dev/kmsg and /proc/kmsg as opened (file mode, and :major:minor for a device) or the errno of the
failed open, and what syslog(2) SYSLOG_ACTION_SIZE_BUFFER (10) returns: the ring's size, or the errno. Nothing is read
from either file: a read of /proc/kmsg consumes lines a syslog daemon is waiting for.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

SYSLOG_ACTION_SIZE_BUFFER = 10  # harmless: it only asks for the ring's size


def opened_as(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    st = os.fstat(fd)
    os.close(fd)
    device = f":{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if stat.S_ISCHR(st.st_mode) else ""
    return stat.filemode(st.st_mode) + device


def syslog_size() -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    size = int(libc.klogctl(SYSLOG_ACTION_SIZE_BUFFER, None, 0))
    return str(size) if size >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")


if __name__ == "__main__":
    print(opened_as("/dev/kmsg"), opened_as("/proc/kmsg"), syslog_size())
