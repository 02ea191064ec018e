"""Talking to systemd: sd_notify (READY, WATCHDOG, STATUS, STOPPING) and structured journal entries for events.

Both use systemd-python (`from systemd import daemon, journal`) when it is installed, else a few lines of our own
speaking the same datagram protocols: sd_notify to $NOTIFY_SOCKET (a path, or an abstract socket written '@name'),
and journald's native protocol to /run/systemd/journal/socket. So structured fields reach the journal with or without
systemd-python; only where no journal socket exists (a container) do events become stderr lines, prefixed `<N>` for
journald when stderr is the journal ($JOURNAL_STREAM).

The watchdog is fed from the guard loop, not from a timer: the guard calls `ServiceNotifier.beat()` every iteration,
and the notifier's thread sends WATCHDOG=1 (every WatchdogSec/3) only while those beats are fresh. A guard loop stuck
in a read stops the pings and systemd restarts the service. The sending itself happens off the guard thread, so a
slow systemd (under the very memory pressure the guard is there for) can never hold up a kill.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import Event

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")

# syslog priorities, as journald's PRIORITY= field takes them.
PRIORITY_ERR, PRIORITY_WARNING, PRIORITY_NOTICE = 3, 4, 5
# A kill (or a low-memory firing that found nothing to kill) is an error; `journalctl -p err` must show it.
EVENT_PRIORITY: dict[str, int] = {
    EventKind.KILL: PRIORITY_ERR,
    EventKind.WOULD_KILL: PRIORITY_WARNING,  # a dry run's decision: nothing was signalled
    EventKind.NO_VICTIM: PRIORITY_ERR,
    EventKind.KILL_LOOP: PRIORITY_ERR,  # something restarts an engine into the same spike: a human must look
    EventKind.CONTAINER_KILL_LOOP: PRIORITY_ERR,  # a container's restart policy undid two kills: it is stopped
    EventKind.CONTAINER_STOPPED: PRIORITY_WARNING,  # a restart cancelled: the engine stays down until its owner acts
    EventKind.GROUP_TEARDOWN: PRIORITY_ERR,  # a kill too: this node's half of an engine whose rank died elsewhere
    EventKind.PEER_LOST: PRIORITY_WARNING,  # the other Spark went quiet: its last state is in the record
    EventKind.DRIVER_STRANDED: PRIORITY_ERR,
    EventKind.DRIVER_ALLOC_FAILED: PRIORITY_ERR,
    EventKind.XID: PRIORITY_WARNING,
    EventKind.LOW_HEADROOM: PRIORITY_WARNING,
    EventKind.COMPILE_BURST: PRIORITY_WARNING,
    EventKind.MAX_JOBS_MISSING: PRIORITY_WARNING,
    EventKind.JIT_STALLED: PRIORITY_WARNING,
    EventKind.OUTBOX_DROPPED: PRIORITY_WARNING,
    EventKind.OUTBOX_QUARANTINED: PRIORITY_WARNING,
    EventKind.COMPONENT_RESTARTED: PRIORITY_WARNING,
    EventKind.PREVIOUS_BOOT: PRIORITY_WARNING,  # how the last boot ended: a reboot is worth a look
    EventKind.DRIVER_RECOVERED: PRIORITY_NOTICE,
    EventKind.BUDGET_NEAR: PRIORITY_WARNING,
    EventKind.ENGINE_STARTED: PRIORITY_NOTICE,
    EventKind.ENGINE_READY: PRIORITY_NOTICE,
    EventKind.ENGINE_EXITED: PRIORITY_NOTICE,
    EventKind.ENGINE_WEDGED: PRIORITY_ERR,  # up but not serving: a human must look (or kill_wedged_after_s acts)
    EventKind.ENGINE_SERVING_AGAIN: PRIORITY_NOTICE,
}


def _systemd_python() -> tuple[Any, Any] | None:
    try:
        from systemd import daemon, journal  # noqa: PLC0415 - optional extra, imported only if present
    except ImportError:
        return None
    return daemon, journal


# --- sd_notify


def notify_address(env: Mapping[str, str]) -> str | None:
    """$NOTIFY_SOCKET as an AF_UNIX address ('@name' is Linux's abstract namespace: a leading NUL)."""
    value = env.get("NOTIFY_SOCKET", "")
    if not value or not (value.startswith("/") or value.startswith("@")):
        return None  # unset, or vsock:… which this fallback does not speak
    return "\0" + value[1:] if value.startswith("@") else value


def watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    """WatchdogSec as systemd passes it (WATCHDOG_USEC), if the watchdog is meant for this process."""
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if owner and (not owner.isdigit() or int(owner) != pid):
        return None
    return int(usec) / 1e6


class Notifier:
    """Sends sd_notify messages. `backend`: 'auto' (systemd-python if importable), 'systemd-python' or 'builtin'.

    The built-in socket is non-blocking: when the receiver's queue is full the message is dropped (and counted),
    never waited for.
    """

    def __init__(self, env: Mapping[str, str] | None = None, backend: str = "auto") -> None:
        self.env = dict(os.environ if env is None else env)
        self.address = notify_address(self.env)
        self.send_errors_total = 0
        self._sd = None
        self._sock: socket.socket | None = None
        if backend not in ("auto", "systemd-python", "builtin"):
            raise ValueError(f"unknown sd_notify backend {backend!r}")
        if backend != "builtin":
            lib = _systemd_python()
            if lib is None and backend == "systemd-python":
                raise RuntimeError("systemd-python is not installed")
            self._sd = None if lib is None else lib[0]
        self.backend = "systemd-python" if self._sd is not None else "builtin"
        if self._sd is None and self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    @property
    def enabled(self) -> bool:
        return bool(self.env.get("NOTIFY_SOCKET"))

    def notify(self, message: str) -> bool:
        if not self.enabled:
            return False
        try:
            if self._sd is not None:
                # libsystemd reads $NOTIFY_SOCKET from the real environment; ours is a copy of it.
                ok = bool(self._sd.notify(message))
            elif self._sock is not None and self.address is not None:
                self._sock.sendto(message.encode(), self.address)
                ok = True
            else:
                ok = False
        except OSError:
            ok = False
        if not ok:
            self.send_errors_total += 1
        return ok

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _PollSettings(Protocol):
    @property
    def poll_max_s(self) -> float: ...


class ServiceNotifier:
    """The daemon's side of Type=notify: READY=1 after the guard's first poll, WATCHDOG=1 while the guard loop is
    alive, a STATUS= line every few seconds, STOPPING=1 on shutdown. A component (start/stop)."""

    def __init__(
        self,
        notifier: Notifier,
        status: Callable[[], str],
        *,
        poll_max_s: float,
        status_interval_s: float = 5.0,
        pid: int | None = None,
    ) -> None:
        self.notifier = notifier
        self.status = status
        self.watchdog_s = watchdog_interval_s(notifier.env, os.getpid() if pid is None else pid)
        self.stale_after_s = self._stale_after_s(poll_max_s, self.watchdog_s)
        # With a short watchdog (tests), report a stall as quickly as the watchdog would act on it.
        self.status_interval_s = min(status_interval_s, self.watchdog_s or status_interval_s)
        self.watchdog_pings_total = 0
        self._last_beat: float | None = None
        self._first_beat = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping_sent = False
        self._lock = threading.Lock()

    @staticmethod
    def _stale_after_s(poll_max_s: float, watchdog_s: float | None) -> float:
        # A beat older than this means the guard loop is stuck. The loop beats at least every poll_max_s (1 s), so
        # allow two of those plus scheduling slack; and never less than half the watchdog period.
        return max(2 * poll_max_s + 0.5, (watchdog_s or 0) / 2)

    def reconfigure(self, settings: _PollSettings) -> frozenset[str]:
        self.stale_after_s = self._stale_after_s(settings.poll_max_s, self.watchdog_s)
        return frozenset()  # poll_max_s is the guard's key; this only follows it

    # On the guard thread: must stay cheap and never block.
    def beat(self, now: float) -> None:
        self._last_beat = now
        if not self._first_beat.is_set():
            self._first_beat.set()

    def start(self) -> None:
        if not self.notifier.enabled:
            return
        self._thread = daemon_thread(self._run, "sparkwatch-sd-notify")
        self._thread.start()

    def stopping(self) -> None:
        """STOPPING=1, once. The daemon calls this as soon as it decides to stop, before stopping components."""
        with self._lock:
            if self._stopping_sent:
                return
            self._stopping_sent = True
        self.notifier.notify("STOPPING=1\nSTATUS=stopping")

    def stop(self) -> None:
        self.stopping()
        self._stop.set()
        self._first_beat.set()
        if self._thread is not None:
            self._thread.join(5)
        self.notifier.close()

    def _safe_status(self) -> str:
        try:
            return self.status()
        except Exception as exc:  # a status line is never worth a crash
            return f"status unavailable: {exc}"

    def _run(self) -> None:
        self._first_beat.wait()
        if self._stop.is_set():
            return
        self.notifier.notify(f"READY=1\nSTATUS={self._safe_status()}")
        tick_s = self.status_interval_s if self.watchdog_s is None else min(self.status_interval_s, self.watchdog_s / 3)
        last_status_at = time.monotonic()
        while not self._stop.wait(tick_s):
            now = time.monotonic()
            last = self._last_beat
            stale_s = 0.0 if last is None else now - last
            if self.watchdog_s is not None and stale_s <= self.stale_after_s and self.notifier.notify("WATCHDOG=1"):
                self.watchdog_pings_total += 1
            if now - last_status_at >= self.status_interval_s:
                last_status_at = now
                if stale_s > self.stale_after_s:
                    # systemctl status shows this until the watchdog restarts us.
                    self.notifier.notify(f"STATUS=guard loop stalled for {stale_s:.0f} s")
                else:
                    self.notifier.notify(f"STATUS={self._safe_status()}")


# --- the journal


def _field_name(key: str) -> str:
    name = "".join(c if c.isalnum() else "_" for c in key.upper()).strip("_")
    return ("SPARKWATCH_" + name)[:64]


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def journal_fields(event: Event, identifier: str = "sparkwatch") -> list[tuple[str, str]]:
    """An event as journal fields: MESSAGE, PRIORITY, SPARKWATCH_EVENT=<kind>, and every event field flattened.

    A list of records (a kill's victims) becomes one space-separated field per key (SPARKWATCH_VICTIM_PIDS=1 2 3)
    for reading, plus the same key repeated once per record (SPARKWATCH_VICTIM_PID=1, =2, =3), which the journal
    allows and `journalctl SPARKWATCH_VICTIM_PID=2` matches. Absent values (None) are left out.
    """
    out: list[tuple[str, str]] = [
        ("MESSAGE", event.summary),
        ("PRIORITY", str(EVENT_PRIORITY.get(event.kind, PRIORITY_NOTICE))),
        ("SYSLOG_IDENTIFIER", identifier),
        ("SPARKWATCH_EVENT", event.kind),
        ("SPARKWATCH_EVENT_ID", event.id),
        ("SPARKWATCH_TS", event.ts),
    ]
    for key, value in event.fields.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            records = [v for v in value if isinstance(v, Mapping)]
            if records:
                singular = key[:-1] if key.endswith("s") else key
                subkeys = list(dict.fromkeys(k for r in records for k in r))
                for sub in subkeys:
                    values = [_scalar(r.get(sub)) for r in records if r.get(sub) is not None]
                    plural = sub if sub.endswith("s") else sub + "s"
                    out.append((_field_name(f"{singular}_{plural}"), " ".join(values)))
                for record in records:
                    for sub in subkeys:
                        if record.get(sub) is not None:
                            out.append((_field_name(f"{singular}_{sub}"), _scalar(record[sub])))
            else:
                out.append((_field_name(key), " ".join(_scalar(v) for v in value)))
        elif isinstance(value, Mapping):
            for sub, item in value.items():
                if item is not None:
                    out.append((_field_name(f"{key}_{sub}"), _scalar(item)))
        else:
            out.append((_field_name(key), _scalar(value)))
    return out


def encode_native(fields: Iterable[tuple[str, str]]) -> bytes:
    """journald's native protocol: `NAME=value\\n`, or for a value with a newline `NAME\\n<le64 length>value\\n`."""
    out = bytearray()
    for name, value in fields:
        data = value.encode("utf-8", errors="replace")
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


def decode_native(datagram: bytes) -> list[tuple[str, str]]:
    """The inverse of encode_native (for tests and for reading what libsystemd sent)."""
    fields: list[tuple[str, str]] = []
    pos = 0
    while pos < len(datagram):
        nl = datagram.index(b"\n", pos)
        line = datagram[pos:nl]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            fields.append((name.decode(), value.decode("utf-8", errors="replace")))
            pos = nl + 1
        else:
            (size,) = struct.unpack("<Q", datagram[nl + 1 : nl + 9])
            value = datagram[nl + 9 : nl + 9 + size]
            fields.append((line.decode(), value.decode("utf-8", errors="replace")))
            pos = nl + 9 + size + 1
    return fields


def stderr_is_journal(env: Mapping[str, str], stream: TextIO) -> bool:
    """$JOURNAL_STREAM is `device:inode` of the journal's stream socket; it is ours only if stderr is that socket."""
    value = env.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


class JournalSink:
    """An EventLog listener writing each event to the journal with structured fields.

    backend: 'auto' picks systemd-python if importable, else the native protocol if the journal socket exists,
    else stderr; 'builtin' is 'auto' without systemd-python (the guard process: libsystemd and its Python modules
    cost 1.0 MiB of its mlocked RSS for two datagrams it speaks itself); or name one of 'systemd-python', 'native',
    'stderr'. A failed send falls back to a stderr line, so an event is never lost from the service's log.
    """

    def __init__(
        self,
        backend: str = "auto",
        socket_path: Path = JOURNAL_SOCKET,
        stream: TextIO | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.stream = stream
        self.env = dict(os.environ if env is None else env)
        self.send_errors_total = 0
        self.last_error: str | None = None
        self._journal = None
        lib = _systemd_python() if backend in ("auto", "systemd-python") else None
        if backend == "builtin":
            backend = "auto"
        if backend == "systemd-python" and lib is None:
            raise RuntimeError("systemd-python is not installed")
        if lib is not None:
            self._journal = lib[1]
            self.backend = "systemd-python"
        elif backend == "auto":
            self.backend = "native" if socket_path.exists() else "stderr"
        elif backend in ("native", "stderr"):
            self.backend = backend
        else:
            raise ValueError(f"unknown journal backend {backend!r}")

    def __call__(self, event: Event) -> None:
        fields = journal_fields(event)
        if self.backend == "stderr":
            self._stderr(event)
            return
        try:
            if self._journal is not None:
                self._journal.sendv(*(f"{k}={v}" for k, v in fields))
            else:
                self._send_native(encode_native(fields))
        except (OSError, ValueError) as exc:
            self.send_errors_total += 1
            self.last_error = str(exc)
            self._stderr(event)

    def _send_native(self, payload: bytes) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)  # on the reaper thread; the event is already on disk, so give up rather than wait
            try:
                sock.sendto(payload, str(self.socket_path))
            except OSError as exc:
                if exc.errno != errno.EMSGSIZE:
                    raise
                # Over a datagram's limit (a kill of hundreds of processes): the journal's native protocol then
                # takes the entry as a sealed memfd passed alongside an empty datagram, as sd_journal_sendv does.
                fd = os.memfd_create("sparkwatch-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                try:
                    os.write(fd, payload)
                    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))]
                    sock.sendmsg([], ancillary, 0, str(self.socket_path))
                finally:
                    os.close(fd)

    def _stderr(self, event: Event) -> None:
        stream = self.stream or sys.stderr
        prefix = f"<{EVENT_PRIORITY.get(event.kind, PRIORITY_NOTICE)}>" if stderr_is_journal(self.env, stream) else ""
        try:
            print(f"{prefix}sparkwatch: event {event.kind}: {event.summary}", file=stream, flush=True)
        except (OSError, ValueError):
            pass
