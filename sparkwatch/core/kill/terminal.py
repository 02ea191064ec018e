"""Terminals and shell jobs, as /proc/PID/stat shows them: which victim a job-control shell is watching, and which
device its terminal is.

Why the killer cares: a job-control shell (bash, zsh, fish) waits for its jobs with WUNTRACED. A SIGSTOP sent to the
process it started is reported at once, `[1]+ Stopped` and `$?` = 147, and the shell takes the terminal back; the
SIGKILL that follows is only seen by a later `jobs -l`. Nothing on the screen then says that the engine died, or who
killed it. So a job's leader is SIGKILLed without a SIGSTOP first, and its owner's terminal gets one line.

Pure: it takes the numbers the stat file holds.
"""

from __future__ import annotations

# Unix98 pseudo-terminal slaves (/dev/pts/N) use majors 136-143 (UNIX98_PTY_SLAVE_MAJOR, 256 minors each);
# virtual consoles and serial ports share major 4 (TTY_MAJOR): minors 1-63 are /dev/ttyN, 64-255 /dev/ttySN.
# Linux: include/uapi/linux/major.h and Documentation/admin-guide/devices.txt.
_PTS_MAJORS = range(136, 144)
_TTY_MAJOR = 4


def tty_major_minor(tty_nr: int) -> tuple[int, int]:
    """proc(5) stat field 7: "the minor device number is contained in the combination of bits 31 to 20 and 7 to 0;
    the major device number is in bits 15 to 8" (the kernel's new_encode_dev: the major runs up to bit 19)."""
    return (tty_nr >> 8) & 0xFFF, (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)


def tty_device(tty_nr: int) -> str | None:
    """The device path of a controlling terminal (relative to /dev), or None: none, or a kind we do not write to."""
    if tty_nr == 0:
        return None
    major, minor = tty_major_minor(tty_nr)
    if major in _PTS_MAJORS:
        return f"pts/{(major - _PTS_MAJORS.start) * 256 + minor}"
    if major == _TTY_MAJOR and 1 <= minor <= 63:
        return f"tty{minor}"
    if major == _TTY_MAJOR and 64 <= minor <= 255:
        return f"ttyS{minor - 64}"
    return None


def is_terminal_job_leader(pid: int, pgrp: int, tty_nr: int, parent_in_tree: bool) -> bool:
    """A process a job-control shell watches: the leader of its own process group (a shell puts each job in one, led
    by its first process), on a terminal, started from outside the tree being killed.

    Processes a test or a daemon starts share their parent's process group, so they are never taken for one: the
    killer's behaviour for them does not depend on whether the test runs in a terminal.
    """
    return tty_nr != 0 and pgrp == pid and not parent_in_tree
