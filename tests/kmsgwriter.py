"""Write lines into the real kernel log the way the driver's printk would appear: `<3>NVRM: Xid ...` on /dev/kmsg.

Only root may write /dev/kmsg. With the default `kernel.printk_devkmsg=ratelimit` the kernel keeps 10 lines per
open file per 5 s and suppresses the rest, so every 10 lines get a new open file. Lines written this way carry the
user facility (1) where the driver's carry the kernel's (0): sparkwatch ignores them unless
`kernel_log_accept_injected` is set, as these tests set it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

KMSG = Path("/dev/kmsg")


def kmsg_writable_reason() -> str | None:
    """None when this process can write the kernel log, else why not (for a skip).

    Never on a host with a loaded NVIDIA driver unless asked (SPARKWATCH_TEST_KMSG_ON_GPU_HOST=1): gpud, DCGM or
    a node-problem detector there would read the test's Xid 79 as a real GPU falling off the bus."""
    if Path("/proc/driver/nvidia/version").exists() and os.environ.get("SPARKWATCH_TEST_KMSG_ON_GPU_HOST") != "1":
        return "an NVIDIA driver is loaded here: fake NVRM/Xid lines would mislead its health agents"
    try:
        fd = os.open(KMSG, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        return f"/dev/kmsg cannot be written here ({exc.strerror}); writing the kernel log needs root"
    os.close(fd)
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"/dev/kmsg cannot be read here ({exc.strerror})"
    os.close(fd)
    return None


def write_kmsg(lines: Iterable[str], level: int = 3) -> int:
    """Each line as one record at `level` (3 = KERN_ERR, as the driver prints NV_ERR_NO_MEMORY). Returns how many."""
    n = 0
    fd = -1
    try:
        for line in lines:
            if n % 10 == 0:
                if fd >= 0:
                    os.close(fd)
                fd = os.open(KMSG, os.O_WRONLY | os.O_CLOEXEC)
            os.write(fd, f"<{level}>{line}\n".encode())
            n += 1
    finally:
        if fd >= 0:
            os.close(fd)
    return n


def kernel_ring_bytes() -> int | None:
    """The kernel log ring's size (syslog(2) SYSLOG_ACTION_SIZE_BUFFER), None where it cannot be asked."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        size = int(libc.klogctl(10, None, 0))
    except (OSError, AttributeError):
        return None
    return size if size > 0 else None
