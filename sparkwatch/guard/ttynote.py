"""One line on a killed engine's own terminal: who killed it, why, and where to read more.

A foreground `vllm serve` killed by the guard leaves its shell saying `Killed` and nothing more; the owner looking at
that terminal has no reason to think of sparkwatch. So after a kill (on the reaper's thread, never on the kill path)
the guard writes core.kill.killrecord.terminal_note to the controlling terminal of each tree root that had one, when
that terminal belongs to the root's own user: the guard never writes to anyone else's terminal, whatever it runs as.

The device is opened non-blocking and without becoming our controlling terminal, and checked after the open to be the
very terminal the victim had (a character device with that number, owned by the victim's uid), so a path swapped
meanwhile is not written to. A user unit writes to its own user's terminals. The system unit runs as root without
CAP_DAC_OVERRIDE, so it can write only through group `tty` (`SupplementaryGroups=tty`); without that, or when the
owner turned messages off (`mesg n` removes the group's write), the line is skipped and the log says why.
"""

from __future__ import annotations

import errno
import os
import stat

from sparkwatch.common import logs
from sparkwatch.core.kill.terminal import tty_device, tty_major_minor
from sparkwatch.core.redact import safe_text

log = logs.get("ttynote")


def tell_terminal(tty_nr: int, uid: int, line: str, dev_root: str = "/dev") -> bool:
    """Write `line` to the terminal numbered `tty_nr` (proc stat field 7) if it is `uid`'s. True when written."""
    name = tty_device(tty_nr)
    if name is None:
        return False
    path = f"{dev_root}/{name}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        log.info("no line on %s for the killed engine: %s", path, exc.strerror)
        return False
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISCHR(st.st_mode)
            or (os.major(st.st_rdev), os.minor(st.st_rdev)) != tty_major_minor(tty_nr)
            or st.st_uid != uid
        ):
            log.info("no line on %s for the killed engine: not that user's terminal", path)
            return False
        # safe_text: the line is sparkwatch's words, but a cause a peer named reaches it; ESC is ASCII too
        data = ("\r\n" + safe_text(line) + "\r\n").encode("ascii", errors="replace")
        os.write(fd, data)
        return True
    except OSError as exc:
        if exc.errno != errno.EAGAIN:  # a terminal stopped with ^S: the line is not worth waiting for
            log.info("no line on %s for the killed engine: %s", path, exc.strerror)
        return False
    finally:
        os.close(fd)
