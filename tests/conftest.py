"""Shared fixtures: tool discovery, a webhook receiver, and process trees that only ever signal what the
test started."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import read_children, read_start_ticks
from tests.dockerd import Dockerd
from tests.dockerd import missing_reason as dockerd_missing_reason
from tests.dockerd import start as start_dockerd
from tests.dockerd import stop as stop_dockerd
from tests.receiver import Receiver

ROOT = Path(__file__).resolve().parent.parent
FAKE_ENGINE = ROOT / "tests" / "helpers" / "fake_engine.py"


REQUIRE_TOOLS_ENV = "SPARKWATCH_TEST_REQUIRE_TOOLS"  # CI sets it to 1: a missing tool fails instead of skipping


def require(condition: bool, reason: str) -> None:
    """Skip unless `condition`; under SPARKWATCH_TEST_REQUIRE_TOOLS=1 (CI) a failure instead, so CI never hides
    a missing install step behind a skip."""
    if condition:
        return
    if os.environ.get(REQUIRE_TOOLS_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_TOOLS_ENV}=1)")
    pytest.skip(reason)


def require_tool(name: str) -> str:
    """Path of a real tool the test needs (apt packages are listed in .ci/run)."""
    path = shutil.which(name)
    require(path is not None, f"{name} is not installed (apt packages are listed in .ci/run)")
    assert path is not None
    return path


def rewrite_in_place(path: Path, text: str | bytes) -> None:
    """Replace a fixture file's content without a new inode: meminfo readers keep their fd open, as procfs allows.

    pwrite then ftruncate, never truncate first: a reader racing the rewrite sees old or new text, not an empty file.
    """
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    frontier = [pid]
    while frontier:
        nxt: list[int] = []
        for p in frontier:
            nxt.extend(read_children("/proc", p) or [])
        out.extend(nxt)
        frontier = nxt
    return out


def alive(pid: int, start_ticks: int | None = None) -> bool:
    """True if that very process still exists (not a zombie). A reused pid has another start time."""
    ticks = read_start_ticks("/proc", pid)
    if ticks is None or (start_ticks is not None and ticks != start_ticks):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def wakeups(thread: threading.Thread | None) -> int:
    """How many times the kernel has run one of this process's threads so far (the run periods in
    /proc/self/task/TID/schedstat): a thread asleep adds none, each wake-up adds one, whatever the box's load."""
    assert thread is not None and thread.native_id is not None and thread.is_alive()
    path = Path(f"/proc/self/task/{thread.native_id}/schedstat")
    require(path.exists(), "no schedstat in /proc (a kernel without CONFIG_SCHED_INFO)")
    return int(path.read_text().split()[2])


def settled_available_bytes(timeout_s: float = 30.0, span_bytes: int = 128 << 20) -> int:
    """MemAvailable once it has held still (within span_bytes over 2 s), for a floor set relative to it.

    A test that sets its floor while an earlier test's processes still give memory back (a Ray cluster's teardown
    frees its gigabytes over seconds) would find the box gigabytes above that floor when its own spike comes.
    """
    from sparkwatch.common.sources.meminfo import MeminfoReader

    samples: list[int] = []
    deadline = time.monotonic() + timeout_s
    with MeminfoReader() as reader:
        while True:
            samples = [*samples[-3:], reader.read().available_bytes]
            if len(samples) == 4 and max(samples) - min(samples) <= span_bytes:
                return samples[-1]
            if time.monotonic() >= deadline:
                return max(samples)
            time.sleep(0.5)


def floor_that_fires_at_once() -> int:
    """A floor the guard is under from its first sample, whatever an earlier test still gives back: 64 MiB under
    MemTotal (the config refuses a floor at or above it). MemAvailable never comes that close on a running box: the
    kernel's slab and page tables and the test's own processes hold more (524 MiB here with the suite idle). A floor
    set halfway between MemAvailable and MemTotal could not promise that: on a box where the two are 0.5 GiB apart,
    an earlier test's processes giving 300 MiB back lifted MemAvailable over it and the guard never fired."""
    from sparkwatch.common.sources.meminfo import MeminfoReader

    with MeminfoReader() as reader:
        return reader.read().total_bytes - (64 << 20)


