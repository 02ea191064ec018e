"""The one way sparkwatch writes and reads its state files: durable, never through a symlink, never unbounded.

Writes: `write_atomic` (temporary file, fsync, rename, fsync the directory) for whole files (outbox spool, driver
state); `append_durable` (O_APPEND, fsync, and the directory when the file is new) for events.jsonl. Every open uses
O_NOFOLLOW: a symlink planted in the state dir (say events.jsonl -> /etc/cron.d/x) is refused with ELOOP, never
followed by a daemon that may run as root. `private_dir` creates the state dir 0700 and tightens one found looser;
it and every other directory sparkwatch makes for its state go through `open_dir`, which makes them component by
component from `/` and never through another user's link or directory.

Ownership: what the daemon writes and later trusts (the state dir, the outbox, events.jsonl, each spool file) must be
the daemon's own: owned by its user and writable by nobody else. A root daemon used to take a state dir another user
had made 0777: that user's spool files went out signed with the real HMAC key and a forged kill event landed in
events.jsonl. `private_dir`, `append_durable` and `open_regular(owned=True)` refuse anything else, and
`refuse_foreign` lets `sparkwatch run` check the lot before it starts (one line, exit 2).

Reads: `read_regular` opens with O_NOFOLLOW | O_NONBLOCK (a FIFO planted as events.jsonl cannot hang a reader),
refuses anything that is not a regular file, and reads at most `limit` bytes. The config loader reads the config
file and the TLS files the same way with `follow_symlinks=True`: those are the owner's own files, often symlinks
(a dotfile manager's config.toml, /etc/letsencrypt/live/*), but a FIFO there hung check-config forever and a reload
for the validator's 60 s timeout.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from sparkwatch.common.sources.procs import read_fd

_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


class StateFileError(OSError):
    """A state file that is not what it must be (a symlink, a FIFO, a directory). Carries the path and one line."""


def _foreign(st: os.stat_result) -> str | None:
    """Why a state file or dir with this stat is not the daemon's own, or None."""
    euid = os.geteuid()
    if st.st_uid != euid:
        return (
            f"is owned by uid {st.st_uid}, not by this daemon's user (uid {euid}): another user could have planted "
            "events or alerts in it; refused (remove it, and sparkwatch makes its own, mode 0700)"
        )
    if st.st_mode & 0o022:
        who = "others" if st.st_mode & 0o002 else "its group"
        return (
            f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): another user could have planted events or "
            "alerts in it; refused (check what is in it, then chmod go-w it)"
        )
    return None


def refuse_foreign(path: Path) -> None:
    """Raise StateFileError (one line) if `path` exists and is not the daemon's own (`_foreign`). A symlink is left
    to the writes, which never follow one (O_NOFOLLOW): the guard then runs on, kills, and says so at each write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        return
    why = _foreign(st)
    if why is not None:
        raise StateFileError(errno.EPERM, why, str(path))


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LINKS_MAX = 40  # as the kernel's own limit before ELOOP
PARENT_MODE = 0o755  # a directory made above a state dir (~/.local/state): as mkdir -p makes it, whatever the umask


def _unsafe_above(st: os.stat_result) -> str | None:
    """Why a directory above a state dir (or a symlink in one) could let another user choose where the state dir
    lands, or None: it must be root's or the daemon's user's, and writable by no one else (a sticky /tmp is fine:
    there no one may rename or remove what another user made). A group write by root's group or the daemon's own
    is theirs."""
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}: that user could swap what is below it"
    if stat.S_ISLNK(st.st_mode):
        return None
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not sticky:
        return f"is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and st.st_gid not in (0, os.getegid()) and not sticky:
        return f"is writable by group {st.st_gid} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _refused(component: str, why: str, path: Path, code: int = errno.EPERM) -> StateFileError:
    return StateFileError(code, f"{component} {why}; the state dir {path} is not made through it", component)


def open_dir(path: Path, mode: int = 0o700) -> int:
    """An fd of directory `path` (the caller closes it), made if missing, component by component from `/` without
    ever letting the kernel follow a link: each component is created with mkdirat and opened with openat(O_NOFOLLOW)
    in the fd of the one above, and fstat'ed. The one way sparkwatch makes its state dirs.

    A component above `path` is refused (StateFileError naming it) when another user owns it or may write to it
    (`_unsafe_above`): such a user could plant a link there (/run/user/1000/x -> /etc) and a root daemon's
    `mkdir -p` would make its dir, root's and 0700, where they chose (`path.mkdir(parents=True)` did, here: only the
    last component was checked). A symlink is walked, from the fd of its directory, only when its owner is root or
    the daemon's user (`~/.local/state -> /data/state`, Ubuntu's /var/run -> /run); another user's link is refused.
    `path` itself must not be a symlink (ELOOP) and is made with `mode`; the directories made above it get
    PARENT_MODE. What `path` itself must be is the caller's (private_dir: `_foreign`)."""
    names = list(Path(os.path.abspath(path)).parts[1:])
    stack = [(os.open("/", _DIR_FLAGS), "/")]  # the directories walked, each an fd already checked
    links = 0
    try:
        while names:
            name = names.pop(0)
            last = not names
            fd, where = stack[-1]
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            component = os.path.join(where, name)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                try:
                    os.mkdir(name, mode if last else PARENT_MODE, dir_fd=fd)
                except FileExistsError:  # made meanwhile: looked at below as any other
                    pass
                except OSError as exc:  # EACCES, EROFS…: said with the whole path, as mkdir -p says it
                    raise OSError(exc.errno, exc.strerror, component) from None
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if last:
                    raise StateFileError(errno.ELOOP, "is a symlink; the state dir must be a real directory", str(path))
                why = _unsafe_above(st)
                if why is not None:
                    raise _refused(component, f"is a symlink and {why}", path, errno.ELOOP)
                links += 1
                if links > _LINKS_MAX:
                    raise _refused(component, "is one link too many", path, errno.ELOOP)
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                names = [*Path(target).parts[1 if target.startswith("/") else 0 :], *names]
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise _refused(component, "is not a directory", path, errno.ENOTDIR)
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:  # swapped for a link or a file since the stat: refused, never followed
                raise _refused(
                    component, f"changed while it was walked ({exc.strerror})", path, exc.errno or 0
                ) from None
            stack.append((child, component))
            if not last:
                why = _unsafe_above(os.fstat(child))
                if why is not None:
                    raise _refused(component, why, path)
        return stack.pop()[0]
    finally:
        for fd, _where in stack:
            os.close(fd)


