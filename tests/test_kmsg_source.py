"""sources.kmsg on the real /dev/kmsg (root writes lines into it), and where the kernel log cannot be read."""

from __future__ import annotations

import os
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from sparkwatch.common.sources.buddyinfo import read_buddyinfo
from sparkwatch.common.sources.kmsg import KmsgSource, read_kmsg_ring
from sparkwatch.core.driver.nvrm import parse_nvrm
from sparkwatch.core.enums import CheckStatus
from sparkwatch.core.report.doctorchecks import kernel_log_check
from tests.kmsgwriter import KMSG, kernel_ring_bytes, kmsg_writable_reason, write_kmsg

FIX = Path(__file__).parent / "fixtures" / "kmsg"


def _need_kmsg() -> None:
    reason = kmsg_writable_reason()
    if reason is not None:  # a container without /dev/kmsg, or not root: not a missing install step
        pytest.skip(reason)


def _poll_until(src: KmsgSource, marker: str, timeout_s: float = 10.0) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen += [r.text for r in src.poll(time.monotonic())]
        if any(marker in t for t in seen):
            return seen
        time.sleep(0.02)
    return seen


def test_starts_at_the_end_and_sees_new_driver_lines() -> None:
    _need_kmsg()
    tag = uuid.uuid4().hex[:8]
    write_kmsg([f"NVRM: sparkwatch-test {tag} written before the source opened"])
    src = KmsgSource()
    assert src.open() and src.stats.readable and src.stats.reason is None
    try:
        assert src.poll(time.monotonic()) == [] or all(tag not in r.text for r in src.poll(time.monotonic()))
        xid = f"NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. {tag}"
        write_kmsg([xid])
        seen = _poll_until(src, tag)
        mine = [t for t in seen if tag in t]
        assert mine == [xid]  # the line written before open is not replayed
        line = parse_nvrm(mine[0])
        assert line is not None and getattr(line, "code", None) == 79
        assert src.stats.lines_total >= 1
    finally:
        src.close()


def test_a_burst_over_the_rate_bound_is_skipped_and_counted() -> None:
    _need_kmsg()
    tag = uuid.uuid4().hex[:8]
    src = KmsgSource(match=None, max_lines_per_s=1.0, burst_lines=20)
    assert src.open()
    try:
        write_kmsg([f"sparkwatch-test burst {tag} {i}" for i in range(200)], level=6)
        first = src.poll(time.monotonic())
        assert 1 <= len(first) <= 20  # one poll reads at most the bucket, then skips to the end
        write_kmsg([f"sparkwatch-test after {tag}"], level=6)
        time.sleep(1.1)
        seen = _poll_until(src, f"after {tag}")
        assert any(f"after {tag}" in t for t in seen)
        assert src.stats.dropped_total >= 200 - 20 - len(seen)  # the skipped records, from the sequence gap
    finally:
        src.close()


def test_ring_overwrite_epipe_is_survived_and_counted() -> None:
    _need_kmsg()
    tag = uuid.uuid4().hex[:8]
    src = KmsgSource(match=None, max_lines_per_s=1e9, burst_lines=1e9)
    assert src.open()
    try:
        # Overwrite the whole ring (CONFIG_LOG_BUF_SHIFT or log_buf_len: 128 KiB-1 MiB usually) one and a half
        # times before the source reads, so its first read fails with EPIPE.
        pad = "x" * 80
        ring = kernel_ring_bytes() or 1 << 20
        lines = ring * 3 // 2 // 100 + 1000
        if lines > 300_000:
            pytest.skip(f"the kernel ring is {ring >> 20} MiB: overwriting it would flood this machine's log")
        write_kmsg([f"sparkwatch-test ring {tag} {i} {pad}" for i in range(lines)], level=7)
        write_kmsg([f"sparkwatch-test last {tag}"], level=7)
        seen = _poll_until(src, f"last {tag}", timeout_s=20)
        assert any(f"last {tag}" in t for t in seen)
        assert src.stats.dropped_total > 0  # what the ring overwrote, from the sequence gap after EPIPE
        assert src.stats.read_errors_total == 0  # EPIPE is not an error: the read resumes at the oldest record
    finally:
        src.close()


def test_only_matching_records_are_parsed_but_all_are_counted() -> None:
    _need_kmsg()
    tag = uuid.uuid4().hex[:8]
    src = KmsgSource()  # match=b"NVRM": the guard's setting
    assert src.open()
    try:
        write_kmsg([f"sparkwatch-test filler {tag} {i}" for i in range(5)], level=6)
        write_kmsg([f"NVRM: sparkwatch-test {tag}"])
        seen = _poll_until(src, tag)
        assert [t for t in seen if tag in t] == [f"NVRM: sparkwatch-test {tag}"]
        assert src.stats.lines_total >= 6 and src.stats.dropped_total == 0
    finally:
        src.close()


def test_missing_device_is_reported_not_raised(tmp_path: Path) -> None:
    src = KmsgSource(tmp_path / "no-kmsg")
    assert not src.open()
    assert src.stats.readable is False and "no such device" in (src.stats.reason or "")
    assert src.poll(time.monotonic()) == []
    records, why = read_kmsg_ring(tmp_path / "no-kmsg")
    assert records == [] and why is not None


