"""The few syscalls no library wraps: process_mrelease and mlockall, through ctypes; pidfds through os/signal.

Syscall numbers 424 (pidfd_send_signal), 434 (pidfd_open) and 448 (process_mrelease) are the same on x86-64 and
aarch64: they came after the kernel unified new syscall numbers across architectures.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal

SYS_PROCESS_MRELEASE = 448
MCL_CURRENT = 1
MCL_FUTURE = 2
MCL_ONFAULT = 4

# The process's own symbols, libc's among them: ctypes.util.find_library would run ldconfig and import tempfile,
# shutil and subprocess at the guard's start to find the same library.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mlockall.argtypes = [ctypes.c_int]
_libc.mlockall.restype = ctypes.c_int
M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def pidfd_open(pid: int) -> int:
    """A pidfd pins one process: signals through it never reach a later process that reuses the PID."""
    return os.pidfd_open(pid)


def pidfd_send_signal(pidfd: int, sig: int) -> None:
    signal.pidfd_send_signal(pidfd, sig)


def process_mrelease(pidfd: int) -> int:
    """Reap a dying process's memory now instead of when its last thread exits (Linux 5.15+).

    Returns 0 on success or the errno: ENOSYS (old kernel), ESRCH (already gone), EINVAL (not yet dying).
    """
    result = _libc.syscall(SYS_PROCESS_MRELEASE, ctypes.c_int(pidfd), ctypes.c_uint(0))
    return 0 if result == 0 else ctypes.get_errno()


def mlockall() -> str:
    """Lock our pages so the guard is not paged out (or its code evicted) under pressure.

    MCL_ONFAULT locks pages as they are touched instead of populating every mapping up front, which would cost tens of
    MiB for a Python process. Returns a short description of what was done, raises OSError if nothing could be.
    """
    for flags, label in (
        (MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT, "current+future+onfault"),
        (MCL_CURRENT | MCL_FUTURE, "current+future"),
        (MCL_CURRENT, "current"),
    ):
        if _libc.mlockall(flags) == 0:
            return label
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: flag unknown to this kernel, try the next; else a real refusal
            raise OSError(err, f"mlockall({label}): {os.strerror(err)}")
    raise OSError(errno.EINVAL, "mlockall: no flag combination accepted")


# Locked address space, not RSS, counts against RLIMIT_MEMLOCK: measured 190 MiB for the guard alone (38 MiB
# resident), 129 MiB with MALLOC_ARENA_MAX=2; each new thread adds its 8 MiB stack. Below this, do not lock at all.
MEMLOCK_NEEDED_BYTES = 1 << 30
CAP_IPC_LOCK = 14


def memlock_limit_too_small() -> int | None:
    """The RLIMIT_MEMLOCK soft limit if it is finite, under MEMLOCK_NEEDED_BYTES and not bypassed by CAP_IPC_LOCK."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= MEMLOCK_NEEDED_BYTES:
        return None
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:") and int(line.split()[1], 16) >> CAP_IPC_LOCK & 1:
                    return None
    except (OSError, ValueError):
        pass
    return int(soft)


def limit_malloc_arenas(count: int) -> None:
    """glibc's MALLOC_ARENA_MAX from inside: cap the per-thread malloc arenas of threads started from now on."""
    try:
        _libc.mallopt(M_ARENA_MAX, count)
    except AttributeError:  # not glibc (musl): nothing to cap
        pass


def trim_heap() -> None:
    """Return free heap pages to the kernel (glibc malloc_trim); a no-op elsewhere."""
    try:
        _libc.malloc_trim(0)
    except AttributeError:
        pass


PR_SET_NAME = 15


def set_comm(name: str) -> None:
    """Set this process's comm (what `ps -o comm`, `top` and the journal's _COMM show); 15 bytes at most."""
    try:
        _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except AttributeError:
        pass


PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int) -> None:
    """Have the kernel send `signum` to this process when the thread that started it exits."""
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except AttributeError:
        pass


PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> bool:
    """Become the reaper of our orphaned descendants (prctl PR_SET_CHILD_SUBREAPER): an engine's workers whose root
    died are reparented to us, not to PID 1, so `sparkwatch launch` can end them too. False where refused."""
    try:
        return int(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except AttributeError:
        return False
