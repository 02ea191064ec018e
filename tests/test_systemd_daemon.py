"""A real `sparkwatch run` against a real $NOTIFY_SOCKET: READY, WATCHDOG, STATUS, STOPPING; a real guard-loop stall;
SIGHUP reload and SIGTERM shutdown."""

from __future__ import annotations

import itertools
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import require, require_tool, rewrite_in_place
from tests.sdtools import (
    Daemon,
    NotifyReceiver,
    clean_env,
    daemons_fixture,  # noqa: F401 - the `daemons` fixture
    free_port,
    has_systemd_python,
    make_no_systemd_python,
    notify_rx_fixture,  # noqa: F401 - the `notify_rx` fixture
)

GiB = 1 << 30
MiB = 1 << 20

BACKENDS = ["systemd-python", "builtin"]


def backend_env(backend: str, tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    if backend == "systemd-python":
        require(has_systemd_python(), "systemd-python is not installed (pip install '.[systemd]')")
    else:
        env["PYTHONPATH"] = str(make_no_systemd_python(tmp_path))
    return env


def meminfo_text(total: int, available: int) -> str:
    return (
        f"MemTotal:       {total // 1024} kB\n"
        f"MemFree:        {available // 1024} kB\n"
        f"MemAvailable:   {available // 1024} kB\n"
        "Buffers:               0 kB\n"
        "Cached:                0 kB\n"
        "SwapTotal:             0 kB\n"
        "SwapFree:              0 kB\n"
    )


def watchdogs(messages: list[tuple[float, str]], since: float = 0.0) -> list[float]:
    return [t for t, m in messages if t >= since and "WATCHDOG=1" in m.split("\n")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ready_watchdog_status_stopping_from_real_daemon(
    backend: str, tmp_path: Path, daemons: Callable[..., Daemon], notify_rx: Callable[[], NotifyReceiver]
) -> None:
    rx = notify_rx()
    env = backend_env(backend, tmp_path, clean_env(tmp_path))
    env.update(NOTIFY_SOCKET=str(rx.path), WATCHDOG_USEC="600000", SPARKWATCH_POLL_MAX_S="0.2")
    args = ["--dry-run", "--floor", "1GiB", "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "s")]
    d = daemons(args, env)
    try:
        ready = rx.wait_for(lambda m: "READY=1" in m.split("\n"), 15)
        # READY comes after the guard's first poll, so its STATUS already has the real MemAvailable.
        assert "STATUS=MemAvailable " in ready and "floor 1 GiB" in ready and "DRY RUN" in ready, ready
        t_ready = time.monotonic()
        rx.drain(2.0)
        pings = watchdogs(rx.messages, t_ready)
        # WatchdogSec 0.6 s: a ping every 0.2 s, so about 10 in 2 s; allow for a loaded machine.
        assert len(pings) >= 5, rx.messages
        assert max(b - a for a, b in itertools.pairwise(pings)) < 0.6, pings  # never late enough to trip
        assert any(m.startswith("STATUS=MemAvailable") for _t, m in rx.messages if _t > t_ready), rx.messages
        assert "sd_notify via builtin" in d.stderr  # the guard's own protocol, with or without systemd-python

        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        rx.drain(0.2)
        assert any("STOPPING=1" in m.split("\n") for _t, m in rx.messages), rx.messages
        assert "stopping" in d.stderr
    finally:
        rx.close()


def test_no_watchdog_when_meant_for_another_pid(
    tmp_path: Path, daemons: Callable[..., Daemon], notify_rx: Callable[[], NotifyReceiver]
) -> None:
    """WATCHDOG_PID names the process the watchdog is for (systemd sets it to the main pid): not us, no pings."""
    rx = notify_rx()
    env = clean_env(tmp_path)
    env.update(NOTIFY_SOCKET=str(rx.path), WATCHDOG_USEC="600000", WATCHDOG_PID="1", SPARKWATCH_POLL_MAX_S="0.2")
    args = ["--floor", "1GiB", "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "s")]
    daemons(args, env)
    try:
        rx.wait_for(lambda m: "READY=1" in m.split("\n"), 15)
        rx.drain(1.2)
        assert watchdogs(rx.messages) == [], rx.messages
    finally:
        rx.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_watchdog_stops_when_guard_loop_stalls(
    backend: str, tmp_path: Path, daemons: Callable[..., Daemon], notify_rx: Callable[[], NotifyReceiver]
) -> None:
    """A real stall of the guard thread alone: a /proc fixture where one process's stat is a FIFO nobody writes.

    When memory crosses the floor the guard scans /proc for engines, and its open() of that stat blocks, as a read
    of /proc/<pid>/cmdline blocks on a process whose mmap lock is held. The other threads run on; the watchdog pings
    must stop anyway, and resume once the read returns.
    """
    proc_root = tmp_path / "proc"
    (proc_root / "4242").mkdir(parents=True)
    fifo = proc_root / "4242" / "stat"
    os.mkfifo(fifo)
    meminfo = proc_root / "meminfo"
    meminfo.write_text(meminfo_text(120 * GiB, 60 * GiB))

    rx = notify_rx()
    env = backend_env(backend, tmp_path, clean_env(tmp_path))
    env.update(NOTIFY_SOCKET=str(rx.path), WATCHDOG_USEC="600000", SPARKWATCH_POLL_MAX_S="0.2")
    args = ["--dry-run", "--floor", "8GiB", "--proc-root", str(proc_root)]
    args += ["--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "s")]
    d = daemons(args, env)
    writer = -1
    try:
        assert "60 GiB" in rx.wait_for(lambda m: "READY=1" in m.split("\n"), 15)
        rx.drain(1.0)
        assert len(watchdogs(rx.messages)) >= 3, rx.messages

        rewrite_in_place(meminfo, meminfo_text(120 * GiB, 4 * GiB))  # under the floor: the guard fires and scans
        stalled = rx.wait_for(lambda m: m.startswith("STATUS=guard loop stalled"), 10)
        assert stalled
        t_stalled = time.monotonic()
        rx.drain(2.0)
        # The stall is reported at most ~1 s (stale_after_s = 2 x poll_max_s + 0.5) after the last beat; from then
        # on not one ping, so systemd's 0.6 s watchdog would restart the service.
        assert watchdogs(rx.messages, t_stalled) == [], rx.messages
        assert d.proc.poll() is None  # only the guard thread is stuck
        assert stat.S_ISFIFO(fifo.stat().st_mode)

        # Let the read return (EOF: a vanished process to the scanner); the loop runs again and so do the pings.
        # Move the FIFO away first: the guard scans again (to fire, or to keep its cache warm near the floor), and
        # those later scans must find the process gone rather than block once more.
        released = fifo.with_name("stat.released")
        fifo.rename(released)
        writer = os.open(released, os.O_WRONLY | os.O_NONBLOCK)
        os.close(writer)
        writer = -1
        t_free = time.monotonic()
        rx.drain(1.5)
        assert len(watchdogs(rx.messages, t_free)) >= 2, rx.messages
    finally:
        if writer >= 0:
            os.close(writer)
        rx.close()


def test_sighup_reloads_config_and_sigterm_stops(
    tmp_path: Path, daemons: Callable[..., Daemon], notify_rx: Callable[[], NotifyReceiver]
) -> None:
    config = tmp_path / "config.toml"
    port = free_port()
    config.write_text(f'floor = "2GiB"\ndry_run = true\nlisten = "127.0.0.1:{port}"\nwebhook_secret = "hunter2"\n')
    rx = notify_rx()
    env = clean_env(tmp_path)
    env.update(NOTIFY_SOCKET=str(rx.path))
    d = daemons(["--config", str(config), "--state-dir", str(tmp_path / "s")], env)
    try:
        assert "floor 2 GiB" in rx.wait_for(lambda m: "READY=1" in m.split("\n"), 15)

        # A good change: the floor and dry_run apply live, listen needs a restart, the secret is never printed.
        new_port = free_port()
        config.write_text(
            f'floor = "3GiB"\ndry_run = false\nlisten = "127.0.0.1:{new_port}"\nwebhook_secret = "correct-horse"\n'
        )
        d.proc.send_signal(signal.SIGHUP)
        log = d.wait_stderr("reload: floor")
        assert "floor: 2.0 GiB → 3.0 GiB" in log
        assert "dry_run: true → false" in log
        assert f"listen: 127.0.0.1:{port} → 127.0.0.1:{new_port}" in log
        assert "webhook_secret: changed (value hidden)" in log
        assert "hunter2" not in log and "correct-horse" not in log
        d.wait_stderr("takes effect after a restart: listen")
        # systemd sees RELOADING=1, then READY=1 with the new floor in force.
        rx.wait_for(lambda m: m.startswith("RELOADING=1"), 5)
        reloaded = rx.wait_for(lambda m: "READY=1" in m.split("\n") and "floor 3 GiB" in m, 5)
        assert "DRY RUN" not in reloaded

        # A bad change: logged, and the running config kept.
        config.write_text('floor = "lots"\n')
        d.proc.send_signal(signal.SIGHUP)
        log = d.wait_stderr("keeping the running config")
        assert "reload: config error: floor:" in log
        assert d.proc.poll() is None
        rx.drain(0.3)
        after_bad = [m for _t, m in rx.messages if "READY=1" in m.split("\n")][-1]
        assert "floor 3 GiB" in after_bad

        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        rx.drain(0.2)
        assert any("STOPPING=1" in m.split("\n") for _t, m in rx.messages)
    finally:
        rx.close()


def test_sigterm_without_systemd_exits_zero(tmp_path: Path, daemons: Callable[..., Daemon]) -> None:
    env = clean_env(tmp_path)
    args = ["--floor", "1GiB", "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "s")]
    d = daemons(args, env)
    d.wait_stderr("running:")
    assert "sd_notify" not in d.stderr  # no $NOTIFY_SOCKET: nothing said about it
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(10) == 0
    assert "stopping" in d.stderr


def test_small_memlock_limit_runs_unlocked(
    tmp_path: Path, daemons: Callable[..., Daemon], notify_rx: Callable[[], NotifyReceiver]
) -> None:
    """A user unit's LimitMEMLOCK is clamped to the user manager's (often 8 MiB): the daemon must not mlockall
    under it (MCL_FUTURE would make later thread stacks fail), say so, and run. Real limits: prlimit and setpriv
    drop the limit and CAP_IPC_LOCK for the daemon."""
    prlimit = require_tool("prlimit")
    setpriv = require_tool("setpriv")
    env = clean_env(tmp_path)
    env["SPARKWATCH_MLOCK"] = "true"
    rx = notify_rx()
    env["NOTIFY_SOCKET"] = str(rx.path)
    wrapper = [setpriv, "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", prlimit, "--memlock=8388608", "--"]
    args = ["--floor", "1GiB", "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "s")]
    d = daemons(args, env, wrapper=wrapper)
    try:
        log = d.wait_stderr("running:")
        assert "not locking memory: RLIMIT_MEMLOCK is 8 MiB" in log
        assert "mlockall:" not in log
        rx.wait_for(lambda m: "READY=1" in m.split("\n"), 15)
        assert "VmLck:\t       0 kB" in Path(f"/proc/{d.proc.pid}/status").read_text()
    finally:
        rx.close()
