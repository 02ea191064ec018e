"""The metrics endpoint stays up against idle connections, slow clients and TLS connections that never say hello."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from sparkwatch.guard.killer import find_cgroup2_mount
from sparkwatch.telemetry.exporter.server import BoundedHTTPServer
from tests.conftest import require
from tests.daemon import sparkwatch_run
from tests.test_telemetry_live import make_pki


def get(url: str, context: ssl.SSLContext | None = None, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
        return str(r.read().decode())


def idle_connections(port: int, n: int, stack: ExitStack) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        stack.callback(s.close)
        out.append(s)
    return out


def echo_handler(method: str, path: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
    return 200, "text/plain", f"{method} {path}\n".encode()


def test_idle_and_slow_clients_cost_no_threads_and_block_nothing() -> None:
    server = BoundedHTTPServer("127.0.0.1", 0, echo_handler, max_connections=32, request_timeout_s=1.0)
    server.start()
    port = server.server_address[1]
    threads_before = threading.active_count()
    try:
        with ExitStack() as stack:
            idle_connections(port, 200, stack)  # more than the cap: the longest idle are closed
            slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
            for s in slow:
                stack.callback(s.close)
                s.sendall(b"GET /metr")  # then nothing: a worker takes it, the deadline frees the worker
            assert threading.active_count() == threads_before
            for _ in range(5):
                assert get(f"http://127.0.0.1:{port}/metrics") == "GET /metrics\n"
            assert server.evicted_total >= 200 - 32
    finally:
        server.stop()


@contextmanager
def pids_cgroup() -> Iterator[Path]:
    """A cgroup with the pids controller the test may write, v2 or v1; skipped (failed in CI) where there is none."""
    candidates = []
    v2 = find_cgroup2_mount(Path("/proc"))
    if v2 is not None and "pids" in (v2 / "cgroup.controllers").read_text(errors="replace").split():
        candidates.append(v2)
    if Path("/sys/fs/cgroup/pids/cgroup.procs").exists():
        candidates.append(Path("/sys/fs/cgroup/pids"))
    made: Path | None = None
    for base in candidates:
        try:
            path = base / f"sparkwatch-test-{uuid.uuid4().hex[:8]}"
            path.mkdir()
            if not (path / "pids.max").exists():
                path.rmdir()
                continue
            made = path
            break
        except OSError:
            continue
    require(made is not None, "needs a writable cgroup with the pids controller (root)")
    assert made is not None
    try:
        yield made
    finally:
        for _ in range(50):
            try:
                made.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.slow
def test_scrapes_and_guard_survive_200_idle_connections_under_a_task_limit(tmp_path: Path) -> None:
    with pids_cgroup() as cg, sparkwatch_run(tmp_path, env={"SPARKWATCH_MLOCK": "false"}) as d:
        url = f"http://127.0.0.1:{d.port}/metrics"
        assert "sparkwatch_build_info" in get(url)
        (cg / "cgroup.procs").write_text(str(d.proc.pid))
        tasks = int((cg / "pids.current").read_text())
        # The daemon's tasks now, plus 4: a thread per connection (prometheus_client's server) would hit it at once.
        (cg / "pids.max").write_text(str(tasks + 4))
        with ExitStack() as stack:
            idle_connections(d.port, 200, stack)
            time.sleep(1.0)
            for _ in range(10):
                text = get(url)
                assert "sparkwatch_build_info" in text
            age = next(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("sparkwatch_guard_loop_age_seconds")
            )
            assert age < 5.0, age  # the guard kept polling (its interval is at most 1 s)
            # The evictions are counted where an owner sees them (at most 64 connections are kept: 200 opened).
            evicted = next(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("sparkwatch_internal_errors_total{")
                and 'component="metrics"' in line
                and 'counter="connections_evicted"' in line
            )
            assert evicted >= 200 - 64, evicted  # MAX_CONNECTIONS
        assert d.proc.poll() is None
        assert not any("can't start new thread" in line for line in d.stderr_lines), d.stderr_lines
        assert int((cg / "pids.current").read_text()) <= tasks + 4
    # cgroup.procs of a dead daemon empties itself: the context exit removes the cgroup


def test_tls_connection_without_client_hello_does_not_block_https_scrapes(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki)
    env = {
        "SPARKWATCH_MLOCK": "false",
        "SPARKWATCH_TLS_CERT_FILE": str(pki / "server.pem"),
        "SPARKWATCH_TLS_KEY_FILE": str(pki / "server.key"),
    }
    with sparkwatch_run(tmp_path, env=env) as d, ExitStack() as stack:
        silent = idle_connections(d.port, 3, stack)  # TCP up, no ClientHello, ever
        stuck = socket.create_connection(("127.0.0.1", d.port))
        stack.callback(stuck.close)
        stuck.sendall(b"\x16\x03\x01\x02\x00\x01")  # the start of a ClientHello, then silence
        context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        for _ in range(5):
            assert "sparkwatch_build_info" in get(f"https://127.0.0.1:{d.port}/metrics", context, timeout=10)
        assert all(s.fileno() >= 0 for s in silent)
        assert os.path.exists(pki / "server.pem")


def test_a_taken_port_leaves_telemetry_running_and_serves_once_free(tmp_path: Path) -> None:
    """Another program holds the metrics port. Telemetry must run on (alerts, driver checks) and bind once the port
    is free, not exit and be restarted with backoff for as long as the port stays taken."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = int(blocker.getsockname()[1])
    try:
        with sparkwatch_run(tmp_path, env={"SPARKWATCH_LISTEN": f"127.0.0.1:{port}"}) as d:
            assert any(f"127.0.0.1:{port} is in use" in line for line in d.stderr_lines), d.stderr_lines
            assert any(f"metrics waiting for 127.0.0.1:{port}" in line for line in d.stderr_lines), d.stderr_lines
            time.sleep(2.0)  # the old code had exited and been restarted by now (backoff 1 s)
            assert not any("restarting it" in line for line in d.stderr_lines), d.stderr_lines
            blocker.close()
            url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.monotonic() + 15  # BIND_RETRY_S is 5 s
            text = ""
            while time.monotonic() < deadline and "sparkwatch_build_info" not in text:
                try:
                    text = get(url)
                except OSError:
                    time.sleep(0.25)
            assert "sparkwatch_build_info" in text
            taken = [
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("sparkwatch_internal_errors_total{") and 'counter="port_in_use"' in line
            ]
            assert taken and taken[0] >= 1, taken
            assert any(f"metrics on 127.0.0.1:{port}" in line for line in d.stderr_lines)
            assert not any("restarting it" in line for line in d.stderr_lines), d.stderr_lines
            assert d.proc.poll() is None
    finally:
        blocker.close()


def test_a_handler_that_raises_answers_500_is_counted_and_said(caplog: pytest.LogCaptureFixture) -> None:
    """A collector that raises used to end the connection with no reply and no log line: a scrape saw 'empty reply'
    and nobody knew why. Now: 500, a counter, and one log line a minute with the exception."""

    def broken(method: str, path: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        raise AttributeError("'TelemetryLoop' object has no attribute 'launched'")

    server = BoundedHTTPServer("127.0.0.1", 0, broken)
    server.start()
    port = server.server_address[1]
    try:
        with caplog.at_level("ERROR"):
            for _ in range(3):
                with pytest.raises(urllib.error.HTTPError) as err:
                    get(f"http://127.0.0.1:{port}/metrics")
                assert err.value.code == 500
                err.value.close()
        assert server.render_errors_total == 3
        said = [r.getMessage() for r in caplog.records if "rendering /metrics failed" in r.getMessage()]
        assert len(said) == 1 and "no attribute 'launched'" in said[0]
    finally:
        server.stop()