def private_dir(path: Path, group: int | None = None) -> None:
    """Create `path` (and parents, through `open_dir`) 0700; tighten it to 0700 if it is group/world readable. Raises
    StateFileError for a symlink, a directory another user owns or may write to (a sticky /tmp included: shared is not
    private), and a directory above it another user could change.

    `group` (the state dir with `events_group` set, common/sharing.py): 0750 with that group instead, so its members
    can read events.jsonl; nobody else, and no group write. Every user of the state dir passes the same group.
    """
    fd = open_dir(path, 0o700)
    try:
        st = os.fstat(fd)
        why = _foreign(st)
        if why is not None:
            raise StateFileError(errno.EPERM, why, str(path))
        if group is not None and st.st_gid != group:
            from sparkwatch.common.sharing import give_to_group  # noqa: PLC0415 - sharing imports logs; durable need not

            if not give_to_group(path, group):
                group = None
        perms = stat.S_IMODE(st.st_mode)
        want = (perms & 0o700) | 0o050 if group is not None else perms & 0o700
        if perms != want:
            os.fchmod(fd, want)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _explain(exc: OSError, path: Path) -> OSError:
    if exc.errno == errno.ELOOP:
        return StateFileError(errno.ELOOP, "is a symlink; refused (state files are never followed)", str(path))
    return exc


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new file, never a torn one."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, mode)
    except OSError as exc:
        raise _explain(exc, tmp) from None
    try:
        _write_all(fd, data)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    os.close(fd)
    os.rename(tmp, path)  # rename replaces a symlink at `path` itself; it never writes through one
    fsync_dir(path.parent)


def append_durable(path: Path, data: bytes, mode: int = 0o600) -> int:
    """Append `data` and fsync; fsync the directory too when the file is new. Returns the file's size after."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | _OPEN_FLAGS, mode)
        created = False
    except FileNotFoundError:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, mode)
        except OSError as exc:
            raise _explain(exc, path) from None
        created = True
    except OSError as exc:
        raise _explain(exc, path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError(errno.EINVAL, "is not a regular file", str(path))
        why = _foreign(st)
        if why is not None:  # never append our record to a file someone else can write (or wrote)
            raise StateFileError(errno.EPERM, why, str(path))
        _write_all(fd, data)
        os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)
    return size


def read_regular(path: Path, limit: int, *, follow_symlinks: bool = False, owned: bool = False) -> bytes:
    """At most `limit` bytes of a regular file, never through a symlink (unless `follow_symlinks`), never blocking
    on a FIFO; with `owned`, only a file the daemon's user owns and nobody else can write (one it wrote itself).

    Raises FileNotFoundError when absent and StateFileError (one clear line) when it is anything but a regular file.
    """
    fd = open_regular(path, follow_symlinks=follow_symlinks, owned=owned)
    try:
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def open_regular(path: Path, *, follow_symlinks: bool = False, owned: bool = False) -> int:
    """An fd of a regular file for reading (the caller closes it), with read_regular's refusals."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_CLOEXEC if follow_symlinks else _OPEN_FLAGS)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise StateFileError(errno.EISDIR, "is a directory, not a file", str(path)) from None
    except OSError as exc:
        raise _explain(exc, path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO or device?)"
        raise StateFileError(errno.EINVAL, f"is {kind}", str(path))
    why = _foreign(st) if owned else None
    if why is not None:
        os.close(fd)
        raise StateFileError(errno.EPERM, why, str(path))
    return fd
