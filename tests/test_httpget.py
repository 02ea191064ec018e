"""The one HTTP client of telemetry's readers of other agents (telemetry.sources.httpget): the peers' documents and
Ray's state API. Against real sockets on loopback: a server that keeps the connection alive and answers chunked (as
Ray's dashboard, aiohttp, does), one that answers too much, one that drips, one that is not HTTP, a closed port; a
plain GET never loads ssl; an https:// peer is read through mutual TLS from a real daemon.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sparkwatch.config.settings import load_settings
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.peerwatch import PeerWatch
from sparkwatch.telemetry.sources.httpget import HttpGet, HttpGetError
from tests.daemon import sparkwatch_run
from tests.test_telemetry_live import make_pki, mtls_env

CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"


class RawServer:
    """A TCP server on loopback running `handle(conn)` for each connection it accepts, and counting them."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.handle = handle
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.handle(conn)
            except OSError:
                pass


@contextmanager
def raw_server(handle: Callable[[socket.socket], None]) -> Iterator[RawServer]:
    server = RawServer(handle)
    try:
        yield server
    finally:
        server.sock.close()


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return b""
        data += chunk
    return data


def chunked(body: bytes) -> bytes:
    """`body` in two chunks, then the last one."""
    half = len(body) // 2
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:half], body[half:])) + b"0\r\n\r\n"


def keeps_alive(conn: socket.socket) -> None:
    while True:
        request = read_request(conn)
        if not request:
            return
        path = request.split(b" ", 2)[1]
        conn.sendall(CHUNKED + chunked(json.dumps({"path": path.decode()}).encode()))


def test_one_connection_is_kept_alive_and_a_chunked_answer_read_whole() -> None:
    with raw_server(keeps_alive) as server:
        client = HttpGet("127.0.0.1", server.port, keep_alive=True)
        for path in ("/api/v0/actors", "/api/v0/nodes", "/api/v0/jobs"):
            status, body, cut = client.get(path, 2.0, 1 << 20)
            assert (status, json.loads(body), cut) == (200, {"path": path}, False)
        assert server.accepted == 1
        client.close()
        # without keep-alive each GET is one connection, closed after it
        short = HttpGet("127.0.0.1", server.port)
        short.get("/a", 2.0, 1 << 20)
        short.get("/b", 2.0, 1 << 20)
        assert server.accepted == 3


def test_an_answer_past_the_bound_is_cut_and_its_connection_never_reused() -> None:
    def big(conn: socket.socket) -> None:
        while read_request(conn):
            body = b"x" * 5000
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    with raw_server(big) as server:
        client = HttpGet("127.0.0.1", server.port, keep_alive=True)
        status, body, cut = client.get("/", 2.0, 1000)
        assert (status, len(body), cut) == (200, 1000, True)
        assert client.get("/", 2.0, 10_000) == (200, b"x" * 5000, False)
        assert server.accepted == 2
        client.close()


def test_one_deadline_for_the_whole_answer_however_it_drips() -> None:
    stop = threading.Event()

    def drips(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        while not stop.wait(0.1):
            conn.sendall(b"x")  # each read answers within its timeout; the whole never ends in time

    with raw_server(drips) as server:
        started = time.monotonic()
        with pytest.raises(HttpGetError) as err:
            HttpGet("127.0.0.1", server.port).get("/", 0.5, 1 << 20)
        took_s = time.monotonic() - started
        stop.set()
    assert err.value.kind == "timeout" and took_s < 1.0


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n", "broken"),  # not HTTP
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "broken"),  # cut short
        (b"", "refused"),  # closed without a word: its host answered
    ],
)
def test_a_broken_answer_is_an_error_of_its_kind(answer: bytes, kind: str) -> None:
    def broken(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(answer)

    with raw_server(broken) as server, pytest.raises(HttpGetError) as err:
        HttpGet("127.0.0.1", server.port).get("/", 2.0, 1 << 20)
    assert err.value.kind == kind


def test_a_closed_port_is_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening
        with pytest.raises(HttpGetError) as err:
            HttpGet("127.0.0.1", port).get("/", 2.0, 1 << 20)
    assert err.value.kind == "refused"


def test_a_plain_get_never_loads_ssl() -> None:
    """The point of this module: telemetry reading its peers and Ray over plain HTTP maps no libssl or libcrypto."""
    with raw_server(keeps_alive) as server:
        code = (
            "import sys; from sparkwatch.telemetry.sources.httpget import HttpGet; "
            f"print(HttpGet('127.0.0.1', {server.port}).get('/x', 2.0, 1000)[0], 'ssl' in sys.modules)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["200", "False"]


def test_an_https_peer_is_read_through_mutual_tls(tmp_path: Path) -> None:
    """A real daemon serving under mTLS (its client CA required); the peer reader verifies it against the CA and
    shows its own certificate. With a certificate the daemon does not take (a server's, not made for a client) the
    read fails, counted as a bad answer: something answered, and a refused certificate is never a lost node."""
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki)
    with sparkwatch_run(tmp_path, env=mtls_env(pki)) as daemon:
        peer = f"https://127.0.0.1:{daemon.port}"
        with_cert = {"tls_client_ca_file": pki / "ca.pem", "tls_cert_file": pki / "client.pem",
                     "tls_key_file": pki / "client.key"}  # fmt: skip
        wrong_cert = {**with_cert, "tls_cert_file": pki / "server.pem", "tls_key_file": pki / "server.key"}
        for overrides, answers in ((with_cert, True), (wrong_cert, False)):
            settings = load_settings(
                None, {"state_dir": tmp_path / "reader", "peers": [peer], **overrides}, check_memory=False
            )
            watch = PeerWatch(settings, lambda event: None)
            watch.poll_once()
            doc = watch.peers[0].doc
            if answers:
                assert doc is not None and doc.version == peerdoc.VERSION
            else:
                assert doc is None and watch.counters()["peer_errors_bad_answer"] == 1
