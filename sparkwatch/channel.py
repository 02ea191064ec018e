"""The channel between the guard process and the telemetry process: one AF_UNIX SOCK_SEQPACKET socketpair.

Why a socketpair of datagrams: each message is one JSON object in one datagram (message boundaries kept, no framing
to get wrong), the pair needs no path on disk, the peer's death shows as EOF, and the guard's end is non-blocking:
a send that would block is dropped and counted, so the guard never waits on telemetry. Every message is a JSON
object `{"v": 1, "t": <type>, ...}`; unknown types are ignored (counted), so either side may be newer.

guard → telemetry
- `settings`: `{"wire": {...}, "public": {...}, "reload": bool}`: the whole validated config (config.settings_to_wire;
  the webhook secret travels here, never anywhere else), first at start, then after each good reload.
- `state` (every STATE_EVERY_S): the guard's counters as today's `sparkwatch_guard_*` metrics need them (see
  `guard_state`), plus the guard process's own counters (`process`: RSS, event/journal/notify/channel errors,
  telemetry restarts, watchdog pings).
- `event`: `{"event": {...}}`: an event the guard process made durable in events.jsonl (a kill), for the outbox.
telemetry → guard
- `applied`: `{"keys": [...], "errors": [...]}`: the reply to a `settings` with reload=true: the keys telemetry's
  components applied live.
- `ack`: `{"ids": [...]}`: events telemetry's outbox now holds; the guard resends unacknowledged ones to the next
  telemetry process if this one dies (at least once: the outbox spools by event id).
- `tel` (each telemetry cycle): `{"engines": N, "compile_jobs": N|null, "gpu_ts": wall-clock s, "gpu_pids":
  {"<pid>": bytes}}`: the STATUS= line's telemetry parts, and per-pid GPU memory (NVML) with the time it was read,
  for the kill policy (`GpuBoard`).
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # a settings message with long cache-dir lists stays far under this
STATE_EVERY_S = 0.25  # how often the guard's state is sent: the exporter's counters lag a kill by at most this


def socketpair() -> tuple[socket.socket, socket.socket]:
    """(guard end, telemetry end). Both close-on-exec; the supervisor passes the telemetry end to the child."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE_BYTES)
    return a, b


class ChannelClosed(Exception):
    """The peer process is gone (EOF or a reset)."""


class Channel:
    """One end of the pair. `send` never blocks; `receive` waits at most `timeout_s`. Thread-safe sends."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.sent_total = 0
        self.dropped_total = 0  # sends that would have blocked or failed
        self.bad_total = 0  # datagrams that were not a JSON object of a known version
        self._lock = threading.Lock()

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, kind: str, **fields: Any) -> bool:
        data = json.dumps({"v": VERSION, "t": kind, **fields}, separators=(",", ":"), default=str).encode()
        with self._lock:
            try:
                self.sock.send(data)
            except OSError:  # BlockingIOError (peer slow), EPIPE/ECONNRESET (peer gone), EMSGSIZE
                self.dropped_total += 1
                return False
            self.sent_total += 1
            return True

    def receive(self, timeout_s: float) -> list[dict[str, Any]]:
        """The messages waiting now, after waiting up to timeout_s for the first. Raises ChannelClosed."""
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        out: list[dict[str, Any]] = []
        if not ready:
            return out
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE_BYTES)
            except BlockingIOError:
                return out
            except OSError as exc:
                raise ChannelClosed(str(exc)) from None
            if not data:
                raise ChannelClosed("peer closed the channel")
            try:
                msg = json.loads(data)
            except ValueError:
                self.bad_total += 1
                continue
            if not isinstance(msg, dict) or msg.get("v") != VERSION or not isinstance(msg.get("t"), str):
                self.bad_total += 1
                continue
            out.append(msg)

    def close(self) -> None:
        self.sock.close()


@dataclass
class GpuBoard:
    """The latest per-pid GPU memory telemetry sent, and when it was read (wall clock). The kill policy reads it
    through `fresh(max_age_s)`; it is empty until telemetry's NVML answers, and stale if telemetry stalls."""

    pids: dict[int, int] = field(default_factory=dict)
    read_at_s: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    # (pid, start_ticks) of every process NVML lists as holding GPU memory: with `guard_gpu_holders` the guard treats
    # those no rule names as engines (core.engines.find_engine_trees). The start time keeps a reused pid out.
    holders: frozenset[tuple[int, int]] = frozenset()

    def update(self, pids: Mapping[str, object], read_at_s: float) -> None:
        clean = {int(k): int(v) for k, v in pids.items() if str(k).isdigit() and isinstance(v, int)}
        with self.lock:
            self.pids, self.read_at_s = clean, read_at_s

    def latest(self) -> tuple[float, dict[int, int]] | None:
        """For the kill policy (loops.guard.GpuBytesSource): (monotonic time of the reading, pid -> bytes), or None
        before telemetry's NVML answered. The policy itself ignores a reading that is too old."""
        with self.lock:
            if self.read_at_s is None:
                return None
            age_s = max(time.time() - self.read_at_s, 0.0)
            return time.monotonic() - age_s, dict(self.pids)

    def update_holders(self, holders: object) -> None:
        if not isinstance(holders, list):
            return
        keys = frozenset(
            (int(h[0]), int(h[1]))
            for h in holders
            if isinstance(h, list) and len(h) == 2 and all(isinstance(x, int) for x in h)
        )
        with self.lock:
            self.holders = keys

    def holder_keys(self) -> frozenset[tuple[int, int]]:
        with self.lock:
            return self.holders

    def fresh(self, max_age_s: float, now_s: float | None = None) -> dict[int, int]:
        """pid → GPU bytes if read within max_age_s, else {} (the policy then decides without GPU figures)."""
        now = time.time() if now_s is None else now_s
        with self.lock:
            if self.read_at_s is None or now - self.read_at_s > max_age_s:
                return {}
            return dict(self.pids)


def rss_bytes() -> int:
    """This process's resident set (VmRSS), 0 if unreadable."""
    try:
        with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
