"""sd_notify pieces in-process, over real sockets: addresses (path and abstract), the watchdog's environment,
the STATUS line, PoolWatch.reconfigure and what a reload reports."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog
from sparkwatch.common.guardconfig import describe_wire_changes
from sparkwatch.common.messages import TelMsg
from sparkwatch.common.systemd import Notifier, ServiceNotifier, notify_address, watchdog_interval_s
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import Settings, load_settings, settings_to_wire
from sparkwatch.core.kill.policy import fresh_gpu
from sparkwatch.core.report.statusline import status_line
from sparkwatch.guard.poolwatch import PoolWatch
from tests.conftest import require
from tests.sdtools import has_systemd_python

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(name="no_sparkwatch_env")
def no_sparkwatch_env_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process settings must not pick up the SPARKWATCH_* of whoever runs the tests.
    for name in list(os.environ):
        if name.startswith("SPARKWATCH_"):
            monkeypatch.delenv(name)


def test_notify_address_forms() -> None:
    assert notify_address({"NOTIFY_SOCKET": "/run/user/1000/systemd/notify"}) == "/run/user/1000/systemd/notify"
    assert notify_address({"NOTIFY_SOCKET": "@/org/freedesktop/systemd1/notify/123"}) == (
        "\0/org/freedesktop/systemd1/notify/123"
    )
    assert notify_address({}) is None
    assert notify_address({"NOTIFY_SOCKET": "vsock:2:1234"}) is None


def test_watchdog_interval_from_env() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "10000000"}, 42) == 10.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "600000", "WATCHDOG_PID": "42"}, 42) == 0.6
    assert watchdog_interval_s({"WATCHDOG_USEC": "600000", "WATCHDOG_PID": "43"}, 42) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}, 42) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "ten"}, 42) is None
    assert watchdog_interval_s({}, 42) is None


def _abstract_receiver() -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"sparkwatch-test-{os.getpid()}-{time.monotonic_ns()}"
    sock.bind("\0" + name)
    sock.settimeout(2)
    return sock, "@" + name


@pytest.mark.parametrize("backend", ["builtin", "systemd-python"])
@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_notifier_reaches_socket(backend: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "systemd-python":
        require(has_systemd_python(), "systemd-python is not installed (pip install '.[systemd]')")
    if kind == "path":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(tmp_path / "notify"))
        sock.settimeout(2)
        address = str(tmp_path / "notify")
    else:
        sock, address = _abstract_receiver()
    # libsystemd reads the real environment, so set it there too.
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    try:
        n = Notifier(backend=backend)
        assert n.backend == backend and n.enabled
        assert n.notify("READY=1\nSTATUS=MemAvailable 61.2 GiB, floor 8 GiB")
        assert sock.recv(4096) == b"READY=1\nSTATUS=MemAvailable 61.2 GiB, floor 8 GiB"
        n.close()
    finally:
        sock.close()


def test_notifier_without_socket_is_silent() -> None:
    n = Notifier(env={}, backend="builtin")
    assert not n.enabled
    assert n.notify("READY=1") is False
    assert n.send_errors_total == 0  # not an error: just not under systemd


def test_builtin_notifier_never_blocks_on_a_full_receiver(tmp_path: Path) -> None:
    """systemd under memory pressure may not drain its socket; the sender drops the message instead of waiting."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    try:
        n = Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "notify")}, backend="builtin")
        started = time.monotonic()
        results = [n.notify("WATCHDOG=1") for _ in range(5000)]
        assert time.monotonic() - started < 5
        assert results[0] is True and results[-1] is False  # the queue filled, and we went on
        assert n.send_errors_total > 0
        n.close()
    finally:
        sock.close()


