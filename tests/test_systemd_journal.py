"""Events in the journal: structured fields over journald's native protocol (systemd-python or our own encoder),
and `<N>`-prefixed stderr lines where there is no journal socket."""

from __future__ import annotations

import array
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import make_event
from sparkwatch.common.systemd import (
    JOURNAL_SOCKET,
    JournalSink,
    decode_native,
    encode_native,
    journal_fields,
    stderr_is_journal,
)
from sparkwatch.core.eventkinds import EventKind
from tests.conftest import floor_that_fires_at_once, require
from tests.sdtools import (
    Daemon,
    clean_env,
    daemons_fixture,  # noqa: F401 - the `daemons` fixture
    free_port,
    has_systemd_python,
    make_no_systemd_python,
)

KILL_FIELDS: dict[str, object] = {
    "trigger": "floor",
    "mem_available_bytes": 4955570176,
    "floor_bytes": 8589934592,
    "fill_rate_bytes_per_second": 0,
    "dry_run": False,
    "method": "pidfd",
    "victims": [
        {"pid": 1234, "name": "VLLM::EngineCore", "engine": "vllm", "rss_bytes": 1900000000, "cmdline": "vllm serve"},
        {"pid": 1240, "name": "nvcc", "engine": "vllm", "rss_bytes": 90000000, "cmdline": "nvcc -c a.cu"},
    ],
    "detect_to_signal_ms": 1.5,
    "signal_to_reaped_ms": None,
    "reclaimed_bytes": None,
    "survivors": [],
}


