"""Who besides the daemon's own user may read the event log: the members of `events_group`, when it is set.

The record of a system unit's kills lives in /var/lib/sparkwatch/events.jsonl, written by root; the engineer whose
engine was killed is not root. With `events_group = "GROUP"` the daemon keeps events.jsonl (and its rotated
generation) 0640 and the state dir 0750, both with that group: its members read the record, nobody but the daemon
writes it, and the outbox below stays 0700 (its spool files are the daemon's alone). Without the key: 0600 and 0700.

Handing a file to a group needs the daemon to be a member of it (or CAP_CHOWN): a system unit without CAP_CHOWN in
its bounding set needs `SupplementaryGroups=GROUP` (a drop-in: `systemctl edit sparkwatch`). When the handover is
refused the files stay private and the log says what to add, once; the record itself is never held up.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

from sparkwatch.common import logs

log = logs.get("sharing")
_warned: set[tuple[str, int]] = set()

FILE_MODE_SHARED = 0o640
FILE_MODE_PRIVATE = 0o600


def group_id(name: str | None) -> int | None:
    """The gid of a group given by name or number; None for None. Raises ValueError naming it when unknown."""
    if name is None:
        return None
    text = name.strip()
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        pass
    if text.isdigit():
        try:
            return grp.getgrgid(int(text)).gr_gid
        except KeyError:
            pass
    raise ValueError(f"no group {name!r} on this machine (getent group {text})")


def events_gid(name: str | None) -> int | None:
    """group_id for a process starting up: the config was validated, but a group removed since is logged, not
    fatal (the record stays private)."""
    try:
        return group_id(name)
    except ValueError as exc:
        log.error("ERROR events_group: %s; events stay readable by their owner only", exc)
        return None


def give_to_group(path: Path, gid: int) -> bool:
    """chgrp `path` (not following a symlink) to `gid`. False, with one log line per path, when refused."""
    try:
        os.chown(path, -1, gid, follow_symlinks=False)
        return True
    except PermissionError:
        if (str(path), gid) not in _warned:
            _warned.add((str(path), gid))
            log.warning(
                "WARNING events_group: cannot give %s to group %d (not a member, no CAP_CHOWN); it stays private. "
                "The system unit needs SupplementaryGroups= of that group: systemctl edit sparkwatch",
                path,
                gid,
            )
        return False


def share_events_file(path: Path, gid: int | None) -> None:
    """events.jsonl as `events_group` says: 0640 with the group, or 0600. Only a regular file we own is touched."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return
    shared = gid is not None and (st.st_gid == gid or give_to_group(path, gid))
    want = FILE_MODE_SHARED if shared else FILE_MODE_PRIVATE
    if stat.S_IMODE(st.st_mode) != want:
        os.chmod(path, want)
