"""The serving probe's HTTP exchange (telemetry/sources/completion.py) against servers of the test's own on loopback:
what the engine is sent, and what each kind of answer makes of the probe. The probe's schedule and its daemon are in
tests/test_serving_probe.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sparkwatch.core.engines.serving import PROBE_BODY, Outcome
from sparkwatch.telemetry.sources.completion import send_probe

OK_BODY = b'{"choices": [{"text": "!"}]}'


@contextmanager
def server(answer: Callable[[socket.socket, bytes], None]) -> Iterator[tuple[int, list[bytes]]]:
    """One connection taken on loopback: the request read whole (head and the body its Content-Length says), then
    `answer(conn, request)`; the connection stays open until the block ends unless `answer` closes it. Yields the
    port and the requests received."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got: list[bytes] = []
    done = threading.Event()

    def serve() -> None:
        conn, _addr = srv.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            head, _sep, body = data.partition(b"\r\n\r\n")
            length = next(int(v) for k, _c, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                          if k.strip().lower() == b"content-length")  # fmt: skip
            while len(body) < length:
                body += conn.recv(4096)
            got.append(head + b"\r\n\r\n" + body)
            answer(conn, data)
            done.wait(10)  # held open: an answer must end where HTTP says, not where the server hangs up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], got
    finally:
        done.set()
        thread.join(10)
        srv.close()


def test_an_answer_ends_where_its_content_length_says_while_the_server_keeps_the_connection() -> None:
    """A server that answers whole (Content-Length) and does not close despite `Connection: close`: the hand parser
    read until the server hung up and failed the probe at its deadline; h11 ends the answer where HTTP says."""

    def answer(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(OK_BODY), OK_BODY))  # fmt: skip

    with server(answer) as (port, got):
        t0 = time.monotonic()
        result = send_probe("127.0.0.1", port, key="sk-test", timeout_s=3.0)
        took = time.monotonic() - t0
    assert result.outcome == Outcome.OK, result
    assert took < 1.0 and result.latency_s is not None and result.latency_s < 1.0
    (request,) = got
    head, _sep, body = request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and body == PROBE_BODY
    assert b"Bearer sk-test\r\n" in head + b"\r\n"  # the key in its one header


def test_a_chunked_answer_is_joined_and_an_answer_that_is_no_http_fails_by_name() -> None:
    def chunked(conn: socket.socket, _request: bytes) -> None:
        half = len(OK_BODY) // 2
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (OK_BODY[:half], OK_BODY[half:]):
            conn.sendall(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
        conn.sendall(b"0\r\n\r\n")

    with server(chunked) as (port, _got):
        assert send_probe("127.0.0.1", port, timeout_s=3.0).outcome == Outcome.OK

    def garbage(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        conn.close()

    with server(garbage) as (port, _got):
        result = send_probe("127.0.0.1", port, timeout_s=3.0)
    assert (result.outcome, result.error) == (Outcome.FAILED, "not an HTTP answer")


def test_a_key_no_header_can_carry_is_never_sent_and_never_said() -> None:
    """A key with a line break would have been sent raw (a second header of the key's making); now the engine is
    connected to (the probe knows it is up) and sent nothing, the probe counts as refused (never a failure toward a
    wedge), and its error does not carry the key."""
    key = "sk-abc\r\nX-Injected: 1"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    with srv:
        result = send_probe("127.0.0.1", srv.getsockname()[1], key=key, timeout_s=1.0)
        conn, _addr = srv.accept()
        with conn:
            conn.settimeout(0.5)
            sent = conn.recv(100)
    assert result.outcome == Outcome.UNAUTHORIZED and result.connected and "sk-abc" not in result.error, result
    assert sent == b""


def test_the_landing_check_sees_the_connection_before_anything_is_sent() -> None:
    """`check` gets our end of the connection once it is made: a refusal sends nothing (NOT_PROBED, connected); a
    connection that never came is said as such (`connected` False), for the probe's word on a container's address."""
    seen: list[tuple[str, int]] = []

    def refuse(ours: tuple[str, int]) -> str:
        seen.append(ours)
        return "it landed elsewhere"

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    with srv:
        result = send_probe("127.0.0.1", srv.getsockname()[1], key="sk-x", timeout_s=1.0, check=refuse)
        conn, _addr = srv.accept()
        with conn:
            conn.settimeout(0.5)
            sent = conn.recv(100)
    assert (result.outcome, result.error, result.connected) == (Outcome.NOT_PROBED, "it landed elsewhere", True)
    assert sent == b"" and seen and seen[0][0] == "127.0.0.1"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: refused
        refused = send_probe("127.0.0.1", port, timeout_s=1.0, check=refuse)
    assert (refused.outcome, refused.connected) == (Outcome.FAILED, False) and refused.error == "connection refused"