class Spawner:
    """Starts processes for a test and, at teardown, SIGKILLs exactly those and their descendants."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pidfiles: list[Path] = []

    def popen(self, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = subprocess.Popen(argv, **kw)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def engine(self, *args: str, pidfile: Path | None = None, wait_for: int = 1) -> subprocess.Popen[bytes]:
        """A fake engine tree (tests/helpers/fake_engine.py); waits until `wait_for` processes recorded themselves."""
        argv = [sys.executable, str(FAKE_ENGINE), *args]
        if pidfile is not None:
            argv += ["--pidfile", str(pidfile)]
            self.pidfiles.append(pidfile)
        proc = self.popen(argv)
        if pidfile is not None:
            ok = wait_until(lambda: pidfile.exists() and len(pidfile.read_text().splitlines()) >= wait_for, 20)
            assert ok, f"fake engine did not start {wait_for} processes"
        return proc

    def cleanup(self) -> None:
        # Recorded members first (orphans whose parent died are no longer anyone's descendants); the start time
        # guarantees we signal the process that was recorded, never a reuse of its pid.
        for pidfile in self.pidfiles:
            for pid, (ticks, _role) in (pids_in(pidfile) if pidfile.exists() else {}).items():
                if read_start_ticks("/proc", pid) == ticks:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for proc in self.procs:
            pids = [proc.pid, *descendants(proc.pid)]
            for pid in reversed(pids):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what imports and collection made (modules, Ray, hypothesis), so each teardown's collect below scans only
    what tests make. Measured on test_core_engines and test_config (73 tests): the collects cost 4.1 s unfrozen, 0.8 s
    frozen."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def _a_runtime_dir_of_the_suites_own() -> Iterator[None]:
    """Every guard a test starts publishes its state in $XDG_RUNTIME_DIR/sparkwatch (common.guardfile), and root
    without one in /run/sparkwatch, the system unit's: the host's, where status, doctor and launch on this machine (and
    another suite's tests) would take it for a real guard. The suite gets a runtime dir of its own; a test about the
    system dir says so in its own environment or mounts a scratch one (tests/test_declaration_trust.py)."""
    runtime = Path(tempfile.mkdtemp(prefix="sw-suite-run-"))
    before = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = before
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="session")
def dockerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dockerd]:
    """A real Docker daemon of this session's own (tests/dockerd.py), for the tests marked `docker`; skipped (failed
    under SPARKWATCH_TEST_REQUIRE_TOOLS=1) where none can start."""
    reason = dockerd_missing_reason()
    require(reason is None, reason or "")
    daemon = start_dockerd(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    try:
        yield daemon
    finally:
        stop_dockerd(daemon)


@pytest.fixture(autouse=True)
def _collect_cycles_after_each_test() -> Iterator[None]:
    """A socket or file left open inside a reference cycle is found only by a later GC pass, and pytest reports it
    (filterwarnings = error) in whichever test runs then. Collecting at every teardown fails the test that leaked it.
    CI once failed a Grafana test on a socket that another helper had left in a cycle."""
    yield
    gc.collect()


def _living_descendants() -> dict[tuple[int, int], str]:
    """(pid, start ticks) -> command line of every live (not zombie) descendant of this pytest process in its PID
    namespace (a systemd-nspawn container's processes are the container's: its own systemd stops them)."""
    out: dict[tuple[int, int], str] = {}
    own_ns = os.stat("/proc/self/ns/pid").st_ino
    for pid in descendants(os.getpid()):
        ticks = read_start_ticks("/proc", pid)
        if ticks is None or not alive(pid, ticks):
            continue
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino != own_ns:
                continue
        except OSError:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read(300).replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[(pid, ticks)] = cmd
    return out


def _sparkwatch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("sw-")}


LEAK_GRACE_S = 5.0


@pytest.fixture(autouse=True)
def _no_guard_outlives_its_test() -> Iterator[None]:
    """A guard left running by one test kills the next test's engine-shaped processes (most guards here are confined
    to this pytest's descendants) or its memory pressure. So every test ends with the processes and the in-process
    guard threads (named sw-*) it started gone: whatever is still there LEAK_GRACE_S later fails the test that left
    it, and is SIGKILLed (it is ours: a descendant started during this test). Module-scoped fixtures' processes
    started before the test and are not counted."""
    procs_before = set(_living_descendants())
    threads_before = _sparkwatch_threads()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        procs = {k: v for k, v in _living_descendants().items() if k not in procs_before}
        threads = _sparkwatch_threads() - threads_before
        if (not procs and not threads) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid, ticks in procs:
        if read_start_ticks("/proc", pid) == ticks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if procs or threads:
        pytest.fail(
            "left running after the test: "
            + "; ".join(
                [f"pid {pid}: {cmd}" for (pid, _), cmd in procs.items()] + [f"thread {t.name}" for t in threads]
            ),
            pytrace=False,
        )


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A webhook receiver on 127.0.0.1, answering 204 until told otherwise; down again after the test."""
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def spawner() -> Iterator[Spawner]:
    s = Spawner()
    try:
        yield s
    finally:
        s.cleanup()


def pids_in(pidfile: Path) -> dict[int, tuple[int, str]]:
    """pid -> (start_ticks, role) as recorded by tests/helpers/fake_engine.py."""
    out = {}
    for line in pidfile.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out[int(parts[0])] = (int(parts[1]), parts[2])
    return out
