"""One one-token completion, sent to an engine's OpenAI-compatible endpoint within one deadline: the serving probe.

A plain socket, not http.client: the whole exchange (connect, send, every read) is held to one deadline, so a
server that accepts and then drips a byte a second cannot hold the probe past `timeout_s`. The answer is read to
ANSWER_MAX_BYTES at most (`Connection: close`; a chunked body is joined). The key goes in one header and nowhere
else: no error text here ever carries it or the request. With `check`, the connection is shown to it before anything
is sent (an engine in another network namespace: did it land there? telemetry.sources.listeners.landed); a refusal
sends nothing and answers NOT_PROBED.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from sparkwatch.core.engines.serving import PROBE_BODY, PROBE_PATH, Outcome, judge_answer

ANSWER_MAX_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Answer:
    outcome: Outcome
    latency_s: float | None  # connect to the last byte of the answer
    error: str = ""
    connected: bool = True  # False: the connection itself failed (refused, unreachable, no answer to connect)


def _request(host: str, port: int, prefix: str, key: str | None) -> bytes:
    host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [
        f"POST {prefix}{PROBE_PATH} HTTP/1.1",
        f"Host: {host_header}",
        "User-Agent: sparkwatch-probe",
        "Content-Type: application/json",
        "Accept: application/json",
        f"Content-Length: {len(PROBE_BODY)}",
        "Connection: close",
    ]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + PROBE_BODY


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        size_line, _crlf, rest = body.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)


def parse_answer(data: bytes) -> tuple[int, bytes]:
    """(status, body) of a raw HTTP/1.1 answer; status 0 when there is no status line."""
    head, _sep, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2) if lines else []
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return 0, b""
    headers = {}
    for line in lines[1:]:
        name, _colon, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    if headers.get(b"transfer-encoding") == b"chunked":
        body = _dechunk(body)
    return int(parts[1]), body


def send_probe(
    host: str,
    port: int,
    *,
    prefix: str = "",
    key: str | None = None,
    timeout_s: float,
    check: Callable[[tuple[str, int]], str] | None = None,
) -> Answer:
    """One completion of one token; never raises for anything the network or the server does. `check`: given our
    socket's (address, port) once connected, returns why the request must not be sent ("" to send it)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    data = bytearray()
    connected = False
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            connected = True
            if check is not None:
                refused = check(sock.getsockname()[:2])
                if refused:
                    return Answer(Outcome.NOT_PROBED, None, refused)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(_request(host, port, prefix, key))
            while len(data) < ANSWER_MAX_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                piece = sock.recv(min(16384, ANSWER_MAX_BYTES - len(data)))
                if not piece:
                    break
                data += piece
    except TimeoutError:
        return Answer(Outcome.FAILED, None, f"no answer within {timeout_s:g} s", connected)
    except ConnectionRefusedError:
        return Answer(Outcome.FAILED, None, "connection refused", connected)
    except OSError as exc:
        return Answer(Outcome.FAILED, None, f"{type(exc).__name__}: {exc.strerror or 'error'}", connected)
    latency = time.monotonic() - t0
    status, body = parse_answer(bytes(data))
    if status == 0:
        return Answer(Outcome.FAILED, None, "no HTTP answer" if not data else "not an HTTP answer")
    outcome, error = judge_answer(status, body)
    return Answer(outcome, latency if outcome == Outcome.OK else None, error)
