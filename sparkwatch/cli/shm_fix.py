"""/dev/shm's leftovers as `wait-settled`, `launch` and `doctor` say them, and their `--fix`: the removal.

The scan is telemetry.sources.shmfiles's, the verdict core.launch.shmleft's. `--fix` scans again right before it
unlinks, and removes only what both scans found removable, by the same inode: a file that a process took up between
the two, or that was replaced under its name, stays. Each unlink goes through a descriptor of the directory and checks
the inode it judged, so a name swapped meanwhile in the world-writable /dev/shm is never what is removed.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from sparkwatch.core.launch.shmleft import (
    NAMED_MAX,
    fix_command,
    judge,
    kept_why,
    removable,
    removed_line,
    shown_name,
    summary,
)
from sparkwatch.core.model import ShmFile, ShmLeft
from sparkwatch.telemetry.sources.shmfiles import scan, shm_dir


def look(shm_root: Path, proc_root: Path) -> ShmLeft:
    """The orphans now, as this user can tell. Raises OSError when `shm_root` cannot be listed."""
    return judge(scan(shm_root, proc_root), os.geteuid())


def remove(shm_root: Path, proc_root: Path, judged: ShmLeft) -> tuple[list[ShmFile], list[str]]:
    """Unlink the files `judged` found removable that a fresh scan still finds removable. Returns what was removed
    (with the bytes each held at the unlink) and a line for each that could not be."""
    euid = os.geteuid()
    again = {f.key for f in removable(look(shm_root, proc_root), euid)}
    removed: list[ShmFile] = []
    failed: list[str] = []
    dir_fd = os.open(shm_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for file in removable(judged, euid):
            if file.key not in again:
                continue  # held again, or replaced: judged anew at the next look
            try:
                st = os.stat(file.name, dir_fd=dir_fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) != file.key:
                    continue
                os.unlink(file.name, dir_fd=dir_fd)
            except FileNotFoundError:
                continue  # someone removed it first
            except OSError as exc:
                failed.append(f"{shown_name(file.name)}: {exc.strerror or exc}")
                continue
            removed.append(replace(file, held_bytes=st.st_blocks * 512))
    finally:
        os.close(dir_fd)
    return removed, failed


def _hint(left: ShmLeft, euid: int, command: str) -> str | None:
    fix = fix_command(left, euid, command)
    return None if fix is None else f"sparkwatch: `{fix[0]}` {fix[1]}"


def say(root: Path, proc_root: Path, fix: bool, command: str, *, quiet: bool = False) -> None:
    """What a command prints on stderr at its settle step: one line naming the orphans under `root` (unless `quiet`),
    then with `fix` what was removed and what was kept and why; without it, the command that removes them. Nothing
    when there is none or the directory does not exist (a fixture root)."""
    stream = sys.stderr
    where = shm_dir(root)
    try:
        left = look(where, proc_root)
    except FileNotFoundError:
        return
    except OSError as exc:
        print(f"sparkwatch: cannot read {where}: {exc.strerror or exc}", file=stream)
        return
    if not left.orphans:
        return
    if not quiet:
        print(f"sparkwatch: {summary(left, str(where))}", file=stream)
    euid = os.geteuid()
    if not fix:
        hint = _hint(left, euid, command)
        if hint is not None:
            print(hint, file=stream)
        return
    try:
        removed, failed = remove(where, proc_root, left)
    except OSError as exc:  # the directory itself went or turned unreadable since the first look
        print(f"sparkwatch: fix: cannot read {where}: {exc.strerror or exc}", file=stream)
        return
    print(f"sparkwatch: fix: {removed_line(removed, str(where))}", file=stream)
    for line in failed:
        print(f"sparkwatch: fix: could not remove {line}", file=stream)
    kept = [(f, why) for f in left.orphans if (why := kept_why(f, left, euid)) is not None]
    if kept and not quiet:
        named = ", ".join(f"{shown_name(f.name)} ({why})" for f, why in kept[:NAMED_MAX])
        more = f" and {len(kept) - NAMED_MAX} more" if len(kept) > NAMED_MAX else ""
        print(f"sparkwatch: fix: kept {named}{more}", file=stream)
    hint = _hint(replace(left, orphans=tuple(f for f, _why in kept)), euid, command)  # root's, where it would do more
    if hint is not None:
        print(hint, file=stream)
