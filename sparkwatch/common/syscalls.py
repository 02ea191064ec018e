"""The few syscalls no library wraps: process_mrelease, mlockall and inotify, through ctypes; pidfds through os/signal.

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


# inotify (inotify(7)): the kernel says when a directory changed, so a watch of a few directories needs no timer.
# Through libc, as the rest of this module: inotify_simple, the library, finds libc with ctypes.util.find_library,
# which runs ldconfig in a child at import.
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_IGNORED = 0x00008000  # in an event: the kernel dropped the watch (its directory went)
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_init1.restype = ctypes.c_int
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_add_watch.restype = ctypes.c_int
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.inotify_rm_watch.restype = ctypes.c_int


def inotify_init() -> int:
    """A non-blocking, close-on-exec inotify fd. Raises OSError (EMFILE: the user's instance limit)."""
    fd = int(_libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"inotify_init1: {os.strerror(err)}")
    return fd


def inotify_add_watch(fd: int, path: str, mask: int) -> int:
    """The watch descriptor of `path` with `mask` (replacing an earlier mask on the same inode). Raises OSError:
    ENOENT gone, ENOTDIR not a directory (IN_ONLYDIR), ENOSPC the user's watch limit, EACCES not ours to read."""
    wd = int(_libc.inotify_add_watch(fd, os.fsencode(path), mask))
    if wd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return wd


def inotify_rm_watch(fd: int, wd: int) -> None:
    """Remove a watch; one the kernel already dropped (its directory is gone) is no error."""
    _libc.inotify_rm_watch(fd, wd)
