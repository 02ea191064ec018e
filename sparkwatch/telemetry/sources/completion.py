"""One one-token completion, sent to an engine's OpenAI-compatible endpoint within one deadline: the serving probe.

Through telemetry's one HTTP client (telemetry.sources.httpget: h11 on a plain socket), never a parser of its own:
the whole exchange (connect, send, every read) is held to one deadline, so a server that accepts and then drips a
byte a second cannot hold the probe past `timeout_s`, and the answer is read to ANSWER_MAX_BYTES at most
(`Connection: close`; h11 joins a chunked body). The key goes in one header and nowhere else: no error text here ever
carries it or the request (an error says which way the exchange failed, in words of this module's own). With
`check`, the connection is shown to it before anything is sent (an engine in another network namespace: did it land
there? telemetry.sources.listeners.landed); a refusal sends nothing and answers NOT_PROBED.

h11 is imported at the first probe, not with telemetry (a node with no engine to probe never loads it). Measured
on this project's 2-core VM, shared and loaded (Python 3.11.7, h11 0.16; a loopback server answering 200 with
Content-Length, 2,000 probes a run, 5 runs each): the import, after what telemetry has loaded, 8-30 ms once and
+152-160 KiB RSS (none where a peer's or Ray's read loaded it already); a probe 0.27-0.31 ms median against
0.10-0.21 ms by the hand parser it replaced, at one probe per engine every 30 s. The hand parser read until the
server hung up, so a server that answered whole and kept the connection failed the probe at its deadline.
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


class _NotSent(Exception):
    """Connected, and nothing is to be sent: the answer says why."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.error)
        self.answer = answer


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
    from sparkwatch.telemetry.sources.httpget import HttpGet, HttpGetError  # noqa: PLC0415  (an engine to probe)

    headers = [("User-Agent", "sparkwatch-probe"), ("Content-Type", "application/json"), ("Accept", "application/json")]
    sendable = not key or (key.isascii() and key.isprintable())  # else no header can carry it: the engine is not asked
    if key and sendable:
        headers.append(("Authorization", f"Bearer {key}"))
    connected = False

    def landed(sock: socket.socket) -> None:
        nonlocal connected
        connected = True
        refused = check(sock.getsockname()[:2]) if check is not None else ""
        if refused:
            raise _NotSent(Answer(Outcome.NOT_PROBED, None, refused))
        if not sendable:  # up, and the key is not one we can send: as a key refused (never a failure toward a wedge)
            raise _NotSent(Answer(Outcome.UNAUTHORIZED, None, "its API key is not a valid HTTP header value"))

    client = HttpGet(host, port, headers=tuple(headers), on_connect=landed)
    t0 = time.monotonic()
    try:
        status, body, _cut = client.post(f"{prefix}{PROBE_PATH}", timeout_s, ANSWER_MAX_BYTES, PROBE_BODY)
    except _NotSent as stop:
        return stop.answer
    except HttpGetError as exc:
        return Answer(Outcome.FAILED, None, _failure(exc.kind, str(exc), timeout_s), connected)
    finally:
        client.close()
    latency = time.monotonic() - t0
    outcome, error = judge_answer(status, body)
    return Answer(outcome, latency if outcome == Outcome.OK else None, error)


def _failure(kind: str, message: str, timeout_s: float) -> str:
    """Which way the exchange failed (httpget's kinds), in words that never carry the request: an answer that was
    not HTTP is said as such, never with h11's message, which may quote a header we sent (the key's)."""
    if kind == "timeout":
        return f"no answer within {timeout_s:g} s"
    if kind == "broken":
        return "not an HTTP answer"
    return message[:1].lower() + message[1:]  # refused: "connection refused", "closed without an answer"; OSError's
