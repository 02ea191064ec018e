"""The files in /dev/shm and which of them a live process maps or holds open: the scan core.launch.shmleft judges.

A file's users are found by identity (st_dev, st_ino), never by path: a process in a container sees the host's
/dev/shm (`--ipc=host`) under its own mount. Two places name them:
- /proc/PID/fd: each link whose target ends in a listed file's name is stat'ed (through the link) and matched. Only
  those: a readlink never touches a file system, while a stat of every fd could hang on a dead NFS or FUSE mount;
- /proc/PID/maps: the lines of the shm mount's device (`00:1b`), their inode field.
The fds are read before the maps: a process that opens, maps, then closes (sem_open does) is seen in one or the other.

Cost: the directory listing alone while /dev/shm holds no regular file; else one fd walk and one maps read per
process, stopping once every file has a user. It runs when a command settles and on the shm watch's slow timer
(telemetry/shmwatch.py), never on the guard's kill path.

Races: a process that exits mid-read is skipped (ENOENT, ESRCH). Any other read error (EACCES: another user's
process, to a caller who is not root) is reported with the process's owner, for core.launch.shmleft to judge; so is
a /proc that does not show every process (another PID namespace, hidepid).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sparkwatch.core.model import ShmFile, ShmScan

SHM_DIR = "dev/shm"  # under the command's --root
# The inode of /proc/self/ns/pid in the initial PID namespace (PROC_PID_INIT_INO, include/linux/proc_ns.h): any other
# and this /proc shows a container's processes only, while the host's may hold a file of a shared /dev/shm.
PROC_PID_INIT_INO = 0xEFFFFFFC
_DELETED = " (deleted)"


def shm_dir(root: Path) -> Path:
    return Path(root) / SHM_DIR


def list_files(shm_root: Path) -> tuple[ShmFile, ...]:
    """The regular files directly in `shm_root` (a symlink, a directory or a socket is not tmpfs memory of its own).
    Raises OSError when the directory cannot be listed."""
    out = []
    with os.scandir(shm_root) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed since the listing
                continue
            if stat.S_ISREG(st.st_mode):
                out.append(ShmFile(entry.name, st.st_dev, st.st_ino, st.st_uid, st.st_blocks * 512))
    return tuple(out)


def scan(shm_root: Path, proc_root: Path) -> ShmScan:
    """The files in `shm_root` and the (dev, ino) of those some process under `proc_root` maps or holds open.
    Raises OSError when `shm_root` cannot be listed."""
    files = list_files(shm_root)
    if not files:
        return ShmScan(files, frozenset())
    wanted = {f.key for f in files}
    names = {f.name for f in files}
    # maps prints a device as "%02x:%02x" (major, minor); one needle per device, normally the one tmpfs
    needles = {f" {os.major(f.dev):02x}:{os.minor(f.dev):02x} ".encode() for f in files}
    used: set[tuple[int, int]] = set()
    unreadable: list[int] = []
    for pid in _pids(proc_root):
        if used >= wanted:
            break  # every file has a user: nothing left to learn
        found, read = _held_by(proc_root / pid, wanted, names, needles)
        used |= found
        if not read and (owner := _owner(proc_root / pid)) is not None:
            unreadable.append(owner)
    return ShmScan(files, frozenset(used), tuple(unreadable), partial_table=not _whole_table(proc_root))


def _pids(proc_root: Path) -> list[str]:
    return [name for name in os.listdir(proc_root) if name.isdigit()]


def _held_by(
    pid_dir: Path, wanted: set[tuple[int, int]], names: set[str], needles: set[bytes]
) -> tuple[set[tuple[int, int]], bool]:
    """(the wanted files this process holds, whether both its fds and its maps were read). A process that exited
    mid-read holds nothing and counts as read; what one part showed is kept when the other could not be read."""
    found: set[tuple[int, int]] = set()
    try:
        found |= _fd_keys(pid_dir, wanted, names)
        found |= _map_keys(pid_dir, wanted, needles)
    except (FileNotFoundError, ProcessLookupError):
        return set(), True  # it exited: it holds nothing now
    except (OSError, ValueError):  # EACCES, or a maps line not in the kernel's shape: never a reason to call it free
        return found, False
    return found, True


def _owner(pid_dir: Path) -> int | None:
    """The uid /proc shows for a process (root's for a non-dumpable one); None once it is gone."""
    try:
        return pid_dir.stat().st_uid
    except OSError:
        return None


def _fd_keys(pid_dir: Path, wanted: set[tuple[int, int]], names: set[str]) -> set[tuple[int, int]]:
    found = set()
    with os.scandir(pid_dir / "fd") as fds:
        for fd in fds:
            try:
                target = os.readlink(fd.path)
                if target.removesuffix(_DELETED).rpartition("/")[2] not in names:
                    continue  # a socket, a pipe, a library: not one of the files, no stat needed
                st = os.stat(fd.path)
            except FileNotFoundError:  # this fd was closed since the listing; the process lives on
                continue
            if (st.st_dev, st.st_ino) in wanted:
                found.add((st.st_dev, st.st_ino))
    return found


def _map_keys(pid_dir: Path, wanted: set[tuple[int, int]], needles: set[bytes]) -> set[tuple[int, int]]:
    with open(pid_dir / "maps", "rb") as fh:
        maps = fh.read()
    found: set[tuple[int, int]] = set()
    if not any(needle in maps for needle in needles):
        return found  # no mapping of the shm mount at all: the common case, decided in C
    for line in maps.splitlines():
        fields = line.split(None, 5)  # address, perms, offset, dev, inode, path
        if len(fields) < 5 or b" " + fields[3] + b" " not in needles:
            continue
        major, _, minor = fields[3].partition(b":")
        key = (os.makedev(int(major, 16), int(minor, 16)), int(fields[4]))
        if key in wanted:
            found.add(key)
    return found


def _whole_table(proc_root: Path) -> bool:
    """Whether `proc_root` shows every process of the machine: the initial PID namespace, and PID 1 listed (hidepid
    hides it from a user who is not root)."""
    try:
        return os.stat(proc_root / "self" / "ns" / "pid").st_ino == PROC_PID_INIT_INO and (proc_root / "1").is_dir()
    except OSError:
        return False
