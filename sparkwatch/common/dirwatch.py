"""Waiting for a change in a few directories without a timer (inotify through common.syscalls).

A thread that polls a directory every 0.2 s wakes five times a second for nothing: on a 2-core VM the guard's
declarations thread took 1.5 ms of CPU a second that way, a third of the idle agent's (bench/RESULTS-idle.md). Here the
kernel wakes it instead. A directory that does not exist yet is waited for at its nearest existing ancestor (a user's
runtime dir appears at login, launch makes `sparkwatch/launched` on first use), and `arm` is called again after each
wake-up, so the watches follow what appeared or went. Symlinks are never followed (IN_DONT_FOLLOW): the directories
may be other users'.

What it cannot watch it says (`armed` False: the instance or watch limit, or a directory not ours to read), and the
caller polls as before.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import struct
from collections.abc import Iterable
from pathlib import Path

from sparkwatch.common import syscalls as sc

# In a watched directory: an entry made, written, renamed in or out, removed, its mode changed; the directory itself
# removed or renamed away.
CHANGED = (
    sc.IN_CREATE | sc.IN_CLOSE_WRITE | sc.IN_MOVED_TO | sc.IN_MOVED_FROM | sc.IN_DELETE | sc.IN_ATTRIB
    | sc.IN_DELETE_SELF | sc.IN_MOVE_SELF
)  # fmt: skip
# At the nearest existing ancestor of a directory not there yet: an entry made or renamed in (the next step of its
# path, perhaps), or the ancestor itself going.
APPEARED = sc.IN_CREATE | sc.IN_MOVED_TO | sc.IN_ATTRIB | sc.IN_DELETE_SELF | sc.IN_MOVE_SELF
READ_BYTES = 65536
EVENT_HEAD = struct.Struct("iIII")
MAX_WATCHES = 8192  # the directories a reader follows are capped below this (common.launched.MAX_USERS)


def _dir_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of `path` when it is a directory itself (not a symlink to one), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _nearest(path: Path) -> tuple[Path, tuple[int, int]] | None:
    """`path`, else its nearest ancestor that is a directory (never through a symlink), with its identity."""
    for candidate in (path, *path.parents):
        ident = _dir_id(candidate)
        if ident is not None:
            return candidate, ident
    return None


class DirWatch:
    """The kernel's word that one of the armed directories changed. One thread arms and waits."""

    def __init__(self) -> None:
        self.fd = sc.inotify_init()
        # path -> (watch descriptor, mask, the directory's (device, inode)): a directory removed and made again is a
        # new inode, watched again
        self._wds: dict[Path, tuple[int, int, tuple[int, int]]] = {}
        self.armed = False  # every directory asked for is watched, or its nearest ancestor is
        self.refused_total = 0  # watches the kernel refused (limit, permission)

    def arm(self, dirs: Iterable[Path], parents: Iterable[Path] = ()) -> bool:
        """Watch each of `dirs` (or its nearest existing ancestor, for its appearance) and each of `parents` (for
        entries made or removed in it: a new user's runtime dir under /run/user). True when all of them are watched."""
        want: dict[Path, tuple[int, tuple[int, int]]] = {}
        for directory in dirs:
            found = _nearest(directory)
            if found is not None:
                target, ident = found
                mask = CHANGED if target == directory else APPEARED
                want[target] = (want.get(target, (0, ident))[0] | mask, ident)
        for parent in parents:
            pid = _dir_id(parent)
            if pid is not None:
                want[parent] = (want.get(parent, (0, pid))[0] | APPEARED | sc.IN_DELETE | sc.IN_MOVED_FROM, pid)
        for path in [p for p in self._wds if p not in want]:
            sc.inotify_rm_watch(self.fd, self._wds.pop(path)[0])
        ok = len(want) <= MAX_WATCHES
        for path, (mask, ident) in list(want.items())[:MAX_WATCHES]:
            held = self._wds.get(path)
            if held is not None and held[1:] == (mask, ident):
                continue
            try:
                wd = sc.inotify_add_watch(self.fd, str(path), mask | sc.IN_ONLYDIR | sc.IN_DONT_FOLLOW)
                self._wds[path] = (wd, mask, ident)
            except OSError as exc:
                self._wds.pop(path, None)
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):  # gone meanwhile: its ancestor's event re-arms
                    continue
                self.refused_total += 1
                ok = False
        self.armed = ok
        return ok

    def wait(self, timeout_s: float | None, stop_fd: int) -> bool:
        """Until a watched directory changed (True), `stop_fd` is readable or `timeout_s` passed (False). Of the
        kernel's events only the dropped watches are kept (IN_IGNORED: the directory went; a new one at its path,
        even with the same inode number, is watched again by the next `arm`): the caller looks at the directories
        themselves."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(stop_fd, select.POLLIN)
        ready = {fd for fd, _ev in poller.poll(None if timeout_s is None else max(timeout_s, 0.0) * 1000)}
        if self.fd not in ready:
            return False
        dropped: set[int] = set()
        while True:
            try:
                data = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                break
            if not data:
                break
            at = 0
            while at + EVENT_HEAD.size <= len(data):  # struct inotify_event: wd, mask, cookie, len, then the name
                wd, mask, _cookie, name_len = EVENT_HEAD.unpack_from(data, at)
                if mask & sc.IN_IGNORED:
                    dropped.add(wd)
                at += EVENT_HEAD.size + name_len
        if dropped:
            self._wds = {p: held for p, held in self._wds.items() if held[0] not in dropped}
        return True

    def close(self) -> None:
        os.close(self.fd)
