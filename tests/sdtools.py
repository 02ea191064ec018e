"""Real `sparkwatch run` processes and a real $NOTIFY_SOCKET for the systemd tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# A directory whose `systemd` package fails to import: put on PYTHONPATH, it makes a daemon behave as if
# systemd-python were not installed, so the built-in fallbacks run in a real process too.
NO_SYSTEMD_PYTHON = "no-systemd-python"


def has_systemd_python() -> bool:
    try:
        from systemd import daemon, journal  # noqa: F401
    except ImportError:
        return False
    return True


def make_no_systemd_python(base: Path) -> Path:
    pkg = base / NO_SYSTEMD_PYTHON / "systemd"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('systemd-python hidden by the test')\n")
    return base / NO_SYSTEMD_PYTHON


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(tmp: Path) -> dict[str, str]:
    """The test's environment without anything that would steer the daemon: no SPARKWATCH_*, no systemd vars."""
    drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM", "LISTEN_FDS", "LISTEN_PID")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_") and k not in drop}
    env["XDG_CONFIG_HOME"] = str(tmp / "config-home")  # never read the developer's own config
    env["SPARKWATCH_ANCESTOR_PID"] = str(os.getpid())  # confine the guard to what this test starts
    env["SPARKWATCH_MLOCK"] = "false"  # the machine is shared; locking 40 MiB per test daemon buys nothing here
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class NotifyReceiver:
    """A unix datagram socket bound where $NOTIFY_SOCKET points, as systemd's would be."""

    path: Path
    sock: socket.socket
    messages: list[tuple[float, str]] = field(default_factory=list)

    @classmethod
    def bind(cls, path: Path) -> NotifyReceiver:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        rx = cls(path, sock)
        # Tests never close it: close it when the receiver is collected, so no ResourceWarning fails a later
        # test's teardown whenever the garbage collector happens to run.
        weakref.finalize(rx, sock.close)
        return rx

    def drain(self, timeout_s: float) -> list[tuple[float, str]]:
        """Receive for `timeout_s`; returns what arrived in that time (also kept in `messages`)."""
        got: list[tuple[float, str]] = []
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                break
            got.append((time.monotonic(), data.decode()))
        self.messages += got
        return got

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        for _t, msg in self.messages:
            if predicate(msg):
                return msg
        while time.monotonic() < deadline:
            for _t, msg in self.drain(min(0.2, max(0.01, deadline - time.monotonic()))):
                if predicate(msg):
                    return msg
        seen = [m for _t, m in self.messages][-10:]
        raise AssertionError(f"no matching sd_notify message within {timeout_s} s; last seen: {seen}")

    def close(self) -> None:
        self.sock.close()


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    stderr_path: Path

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_stderr(self, needle: str, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.stderr
            if needle in text:
                return text
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} not on the daemon's stderr (rc={self.proc.poll()}):\n{self.stderr}")


@pytest.fixture(name="notify_rx")
def notify_rx_fixture(tmp_path: Path) -> Iterator[Callable[[], NotifyReceiver]]:
    """Bind a NotifyReceiver at tmp_path/notify; closed at teardown even when the test skips or fails before its
    own cleanup (an unclosed socket is an unraisable ResourceWarning that fails whichever test runs next)."""
    opened: list[NotifyReceiver] = []

    def bind() -> NotifyReceiver:
        rx = NotifyReceiver.bind(tmp_path / "notify")
        opened.append(rx)
        return rx

    yield bind
    for rx in opened:
        rx.close()


@pytest.fixture(name="daemons")
def daemons_fixture(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start real `python -m sparkwatch run` processes; every one is killed and reaped at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], env: dict[str, str], wrapper: list[str] | None = None) -> Daemon:
        n = len(started)
        err = tmp_path / f"daemon{n}.stderr"
        with err.open("wb") as fh:
            proc = subprocess.Popen(
                [*(wrapper or []), sys.executable, "-m", "sparkwatch", "run", *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=fh,
                cwd=tmp_path,
            )
        started.append(proc)
        return Daemon(proc, err)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)
