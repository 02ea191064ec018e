"""`sparkwatch wait-settled` as a real subprocess against real process trees being torn down.

Engine processes are real (tests/helpers/staged_engine.py, titled like vLLM); SPARKWATCH_ANCESTOR_PID confines the
command to engines under this pytest process, because other people's tests run engines on the same machine.
MemAvailable is the real machine's for the process tests, with a generous tolerance (the machine is shared); the
memory-phase test uses a fixture proc root holding only a meminfo file this test rewrites.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparkwatch.core.units import GiB
from tests.conftest import rewrite_in_place
from tests.helpers.engine_tree import staged_engine

CLI = [sys.executable, "-m", "sparkwatch", "wait-settled"]
# Generous: this is a shared machine; other people's tests free GiBs at any moment.
SHARED_TOLERANCE = "4GiB"


def scoped_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env["SPARKWATCH_ANCESTOR_PID"] = str(os.getpid())
    return env


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or scoped_env()
    )


def read_line_containing(stream: object, needle: str, timeout_s: float) -> str:
    """Lines from a text pipe until one contains needle (the command's progress lines)."""
    assert hasattr(stream, "readline")
    found: list[str] = []

    def reader() -> None:
        for line in iter(stream.readline, ""):
            found.append(line)
            if needle in line:
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert found and needle in found[-1], f"no line with {needle!r} in {found!r}"
    return "".join(found)


def test_returns_0_after_a_staged_teardown_and_steady_memory() -> None:
    quiet_for = 1.0
    with staged_engine(children=("VLLM::Worker_TP0", "VLLM::Worker_TP1"), extra=["--teardown-step-s", "0.6"]) as engine:
        waiter = start(
            ["--timeout", "60", "--quiet-for", str(quiet_for), "--interval", "0.1", "--tolerance", SHARED_TOLERANCE]
        )
        try:
            assert waiter.stderr is not None
            seen = read_line_containing(waiter.stderr, "3 engine processes left", 15)
            time.sleep(0.5)
            assert waiter.poll() is None, "must block while the engine tree is alive"
            # The root stops its workers one by one, 0.6 s apart, then exits: the field's teardown, in small.
            engine.popen.send_signal(signal.SIGTERM)
            engine.popen.wait(15)
            root_gone = time.monotonic()
            _out, rest = waiter.communicate(timeout=60)
            settled_at = time.monotonic()
        finally:
            if waiter.poll() is None:
                waiter.kill()
                waiter.wait()
    progress = seen + rest
    assert waiter.returncode == 0, progress
    assert "settled: no engine process" in progress
    # It saw the tree shrink on the way down, not just present then absent.
    assert "2 engine processes left" in progress or "1 engine process left" in progress, progress
    # It waited the quiet period after the last process went (less a poll interval of slack).
    assert settled_at - root_gone >= quiet_for - 0.2


def test_returns_1_on_timeout_while_a_process_lingers() -> None:
    # A vLLM mid-allocation shrugs off SIGTERM (seen on Sparks: the memory stays pinned); the tree stays and the
    # wait must give up.
    with staged_engine(extra=["--ignore-term"]) as engine:
        engine.popen.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        result = subprocess.run(
            [*CLI, "--timeout", "1.5", "--interval", "0.2", "--tolerance", SHARED_TOLERANCE],
            check=False,
            capture_output=True,
            text=True,
            env=scoped_env(),
            timeout=30,
        )
        elapsed = time.monotonic() - t0
        assert engine.popen.poll() is None
    assert result.returncode == 1, result.stderr
    assert "timed out after 1.5 s: 2 engine processes left" in result.stderr
    # It names what it waited for: pid and title of each engine process left.
    root, worker = engine.pids
    assert f"pid {root} VLLM::EngineCore, pid {worker} VLLM::Worker_TP0" in result.stderr, result.stderr
    assert 1.5 <= elapsed < 10
    assert result.stdout == ""


def test_a_zombie_engine_holds_nothing_and_does_not_block() -> None:
    # An engine killed but not yet wait()ed by its parent is a zombie: its memory and driver files are already gone.
    with staged_engine(children=()) as engine:
        os.kill(engine.root_pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while Path(f"/proc/{engine.root_pid}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        result = subprocess.run(
            [*CLI, "--timeout", "10", "--quiet-for", "0.3", "--interval", "0.1", "--tolerance", SHARED_TOLERANCE],
            check=False,
            capture_output=True,
            text=True,
            env=scoped_env(),
            timeout=30,
        )
        listed = subprocess.run(
            [sys.executable, "-m", "sparkwatch", "engines", "--json"],
            check=False,
            capture_output=True,
            text=True,
            env=scoped_env(),
        )
    assert result.returncode == 0, result.stderr
    assert str(engine.root_pid) in listed.stdout  # still in the process table, so the test is not vacuous


def _write_meminfo(path: Path, available_bytes: int) -> None:
    # Fixed-width numbers, rewritten in place: the command reads through a kept-open fd, like the guard.
    text = (
        f"MemTotal:       {127600748:>12} kB\n"
        f"MemFree:        {1000000:>12} kB\n"
        f"MemAvailable:   {available_bytes // 1024:>12} kB\n"
        f"Buffers:        {1000:>12} kB\n"
        f"Cached:         {2000000:>12} kB\n"
    )
    rewrite_in_place(path, text)


def test_waits_while_memory_is_still_coming_back(tmp_path: Path) -> None:
    # No processes in this proc root; MemAvailable climbs 1 GiB every 0.2 s for 2 s (a teardown handing memory back),
    # then holds. Settling must come after the climb plus the quiet period.
    meminfo = tmp_path / "meminfo"
    _write_meminfo(meminfo, 20 * GiB)
    waiter = start(
        [
            "--proc-root",
            str(tmp_path),
            "--timeout",
            "30",
            "--quiet-for",
            "1",
            "--interval",
            "0.1",
            "--tolerance",
            "256MiB",
        ]
    )
    try:
        for step in range(1, 11):
            time.sleep(0.2)
            assert waiter.poll() is None, "settled while memory was still rising"
            _write_meminfo(meminfo, (20 + step) * GiB)
        climb_done = time.monotonic()
        _out, err = waiter.communicate(timeout=30)
        settled_at = time.monotonic()
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert waiter.returncode == 0, err
    assert settled_at - climb_done >= 0.9
    assert "rose" in err  # the progress line said why it was waiting
    assert "MemAvailable 30.0 GiB steady" in err


def test_bad_meminfo_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: lots\n")
    result = subprocess.run(
        [*CLI, "--proc-root", str(tmp_path)], check=False, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "meminfo" in result.stderr and "Traceback" not in result.stderr


def test_progress_is_one_updating_line_on_a_terminal(tmp_path: Path) -> None:
    _write_meminfo(tmp_path / "meminfo", 20 * GiB)
    main, sub = pty.openpty()
    proc = subprocess.Popen(
        # --root: a fixture root without dev/shm, so no file of this machine's /dev/shm adds a line
        [*CLI, "--proc-root", str(tmp_path), "--root", str(tmp_path), "--quiet-for", "1", "--interval", "0.1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=sub,
        env=scoped_env(),
    )
    os.close(sub)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 10)
            assert ready, "no output on the terminal"
            try:
                data = os.read(main, 4096)
            except OSError:  # EIO: the other side closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(main)
        proc.wait(10)
    text = b"".join(chunks).decode()
    assert proc.returncode == 0
    assert text.count("\r\x1b[K") >= 5  # redrawn in place, several times
    assert text.count("\n") == 1  # only the final line ends with a newline
    assert "settled" in text.splitlines()[-1]


def test_another_users_engine_does_not_hold_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process of uid nobody titled VLLM::EngineCore: a user who could never kill it must not wait on it.

    The title is real (argv[0] through exec, as `exec -a` does); the waiting user is this process pretending to be
    uid 1000, since every real other-user process here is started by root."""
    if os.geteuid() != 0:
        pytest.skip("starting a process as another user needs root")
    other = subprocess.Popen(["VLLM::EngineCore", "600"], executable="/bin/sleep", user=65534)
    try:
        monkeypatch.setenv("SPARKWATCH_ANCESTOR_PID", str(os.getpid()))
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        from sparkwatch.cli import main

        rc = main(["wait-settled", "--timeout", "5", "--quiet-for", "0", "--interval", "0.1", "--tolerance", "64GiB"])
        assert rc == 0
        monkeypatch.setattr(os, "geteuid", lambda: 0)  # as root the guard could kill it: then it is waited for
        rc = main(["wait-settled", "--timeout", "1", "--quiet-for", "0", "--interval", "0.1", "--tolerance", "64GiB"])
        assert rc == 1
    finally:
        other.kill()
        other.wait()
