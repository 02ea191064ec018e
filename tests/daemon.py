"""Start a real `sparkwatch run` for a test, confined to the test's own processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import descendants

# Binds port 0 on every address and prints what the kernel gave: run where the port will be bound.
_PICK = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[1])"


def free_port(prefix: Sequence[str] = ()) -> int:
    """A port free now where it will be bound: here, or (`prefix`: a command that execs the rest, `ip netns exec NS`)
    where that command runs, picked there by the kernel. A port free in this network namespace may be held in
    another one: node B's agent found its port, picked here, "in use by another process" (one of B's Ray processes,
    in B's namespace), and never served its document."""
    if not prefix:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    out = subprocess.run([*prefix, sys.executable, "-c", _PICK], capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout)


class RunningDaemon:
    def __init__(self, proc: subprocess.Popen[str], state_dir: Path, port: int) -> None:
        self.proc = proc
        self.state_dir = state_dir
        self.port = port
        self.stderr_lines: list[str] = []
        self._ready = threading.Event()
        self._guard_ready = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line.rstrip("\n"))
            if "sparkwatch: running:" in line:
                self._guard_ready = True
            if "sparkwatch: telemetry running" in line and self._guard_ready:
                self._ready.set()  # the guard polls and the telemetry process serves metrics

    def wait_ready(self, timeout_s: float = 30) -> None:
        if not self._ready.wait(timeout_s):
            raise AssertionError("daemon did not start:\n" + "\n".join(self.stderr_lines))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The whole agent SIGSTOPped (its guard, its telemetry): a wedged node, whose kernel still takes connections
        and where nothing answers. Only this test's own daemon and its children; SIGCONT again on the way out."""
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    @property
    def events_path(self) -> Path:
        return self.state_dir / "events.jsonl"


def daemon_env(tmp_path: Path, port: int) -> dict[str, str]:
    """The environment of a daemon confined to this test: engines below this test process only, a private state dir
    (tmp_path/state), runtime dir (tmp_path/run), config dir and port, no JIT cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        {
            "SPARKWATCH_ANCESTOR_PID": str(os.getpid()),
            "SPARKWATCH_STATE_DIR": str(tmp_path / "state"),
            "SPARKWATCH_LISTEN": f"127.0.0.1:{port}",
            "SPARKWATCH_JIT_CACHE_DIRS": f'["{tmp_path / "no-jit-cache"}"]',
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
            # Its runtime dir too (launch's declarations, the guard's published state guard.json): a root daemon
            # without one would publish in /run/sparkwatch, where another test's daemon could be taken for it.
            "XDG_RUNTIME_DIR": str(tmp_path / "run"),
            # Blind to the real kernel log unless a test asks for it: the kernel-log tests write NVRM lines into
            # /dev/kmsg, and another test's daemon running meanwhile must not act on them.
            "SPARKWATCH_KERNEL_LOG_PATH": str(tmp_path / "no-kmsg"),
            # Blind to the host's journal and pstore unless a test asks: the verdict on the previous boot reads them,
            # and its previous_boot alert would be one more delivery for every test that counts them.
            "SPARKWATCH_POSTMORTEM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@contextmanager
def sparkwatch_run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, prefix: Sequence[str] = ()
) -> Iterator[RunningDaemon]:
    """`sparkwatch run` with engines confined to this test process's descendants, a private state dir and port.
    `prefix`: a command that execs the rest (e.g. `unshare` into a mount namespace of the test's own)."""
    state_dir = tmp_path / "state"
    port = free_port(prefix)  # free in the namespace it runs in, where it binds it
    full_env = daemon_env(tmp_path, port)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "sparkwatch", "run", *args],
        env=full_env,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    daemon = RunningDaemon(proc, state_dir, port)
    try:
        daemon.wait_ready()
        yield daemon
    except BaseException:
        # pytest shows a failed test's captured output: the daemon's own account of what it saw and did
        print("--- sparkwatch run stderr:", *daemon.stderr_lines[-200:], sep="\n")
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        daemon._reader.join(5)
        if proc.stderr is not None:
            proc.stderr.close()


def wait_for_event(path: Path, kind: str, timeout_s: float = 30) -> dict[str, object]:
    from sparkwatch.common.eventlog import read_events

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in read_events(path):
            if event["kind"] == kind:
                return event
        time.sleep(0.05)
    seen = [e["kind"] for e in read_events(path)]
    raise AssertionError(f"no {kind} event in {path} after {timeout_s} s; recorded: {seen}")


def scrape(port: int, timeout_s: float = 10.0) -> str:
    """A daemon's /metrics on loopback, as text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
        return str(resp.read().decode())
