"""The durable record: append-only JSONL at <state_dir>/events.jsonl, fsynced before anything is sent onwards."""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparkwatch.core.eventkinds import EventKind
from sparkwatch.model import Event


class EventLogError(OSError):
    """The event could not be made durable (unwritable or full state dir). The guard logs it and keeps running."""


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_event_id(ts: float | None = None) -> str:
    """Sortable by time, unique across restarts and nodes: 13 hex digits of ms since the epoch + 12 random."""
    ms = int((time.time() if ts is None else ts) * 1000)
    return f"{ms:013x}{secrets.token_hex(6)}"


def make_event(
    kind: EventKind,
    summary: str,
    fields: Mapping[str, object] | None = None,
    ts: float | None = None,
    node: str | None = None,
) -> Event:
    now = time.time() if ts is None else ts
    return Event(
        id=new_event_id(now),
        ts=rfc3339(now),
        kind=kind,
        node=node or socket.gethostname(),
        summary=summary,
        fields=dict(fields or {}),
    )


class EventLog:
    """Appends events durably and keeps the last few in memory for the exporter and `status`.

    Thread-safe. Listeners (the alert outbox, the journal) are called after the fsync, so an alert never exists
    for an event the disk could have had and lost. When the disk refuses the event (full, read-only, unwritable state
    dir) the listeners still get it: a kill that pages a human from memory beats a kill nobody hears of.
    """

    def __init__(self, path: Path, keep: int = 64) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._recent: deque[Event] = deque(maxlen=keep)
        self._listeners: list[Callable[[Event], None]] = []
        self.write_errors_total = 0
        self.last_error: str | None = None

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    @property
    def recent(self) -> tuple[Event, ...]:
        with self._lock:
            return tuple(self._recent)

    def append(self, event: Event) -> None:
        """Write and fsync one event, then tell listeners. Raises EventLogError (after telling the listeners) if the
        event could not be made durable."""
        line = (json.dumps(event.to_json_dict(), separators=(",", ":"), default=str) + "\n").encode()
        failure: EventLogError | None = None
        with self._lock:
            self._recent.append(event)
            try:
                self._write(line)
            except OSError as exc:
                self.write_errors_total += 1
                self.last_error = f"{self.path}: {exc.strerror or exc}"
                failure = EventLogError(exc.errno or 0, self.last_error)
        for listener in self._listeners:
            listener(event)
        if failure is not None:
            raise failure

    def _write(self, line: bytes) -> None:
        created = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(line)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:  # make the new directory entry durable too
            dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)


def read_events(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The last `limit` events (all if None), oldest first. Torn or foreign lines are skipped, never fatal."""
    try:
        with path.open("rb") as fh:
            if limit is not None:
                lines = _tail_lines(fh, 2 * limit + 8)  # spare lines for torn or foreign ones
            else:
                lines = fh.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for raw in lines:
        try:
            item = json.loads(raw)
        except ValueError:
            continue
        if isinstance(item, dict) and "kind" in item:
            out.append(item)
    return out[-limit:] if limit is not None else out


def _tail_lines(fh: Any, limit: int, block: int = 65536) -> list[bytes]:
    fh.seek(0, os.SEEK_END)
    end = fh.tell()
    data = b""
    pos = end
    while pos > 0 and data.count(b"\n") <= limit:
        step = min(block, pos)
        pos -= step
        fh.seek(pos)
        data = fh.read(step) + data
    lines: list[bytes] = data.splitlines()
    if pos > 0 and lines:
        lines = lines[1:]  # first line may be cut
    return lines[-limit:] if limit else []