def test_service_notifier_pings_only_while_beats_are_fresh(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(0.05)
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "300000"}
    sn = ServiceNotifier(Notifier(env=env, backend="builtin"), lambda: "ok", poll_max_s=0.05, pid=1)
    assert sn.watchdog_s == 0.3 and sn.stale_after_s == pytest.approx(0.6)
    got: list[tuple[float, bytes]] = []

    def collect(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                got.append((time.monotonic(), sock.recv(4096)))
            except TimeoutError:
                pass

    try:
        sn.start()
        collect(0.3)
        assert got == []  # no READY before the guard's first beat
        stop_beating = threading.Event()

        def beat() -> None:
            while not stop_beating.wait(0.05):
                sn.beat(time.monotonic())

        beater = threading.Thread(target=beat)
        beater.start()
        collect(0.6)
        assert got[0][1] == b"READY=1\nSTATUS=ok"
        assert sum(m == b"WATCHDOG=1" for _t, m in got) >= 3
        stop_beating.set()
        beater.join()
        t_stop = time.monotonic()
        collect(1.2)
        late = [t for t, m in got if m == b"WATCHDOG=1" and t > t_stop + sn.stale_after_s + 0.15]
        assert late == []
        assert any(m.startswith(b"STATUS=guard loop stalled") for _t, m in got)
        sn.stop()
        collect(0.1)
        assert got[-1][1] == b"STOPPING=1\nSTATUS=stopping"
        sn.stopping()
        collect(0.1)
        assert got[-1][1] == b"STOPPING=1\nSTATUS=stopping"
        assert sum(m.startswith(b"STOPPING=1") for _t, m in got) == 1  # once
    finally:
        sock.close()


def test_status_line() -> None:
    assert status_line(int(61.2 * GiB), 8 * GiB) == "MemAvailable 61.2 GiB, floor 8 GiB"
    assert (
        status_line(int(61.2 * GiB), 8 * GiB, engines=1, compile_jobs=7)
        == "MemAvailable 61.2 GiB, floor 8 GiB, 1 engine, compiling 7 jobs"
    )
    assert status_line(512 * MiB, MiB, engines=2, compile_jobs=0) == "MemAvailable 512 MiB, floor 1 MiB, 2 engines"
    assert status_line(None, 8 * GiB, error="meminfo: missing MemAvailable") == (
        "MemAvailable unknown, floor 8 GiB, error: meminfo: missing MemAvailable"
    )
    assert status_line(GiB, 8 * GiB, armed=False, dry_run=True).endswith("disarmed until memory recovers, DRY RUN")
    assert len(status_line(GiB, GiB, error="x" * 500)) == 200


@pytest.mark.usefixtures("no_sparkwatch_env")
def test_guard_reconfigure_applies_live(tmp_path: Path) -> None:
    settings = load_settings(None, {"state_dir": tmp_path, "floor": "8GiB", "dry_run": True, "mlock": False})
    guard = PoolWatch.build(guard_config(settings), EventLog(settings.events_path))
    try:
        new = load_settings(
            None,
            {"state_dir": tmp_path, "floor": "4GiB", "dry_run": False, "poll_max_s": 0.5, "mlock": False},
        )
        applied = guard.reconfigure(guard_config(new))
        assert {"floor", "dry_run", "poll_max_s"} <= applied
        assert "listen" not in applied and "state_dir" not in applied
        snap = guard.snapshot  # one reference, swapped whole: the next tick reads all of it
        assert snap.config.floor == 4 * GiB and snap.config.poll_max_s == 0.5
        assert snap.config.dry_run is False  # the kill path hands the tick's snapshot to the killer per kill
    finally:
        guard.meminfo.close()  # never started: nothing else to stop


def describe_changes(old: Settings, new: Settings) -> list[tuple[str, str]]:
    """What the guard process logs on reload, from two configs as their wire forms carry them."""
    return describe_wire_changes(settings_to_wire(old), settings_to_wire(new), old.public_dict(), new.public_dict())


@pytest.mark.usefixtures("no_sparkwatch_env")
def test_describe_changes_masks_secrets(tmp_path: Path) -> None:
    old = load_settings(None, {"state_dir": tmp_path, "webhook_secret": "hunter2", "floor": "8GiB"})
    new = load_settings(
        None,
        {
            "state_dir": tmp_path,
            "webhook_secret": "correct-horse",
            "floor": "6GiB",
            "webhook_url": "https://hooks.slack.com/services/T000/B000/XXXX",
        },
    )
    changes = dict(describe_changes(old, new))
    assert set(changes) == {"webhook_secret", "floor", "webhook_url"}
    assert changes["floor"] == "floor: 8.0 GiB → 6.0 GiB"
    assert changes["webhook_secret"] == "webhook_secret: changed (value hidden)"
    assert changes["webhook_url"] == "webhook_url: unset → https://hooks.slack.com/…"
    text = " ".join(changes.values())
    assert "hunter2" not in text and "correct-horse" not in text and "XXXX" not in text
    assert describe_changes(old, old) == []


@pytest.mark.usefixtures("no_sparkwatch_env")
def test_daemon_status_line_takes_telemetry_parts_when_present(tmp_path: Path) -> None:
    """STATUS= uses the guard's MemAvailable and floor, and engines and compile jobs as the telemetry process sends
    them over the channel (a real socketpair)."""
    from sparkwatch.common.channel import Channel, socketpair
    from sparkwatch.core.model import MemInfo
    from sparkwatch.guard.process import GuardProcess

    settings = load_settings(None, {"state_dir": tmp_path, "floor": "8GiB", "mlock": False})
    daemon = GuardProcess(guard_config(settings), telemetry=None)
    a, b = socketpair()
    guard_end, telemetry_end = Channel(a), Channel(b)
    try:
        assert daemon.status_line() == "MemAvailable unknown, floor 8 GiB"  # before the first poll
        mem = MemInfo(
            total_bytes=int(121.7 * GiB),
            available_bytes=int(61.2 * GiB),
            free_bytes=GiB,
            buffers_bytes=0,
            cached_bytes=0,
            swap_total_bytes=0,
            swap_free_bytes=0,
        )
        with daemon.guard.lock:
            daemon.guard.stats.mem = mem
        assert daemon.status_line() == "MemAvailable 61.2 GiB, floor 8 GiB"
        read_at = time.time() - 10.0  # NVML read 10 s ago
        assert telemetry_end.send(TelMsg(engines=1, compile_jobs=7, gpu_ts=read_at, gpu_pids={10: 5 * GiB}))
        for msg in guard_end.receive(5.0):
            daemon.supervisor._handle(msg)
        assert daemon.status_line() == "MemAvailable 61.2 GiB, floor 8 GiB, 1 engine, compiling 7 jobs"
        reading = daemon.supervisor.gpu.latest()
        assert reading is not None and reading[1] == {10: 5 * GiB}
        assert fresh_gpu(reading, time.monotonic()) is None  # too old for the kill policy (GPU_STALE_S)
        assert fresh_gpu(reading, reading[0] + 1.0) == {10: 5 * GiB}
    finally:
        guard_end.close()
        telemetry_end.close()
        daemon.guard.meminfo.close()
        daemon.guard.reaper._meminfo.close()
