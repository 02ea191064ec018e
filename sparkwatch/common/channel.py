"""The channel between the guard process and the telemetry process: one AF_UNIX SOCK_SEQPACKET socketpair.

Why a socketpair of datagrams: each message is one datagram (message boundaries kept, no framing to get wrong), the
pair needs no path on disk, the peer's death shows as EOF, and the guard's end is non-blocking: a send that would
block is dropped and counted, so the guard never waits on telemetry. What a datagram holds is common.messages.

`receive` is bounded three ways, so a peer that sends without pause (a bug in telemetry is enough) can cost the
guard neither memory nor its loop's time: it waits at most `timeout_s` for the first datagram, then takes at most
`max_messages` and `max_bytes` of what is waiting, and says through `saturated` that it left some behind. A datagram
that is not a message, or larger than MAX_MESSAGE_BYTES, is dropped and counted (`bad_total`, `oversized_total`).
"""

from __future__ import annotations

import os
import select
import socket
import threading

from sparkwatch.common.messages import MAX_MESSAGE_BYTES, BadMessage, Message, decode, encode

# What one receive takes at most. The guard's supervisor receives once per tick (0.25-1 s); telemetry sends one `tel`
# a cycle plus one answer per reload or event, so 64 is far above a healthy peer and far below a flood.
RECEIVE_MAX_MESSAGES = 64
RECEIVE_MAX_BYTES = 4 * MAX_MESSAGE_BYTES


def socketpair() -> tuple[socket.socket, socket.socket]:
    """(guard end, telemetry end). Both close-on-exec; the supervisor passes the telemetry end to the child."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE_BYTES)
    return a, b


class ChannelClosed(Exception):
    """The peer process is gone (EOF or a reset)."""


class Channel:
    """One end of the pair. `send` never blocks; `receive` is bounded in time, messages and bytes. Thread-safe sends."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.sent_total = 0
        self.dropped_total = 0  # sends that would have blocked or failed
        self.bad_total = 0  # datagrams that were not a message of this version
        self.oversized_total = 0  # datagrams over MAX_MESSAGE_BYTES (also counted in bad_total)
        self.saturated = False  # the last receive stopped at its limits with more waiting
        self._lock = threading.Lock()

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Message) -> bool:
        return self.send_bytes(encode(msg))

    def send_bytes(self, data: bytes) -> bool:
        """One datagram as is (the peer's decode judges it); tests use it to send what a broken peer would."""
        with self._lock:
            try:
                self.sock.send(data)
            except OSError:  # BlockingIOError (peer slow), EPIPE/ECONNRESET (peer gone), EMSGSIZE
                self.dropped_total += 1
                return False
            self.sent_total += 1
            return True

    def receive(
        self,
        timeout_s: float | None,
        max_messages: int = RECEIVE_MAX_MESSAGES,
        max_bytes: int = RECEIVE_MAX_BYTES,
        *,
        wake_fd: int | None = None,
    ) -> list[Message]:
        """The messages waiting now, after waiting up to timeout_s (None: for ever) for the first, or for `wake_fd`
        to become readable (its bytes are drained), within the limits. Raises ChannelClosed."""
        self.saturated = False
        sock_fd = self.sock.fileno()
        watched = [sock_fd] if wake_fd is None else [sock_fd, wake_fd]
        ready, _, _ = select.select(watched, [], [], timeout_s)
        out: list[Message] = []
        if wake_fd is not None and wake_fd in ready:
            try:
                os.read(wake_fd, 4096)
            except BlockingIOError:
                pass
        if sock_fd not in ready:
            return out
        taken = taken_bytes = 0
        while taken < max_messages and taken_bytes < max_bytes:
            try:
                data = self.sock.recv(MAX_MESSAGE_BYTES + 1)  # one byte more: a longer datagram shows as too long
            except BlockingIOError:
                return out
            except OSError as exc:
                raise ChannelClosed(str(exc)) from None
            if not data:
                raise ChannelClosed("peer closed the channel")
            taken += 1
            taken_bytes += len(data)
            if len(data) > MAX_MESSAGE_BYTES:
                self.oversized_total += 1
                self.bad_total += 1
                continue
            try:
                out.append(decode(data))
            except BadMessage:
                self.bad_total += 1
        self.saturated = bool(select.select([self.sock], [], [], 0)[0])
        return out

    def close(self) -> None:
        self.sock.close()