def test_dmesg_restrict_says_why_for_an_unprivileged_user() -> None:
    restrict = Path("/proc/sys/kernel/dmesg_restrict").read_text().strip()
    if restrict != "1" or os.geteuid() != 0:
        pytest.skip(f"needs root and kernel.dmesg_restrict=1 (it is {restrict}): the refusal cannot happen here")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, try, report through the pipe, exit without running pytest's teardown
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = KmsgSource()
            opened = s.open()
            os.write(w, f"{opened}\n{s.stats.reason}\n{s.poll(0.0)}\n".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        out = fh.read()
    os.waitpid(pid, 0)
    opened_out, reason, polled = out.splitlines()
    assert opened_out == "False" and polled == "[]"
    assert "dmesg_restrict" in reason and "install-service --system" in reason


def test_read_buddyinfo_from_a_fixture_root(tmp_path: Path) -> None:
    (tmp_path / "buddyinfo").write_bytes((FIX / "h200-buddyinfo.txt").read_bytes())
    zones = read_buddyinfo(tmp_path)
    assert zones is not None and zones[2].zone == "Normal"
    assert read_buddyinfo(tmp_path / "absent") is None
    live = read_buddyinfo(Path("/proc"))
    assert live is not None and any(z.zone == "Normal" for z in live)


@pytest.mark.parametrize("name", ["h200-kmsg.txt"])
def test_ring_reader_reads_the_live_ring(name: str) -> None:
    records, why = read_kmsg_ring()
    if why is not None:
        pytest.skip(why)
    assert records and records == sorted(records, key=lambda r: r.seq)


# --- what was opened must be the kernel log device (character 1:11)
# Under systemd's ProtectKernelLogs=yes a service can find an empty mode-000 regular file at /dev/kmsg, which its
# CAP_DAC_READ_SEARCH opens (seen under systemd 252 in nspawn: sparkwatch_kernel_log_readable said 1 and no line was
# ever read). A FIFO opens non-blocking without a writer and reads EOF the same way.


def _empty_mode_000_file(tmp_path: Path) -> Path:
    path = tmp_path / "kmsg"
    path.touch()
    path.chmod(0)  # what ProtectKernelLogs=yes leaves: systemd's inaccessible "reg" node
    return path


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "kmsg"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    ("make", "what"),
    [(_empty_mode_000_file, "an empty regular file (mode 000)"), (_fifo, "a FIFO")],
    ids=["empty-mode-000-file", "fifo"],
)
def test_something_else_at_the_path_is_not_readable(tmp_path: Path, make: Callable[[Path], Path], what: str) -> None:
    path = make(tmp_path)
    if os.geteuid() != 0 and what.startswith("an empty"):
        path.chmod(0o600)  # root (CAP_DAC_READ_SEARCH) opens mode 000; an ordinary user needs a readable one
        what = "an empty regular file (mode 600)"
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # it really opens: the check is on what was opened
    assert os.read(fd, 8192) == b""
    os.close(fd)
    src = KmsgSource(path)
    assert not src.open()
    reason = src.stats.reason or ""
    assert src.stats.readable is False and src.fd is None
    assert f"{path} is {what}, not the kernel log device (character 1:11)" in reason, reason
    assert "ProtectKernelLogs=yes" in reason and "install-service --system" in reason
    assert src.poll(time.monotonic()) == []
    records, why = read_kmsg_ring(path)
    assert records == [] and why == reason
    check = kernel_log_check(records, why)  # doctor's kernel-log check
    assert check.status == CheckStatus.WARN and "not the kernel log device" in check.summary


def test_another_character_device_is_not_the_kernel_log() -> None:
    """/dev/null is character 1:3, next to kmsg's 1:11 on the same major: the minor counts too."""
    src = KmsgSource(Path("/dev/null"))
    assert not src.open()
    assert "/dev/null is the character device 1:3, not the kernel log device" in (src.stats.reason or "")
    assert read_kmsg_ring(Path("/dev/null"))[1] == src.stats.reason


def test_a_fixture_file_of_records_is_read_only_when_asked(tmp_path: Path) -> None:
    """doctor --root DIR reads DIR/dev/kmsg as a file of records; the live path never takes a file."""
    path = tmp_path / "kmsg"
    path.write_bytes((FIX / "h200-kmsg.txt").read_bytes())
    records, why = read_kmsg_ring(path, records_file=True)
    assert why is None and records and records[0].text.startswith("Linux version")
    records, why = read_kmsg_ring(path)
    assert records == [] and why is not None and "a regular file (mode 644)" in why


def test_the_real_kmsg_device_is_readable_where_it_can_be_opened() -> None:
    try:
        os.close(os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        pytest.skip(f"/dev/kmsg cannot be read here ({exc.strerror})")
    src = KmsgSource()
    try:
        assert src.open() and src.stats.readable and src.stats.reason is None
    finally:
        src.close()
    records, why = read_kmsg_ring()
    assert why is None and records


def test_the_device_is_judged_by_its_number_not_its_path(tmp_path: Path) -> None:
    """A kmsg node made elsewhere (as boot code in a container makes one) is the kernel log; the check reads the
    opened file's device number, not the name."""
    node = tmp_path / "my-kmsg"
    try:
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 11))
        fd = os.open(node, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        pytest.skip(f"cannot make and open a kmsg node here ({exc.strerror}): needs root and CAP_SYSLOG")
    os.close(fd)
    src = KmsgSource(node)
    try:
        assert src.open() and src.stats.readable, src.stats.reason
    finally:
        src.close()