def multi(fields: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in fields:
        out.setdefault(k, []).append(v)
    return out


def test_kill_event_flattens_to_journal_fields() -> None:
    event = make_event(
        EventKind.KILL,
        "Killed vllm (root pid 1234, 2 processes): MemAvailable 4726 MiB <= floor 8192 MiB.",
        KILL_FIELDS,
    )
    f = multi(journal_fields(event))
    assert f["PRIORITY"] == ["3"]  # err: `journalctl -p err` shows every kill
    assert f["SPARKWATCH_EVENT"] == ["kill"]
    assert f["MESSAGE"] == [event.summary]
    assert f["SPARKWATCH_EVENT_ID"] == [event.id]
    assert f["SPARKWATCH_TRIGGER"] == ["floor"]
    assert f["SPARKWATCH_MEM_AVAILABLE_BYTES"] == ["4955570176"]
    assert f["SPARKWATCH_DRY_RUN"] == ["false"]
    assert f["SPARKWATCH_VICTIM_PIDS"] == ["1234 1240"]
    assert f["SPARKWATCH_VICTIM_PID"] == ["1234", "1240"]  # repeated: `journalctl SPARKWATCH_VICTIM_PID=1240` matches
    assert f["SPARKWATCH_VICTIM_NAME"] == ["VLLM::EngineCore", "nvcc"]
    assert "SPARKWATCH_SIGNAL_TO_REAPED_MS" not in f  # None is left out, not written as "None"
    for name in f:
        assert name.isupper() and len(name) <= 64 and not name.startswith("_"), name
        assert all(c.isalnum() or c == "_" for c in name), name


def test_priorities_by_kind() -> None:
    assert multi(journal_fields(make_event(EventKind.LOW_HEADROOM, "x")))["PRIORITY"] == ["4"]
    assert multi(journal_fields(make_event(EventKind.DRIVER_RECOVERED, "x")))["PRIORITY"] == ["5"]
    unknown = make_event("something_new", "x")  # type: ignore[arg-type]  # deliberately not an EventKind
    assert multi(journal_fields(unknown))["PRIORITY"] == ["5"]


def test_native_encoding_round_trips_newlines_and_binary_lengths() -> None:
    fields = [("MESSAGE", "two\nlines"), ("SPARKWATCH_X", "a=b"), ("EMPTY", ""), ("UTF", "61.2 GiB → ok")]
    data = encode_native(fields)
    # A value with a newline uses the length-prefixed form: NAME\n<le64>value\n.
    assert b"MESSAGE\n" + struct.pack("<Q", 9) + b"two\nlines\n" in data
    assert b"SPARKWATCH_X=a=b\n" in data
    assert decode_native(data) == fields


def recv_fields(path: Path, sink_call: Callable[[], None]) -> dict[str, list[str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path.unlink(missing_ok=True)
    sock.bind(str(path))
    sock.settimeout(2)
    try:
        sink_call()
        return multi(decode_native(sock.recv(1 << 20)))
    finally:
        sock.close()


def test_native_backend_sends_structured_fields(tmp_path: Path) -> None:
    path = tmp_path / "journal.socket"
    sink = JournalSink(backend="native", socket_path=path)
    event = make_event(EventKind.KILL, "Killed vllm.\nSecond line.", KILL_FIELDS)
    f = recv_fields(path, lambda: sink(event))
    assert f["MESSAGE"] == ["Killed vllm.\nSecond line."]
    assert f["SPARKWATCH_EVENT"] == ["kill"] and f["PRIORITY"] == ["3"]
    assert f["SPARKWATCH_VICTIM_PID"] == ["1234", "1240"]
    assert sink.send_errors_total == 0


def test_failed_send_falls_back_to_stderr(tmp_path: Path) -> None:
    out = tmp_path / "stderr.txt"
    with out.open("w") as stream:
        sink = JournalSink(backend="native", socket_path=tmp_path / "nobody-listens", stream=stream, env={})
        sink(make_event(EventKind.KILL, "Killed vllm.", KILL_FIELDS))
    assert sink.send_errors_total == 1
    assert out.read_text() == "sparkwatch: event kill: Killed vllm.\n"  # not the journal: no <N> prefix


def test_stderr_lines_get_priority_prefix_only_when_stderr_is_the_journal(tmp_path: Path) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        st = os.fstat(a.fileno())
        stream = os.fdopen(os.dup(a.fileno()), "w")
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert stderr_is_journal(env, stream)
        JournalSink(backend="stderr", stream=stream, env=env)(make_event(EventKind.KILL, "Killed vllm.", KILL_FIELDS))
        JournalSink(backend="stderr", stream=stream, env=env)(make_event(EventKind.LOW_HEADROOM, "Low."))
        # Another stream than the one $JOURNAL_STREAM names: plain lines.
        other = (tmp_path / "plain.txt").open("w")
        assert not stderr_is_journal(env, other)
        JournalSink(backend="stderr", stream=other, env=env)(make_event(EventKind.KILL, "Killed vllm.", KILL_FIELDS))
        other.close()
        stream.close()
        b.settimeout(2)
        got = b.recv(4096).decode()
        assert got == "<3>sparkwatch: event kill: Killed vllm.\n<4>sparkwatch: event low_headroom: Low.\n"
        assert (tmp_path / "plain.txt").read_text() == "sparkwatch: event kill: Killed vllm.\n"
    finally:
        a.close()
        b.close()


def test_systemd_python_backend_speaks_native_protocol(tmp_path: Path) -> None:
    """systemd-python always writes to /run/systemd/journal/socket; run it in a child whose libsystemd we cannot
    redirect, so bind that very path (root, and only where no journald owns it)."""
    require(has_systemd_python(), "systemd-python is not installed (pip install '.[systemd]')")
    with real_journal_path() as rx:
        sink = JournalSink(backend="systemd-python")
        sink(make_event(EventKind.KILL, "Killed vllm (root pid 1234).", KILL_FIELDS))
        f = rx.fields_from(os.getpid(), timeout_s=5)
    assert sink.send_errors_total == 0
    assert f["SPARKWATCH_EVENT"] == ["kill"] and f["PRIORITY"] == ["3"]
    assert f["SPARKWATCH_VICTIM_PIDS"] == ["1234 1240"]
    assert f["MESSAGE"] == ["Killed vllm (root pid 1234)."]


class JournalReceiver:
    """A datagram socket at journald's own path, with SO_PASSCRED so each datagram says which pid sent it (other
    engineers' daemons on this machine may write to it too)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind(str(JOURNAL_SOCKET))

    def fields_from(self, pid: int, timeout_s: float, event: str | None = None) -> dict[str, list[str]]:
        deadline = time.monotonic() + timeout_s
        ucred = struct.calcsize("3i")
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data, anc, _flags, _addr = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(ucred))
            except TimeoutError:
                break
            sender = None
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    sender = array.array("i", cdata[:ucred])[0]
            if sender == pid:
                fields = multi(decode_native(data))
                if event is None or fields.get("SPARKWATCH_EVENT") == [event]:
                    return fields
        raise AssertionError(f"no journal datagram from pid {pid} within {timeout_s} s")

    def close(self) -> None:
        self.sock.close()


class real_journal_path:
    def __enter__(self) -> JournalReceiver:
        require(os.geteuid() == 0, "binding /run/systemd/journal/socket needs root")
        require(not JOURNAL_SOCKET.exists(), f"{JOURNAL_SOCKET} exists: a real journald owns it")
        require(JOURNAL_SOCKET.parent.parent.is_dir(), f"{JOURNAL_SOCKET.parent.parent} does not exist")
        self.made_dir = not JOURNAL_SOCKET.parent.exists()
        JOURNAL_SOCKET.parent.mkdir(exist_ok=True)
        self.rx = JournalReceiver()
        return self.rx

    def __exit__(self, *exc: object) -> None:
        self.rx.close()
        JOURNAL_SOCKET.unlink(missing_ok=True)
        if self.made_dir:
            JOURNAL_SOCKET.parent.rmdir()


@pytest.mark.parametrize("backend", ["systemd-python", "native"])
def test_real_daemon_kill_event_reaches_journal_socket(
    backend: str, tmp_path: Path, daemons: Callable[..., Daemon]
) -> None:
    """A real dry-run kill: an engine titled VLLM::EngineCore under this test, a floor above MemAvailable, and the
    daemon's would_kill event arriving at the journal socket with its structured fields."""
    env = clean_env(tmp_path)
    if backend == "systemd-python":
        require(has_systemd_python(), "systemd-python is not installed (pip install '.[systemd]')")
    else:
        env["PYTHONPATH"] = str(make_no_systemd_python(tmp_path))
    code = (
        "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); print('up', flush=True); "
        "time.sleep(60)"
    )
    # A floor above what is available (but under MemTotal, which the config refuses): the guard fires at once.
    floor = floor_that_fires_at_once()
    env["SPARKWATCH_REARM_HEADROOM"] = "1MiB"
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert engine.stdout is not None and engine.stdout.readline() == b"up\n"
        with real_journal_path() as rx:
            args = ["--dry-run", "--floor", f"{floor}B", "--listen", f"127.0.0.1:{free_port()}"]
            d = daemons([*args, "--state-dir", str(tmp_path / "s")], env)
            f = rx.fields_from(d.proc.pid, timeout_s=15, event="would_kill")  # low_headroom may come first
            d.wait_stderr("sparkwatch: running:")  # the guard kills during start-up; stop only once it is running
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(10) == 0
        # The guard speaks the native protocol itself whether systemd-python is installed or not (its libsystemd was
        # 1.0 MiB of mlocked RSS); installed, only telemetry uses it.
        assert "journal via native" in d.stderr
        assert f["SPARKWATCH_EVENT"] == ["would_kill"]
        assert f["PRIORITY"] == ["4"]  # a dry run's decision is a warning: nothing died
        assert f["SYSLOG_IDENTIFIER"] == ["sparkwatch"]
        assert f["MESSAGE"][0].startswith("Would have killed vllm (root pid "), f["MESSAGE"]
        assert f["SPARKWATCH_TRIGGER"] == ["floor"]
        assert f["SPARKWATCH_DRY_RUN"] == ["true"]
        assert f["SPARKWATCH_FLOOR_BYTES"] == [str(floor)]
        assert int(f["SPARKWATCH_MEM_AVAILABLE_BYTES"][0]) > 0
        assert f["SPARKWATCH_VICTIM_PIDS"] == [str(engine.pid)]
        assert f["SPARKWATCH_VICTIM_NAME"] == ["VLLM::EngineCore"]
        assert engine.poll() is None  # dry run: nothing was signalled
    finally:
        engine.kill()
        engine.wait(10)
        if engine.stdout is not None:
            engine.stdout.close()


def test_an_entry_over_a_datagrams_limit_goes_as_a_sealed_memfd(tmp_path: Path) -> None:
    """A kill of hundreds of processes can exceed what one AF_UNIX datagram carries (EMSGSIZE): the native protocol
    then passes a sealed memfd with the entry, as sd_journal_sendv does; journald refuses an unsealed one."""
    import fcntl

    path = tmp_path / "journal.socket"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    victims = [{"pid": 1000 + i, "name": "VLLM::Worker", "cmdline": "x" * 2000} for i in range(300)]
    event = make_event(EventKind.KILL, "Killed a big tree.", {**KILL_FIELDS, "victims": victims})
    sink = JournalSink(backend="native", socket_path=path)
    try:
        sink(event)
        fds = array.array("i")
        data, anc, _flags, _addr = sock.recvmsg(1 << 16, socket.CMSG_SPACE(fds.itemsize))
        assert data == b""  # the entry itself is in the memfd
        (level, kind, payload) = anc[0]
        assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
        fds.frombytes(payload[: fds.itemsize])
        fd = fds[0]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            assert seals & want == want
            size = os.fstat(fd).st_size
            assert size > 500_000  # over any datagram limit
            fields = multi(decode_native(os.pread(fd, size, 0)))
        finally:
            os.close(fd)
        assert fields["MESSAGE"] == ["Killed a big tree."] and fields["SPARKWATCH_EVENT"] == ["kill"]
        assert sink.send_errors_total == 0
    finally:
        sock.close()
