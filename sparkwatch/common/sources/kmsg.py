"""The kernel log (/dev/kmsg), read without ever blocking.

/dev/kmsg hands out one record per read(2). Opened O_NONBLOCK and moved to the end at start (SEEK_END), a read
returns the next new record or EAGAIN. Where the ring overwrote records we had not read yet, read fails once with
EPIPE and the next read resumes at the oldest record left: the gap in sequence numbers is what we lost. Where
`kernel.dmesg_restrict=1` (Ubuntu's default) and we lack CAP_SYSLOG, open fails with EPERM: the source then says
once, in `reason`, why it cannot see the kernel log, and every poll returns nothing. What was opened must be the
kernel's kmsg device (character 1:11): a sandbox can leave an empty file or another node at the path (systemd's
ProtectKernelLogs=yes does), which opens and reads nothing, and is reported as unreadable rather than as a quiet log.

The line rate is bounded by a token bucket. When a burst outruns it, the source skips to the newest record
(SEEK_END) instead of falling ever further behind: what matters to the guard is the newest line, and the skipped
records are counted as dropped from the sequence-number gap.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from sparkwatch.core.driver.nvrm import KmsgRecord, parse_kmsg_record

DEFAULT_KMSG_PATH = Path("/dev/kmsg")
# The kernel log device: character major 1 (mem), minor 11 (drivers/char/mem.c, devlist: [11] = "kmsg").
KMSG_DEVICE = (1, 11)
# A record is at most 1024 bytes of text plus its prefix and dictionary (kernel/printk: PRINTKRB_RECORD_MAX and
# CONSOLE_EXT_LOG_MAX = 8192); a shorter buffer makes read(2) fail with EINVAL.
READ_BUFFER_BYTES = 8192
# Lines per second the source parses. A driver in trouble prints tens of NVRM lines a second (the H200 booted with
# 3, an NV_ERR_NO_MEMORY episode prints 3 per failure); 2000/s keeps a 10,000 lines/s flood from other subsystems to a
# bounded cost on the guard's thread (bench/RESULTS-kmsg.md) while every NVRM line of a real episode gets through.
MAX_LINES_PER_S = 2000.0
BURST_LINES = 500.0  # bucket depth: the most records one poll reads


@dataclass
class KmsgStats:
    readable: bool = False
    reason: str | None = None  # why the kernel log cannot be read (once, for doctor and the log)
    lines_total: int = 0
    dropped_total: int = 0  # lost to the ring (EPIPE) or skipped by the rate bound, from sequence gaps
    read_errors_total: int = 0


@dataclass
class KmsgSource:
    """Owned by one thread (the guard's). `poll(now)` returns the new records, never blocks."""

    path: Path = DEFAULT_KMSG_PATH
    # Only records containing this are parsed and returned; the rest are counted by sequence number alone (most of
    # a flood is other subsystems' lines: a bytes search is the cheapest way past them).
    match: bytes | None = b"NVRM"
    max_lines_per_s: float = MAX_LINES_PER_S
    burst_lines: float = BURST_LINES
    stats: KmsgStats = field(default_factory=KmsgStats)
    _fd: int | None = field(default=None, init=False)
    _tokens: float = field(default=0.0, init=False)
    _last_t: float | None = field(default=None, init=False)
    _last_seq: int | None = field(default=None, init=False)

    def open(self) -> bool:
        """Open at the current end. False (and `stats.reason` says why) where the kernel log cannot be read."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self.stats.readable = False
            self.stats.reason = unreadable_reason(self.path, exc)
            return False
        not_kmsg = not_kmsg_reason(self.path, os.fstat(fd))
        if not_kmsg is not None:
            os.close(fd)
            self.stats.readable = False
            self.stats.reason = not_kmsg
            return False
        try:
            os.lseek(fd, 0, os.SEEK_END)
        except OSError as exc:
            os.close(fd)
            self.stats.readable = False
            self.stats.reason = f"{self.path}: cannot seek to the end ({exc.strerror or exc})"
            return False
        self._fd = fd
        # The sequence number of the newest record now, so that a ring overwrite before our first read still shows
        # as a gap: one pass over the ring (a few thousand records, milliseconds) at start, never again.
        ring, _why = read_kmsg_ring(self.path)
        self._last_seq = ring[-1].seq if ring else None
        self._tokens = self.burst_lines
        self.stats.readable = True
        self.stats.reason = None
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def fd(self) -> int | None:
        return self._fd

    def poll(self, now: float) -> list[KmsgRecord]:
        """The records that arrived since the last poll, at most what the rate bound allows."""
        if self._fd is None:
            return []
        if self._last_t is not None:
            self._tokens = min(self.burst_lines, self._tokens + (now - self._last_t) * self.max_lines_per_s)
        self._last_t = now
        out: list[KmsgRecord] = []
        while True:
            if self._tokens < 1:
                self._skip_to_end()
                break
            try:
                data = os.read(self._fd, READ_BUFFER_BYTES)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # the ring overwrote what we had not read; the next read resumes, the seq gap counts it
            except InterruptedError:
                continue
            except OSError as exc:
                self.stats.read_errors_total += 1
                if exc.errno in (errno.EBADF, errno.ENODEV):
                    self.close()
                break
            if not data:
                break
            self._tokens -= 1
            if self.match is not None and self.match not in data:
                seq = data.split(b",", 2)[1] if data.count(b",", 0, 40) >= 2 else b""
                if seq.isdigit():
                    self._count(int(seq))
                continue
            record = parse_kmsg_record(data)
            if record is None:
                continue
            self._count(record.seq)
            out.append(record)
        return out

    def _count(self, seq: int) -> None:
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.stats.dropped_total += seq - self._last_seq - 1
        self._last_seq = seq
        self.stats.lines_total += 1

    def _skip_to_end(self) -> None:
        """Over the rate bound: jump to the newest record; the next record's sequence number tells what we skipped."""
        if self._fd is None:
            return
        try:
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            self.stats.read_errors_total += 1


def unreadable_reason(path: Path, exc: OSError) -> str:
    """Why open(2) of the kernel log failed, and the fix, for the journal and doctor."""
    if exc.errno in (errno.EPERM, errno.EACCES) and os.geteuid() == 0:
        # Root refused: a sandbox, not the sysctl. systemd's ProtectKernelLogs=yes puts an inaccessible node over
        # /dev/kmsg (EACCES) and drops CAP_SYSLOG, as does a CapabilityBoundingSet= without it (EPERM where
        # kernel.dmesg_restrict=1). Measured with both under systemd 252 (docs/systemd.md).
        return (
            f"{path}: {exc.strerror} although running as root: the service's sandbox hides the kernel log "
            "(ProtectKernelLogs=yes, or no CAP_SYSLOG in CapabilityBoundingSet=); the shipped system unit reads it "
            "(ProtectKernelLogs=no, CAP_SYSLOG): reinstall it with install-service --system to see NVRM and Xid lines"
        )
    if exc.errno in (errno.EPERM, errno.EACCES):
        return (
            f"{path}: {exc.strerror} (kernel.dmesg_restrict=1 lets only a process holding CAP_SYSLOG read the kernel "
            "log): run the system unit (sudo sparkwatch install-service --system: it holds CAP_SYSLOG) or set "
            "kernel.dmesg_restrict=0 to see NVRM and Xid lines"
        )
    if exc.errno == errno.ENOENT:
        return f"{path}: no such device (a container without /dev/kmsg?)"
    return f"{path}: {exc.strerror or exc}"


def not_kmsg_reason(path: Path, st: os.stat_result) -> str | None:
    """None when `st` (fstat of what was opened at `path`) is the kernel log device, else why it is not.

    Anything else opens and then reads EOF or nothing: a source that took it would say "readable" and see no line
    ever. Seen under systemd 252: ProtectKernelLogs=yes over a /dev/kmsg that was a bind mount left an empty mode-000
    regular file, which CAP_DAC_READ_SEARCH opens (docs/systemd.md).
    """
    if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == KMSG_DEVICE:
        return None
    if stat.S_ISCHR(st.st_mode):
        what = f"the character device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    elif stat.S_ISREG(st.st_mode):
        what = f"{'an empty' if st.st_size == 0 else 'a'} regular file (mode {stat.S_IMODE(st.st_mode):03o})"
    elif stat.S_ISFIFO(st.st_mode):
        what = "a FIFO"
    else:
        what = f"a file of type {stat.filemode(st.st_mode)[0]!r}"
    major, minor = KMSG_DEVICE
    return (
        f"{path} is {what}, not the kernel log device (character {major}:{minor}): no kernel line would be seen "
        "there. A sandbox put it in the way (systemd's ProtectKernelLogs=yes does); the shipped system unit reads the "
        "kernel log (install-service --system)"
    )


def read_kmsg_ring(
    path: Path = DEFAULT_KMSG_PATH, max_records: int = 100_000, *, records_file: bool = False
) -> tuple[list[KmsgRecord], str | None]:
    """The whole ring as it is now, oldest first (doctor's one-shot look), or ([], why not). `path` must be the
    kernel log device; with `records_file` (a fixture root's dev/kmsg) a regular file read as one record per line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return [], unreadable_reason(path, exc)
    out: list[KmsgRecord] = []
    try:
        st = os.fstat(fd)
        if records_file and stat.S_ISREG(st.st_mode):
            with os.fdopen(os.dup(fd), "rb") as fh:
                lines = fh.read(64 << 20).splitlines()
            parsed = (parse_kmsg_record(line) for line in lines[-max_records:])
            return [r for r in parsed if r is not None], None
        not_kmsg = not_kmsg_reason(path, st)
        if not_kmsg is not None:
            return [], not_kmsg
        while len(out) < max_records:
            try:
                data = os.read(fd, READ_BUFFER_BYTES)
            except BlockingIOError:
                break
            except (BrokenPipeError, InterruptedError):
                continue
            except OSError as exc:
                return out, f"{path}: {exc.strerror or exc}"
            if not data:
                break
            record = parse_kmsg_record(data)
            if record is not None:
                out.append(record)
    finally:
        os.close(fd)
    return out, None
