"""The durable record: append-only JSONL at <state_dir>/events.jsonl, fsynced before anything is sent onwards."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from sparkwatch.common.durable import append_durable, fsync_dir, open_regular, private_dir
from sparkwatch.common.sharing import share_events_file
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import Event
from sparkwatch.core.redact import redact, redact_value
from sparkwatch.core.timestamps import rfc3339


class EventLogError(OSError):
    """The event could not be made durable (unwritable or full state dir). The guard logs it and keeps running."""


def new_event_id(ts: float | None = None) -> str:
    """Sortable by time, unique across restarts and nodes: 13 hex digits of ms since the epoch + 12 random."""
    ms = int((time.time() if ts is None else ts) * 1000)
    return f"{ms:013x}{os.urandom(6).hex()}"  # os.urandom, as secrets does, without its hmac/OpenSSL imports


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


class Stage(Protocol):
    """A listener that must persist something of its own with the event (the alert outbox's spool file).

    `prepare(event)` runs before the event is written and returns what to do once it is durable (or None). A crash
    between the two writes leaves a prepared spool entry that the outbox reconciles with events.jsonl on start.
    """

    def prepare(self, event: Event) -> Callable[[], None] | None: ...


EVENTS_MAX_BYTES = 16 << 20  # events.jsonl rotates to events.jsonl.1 past this: ~40,000 kill records
EVENTS_READ_MAX_BYTES = 64 << 20  # the most `events` (without -n) reads of one file


class EventLog:
    """Appends events durably and keeps the last few in memory for the exporter and `status`.

    Thread-safe. Stages (the alert outbox) prepare before the write and commit after it; listeners (the journal)
    are called after the fsync, so an alert never exists for an event the disk could have had and lost. When the disk
    refuses the event (full, read-only, unwritable state dir, a symlink planted as events.jsonl) the listeners still
    get it: a kill that pages a human from memory beats a kill nobody hears of.

    The file rotates to `events.jsonl.1` (one generation kept) once it passes `max_bytes`; `rotations_total` counts.
    """

    def __init__(self, path: Path, keep: int = 64, max_bytes: int = EVENTS_MAX_BYTES, group: int | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.group = group  # events_group's gid: the state dir 0750 and the file 0640 with it (common/sharing.py)
        self._file_ready = False
        self._lock = threading.Lock()
        self._recent: deque[Event] = deque(maxlen=keep)
        self._listeners: list[Callable[[Event], None]] = []
        self._stages: list[Stage] = []
        self._dir_ready = False
        self.write_errors_total = 0
        self.rotations_total = 0
        self.last_error: str | None = None

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Call `listener` after each event is durable. A listener with `prepare` (a Stage) prepares before too."""
        if hasattr(listener, "prepare"):
            self._stages.append(listener)
            attach = getattr(listener, "attach", None)
            if attach is not None:
                attach(self)
        else:
            self._listeners.append(listener)

    @property
    def recent(self) -> tuple[Event, ...]:
        with self._lock:
            return tuple(self._recent)

    def append(self, event: Event) -> None:
        """Write and fsync one event, then tell listeners. Raises EventLogError (after telling the listeners) if the
        event could not be made durable. Every string in it is redacted first: this is where events leave."""
        event = redacted(event)
        commits = []
        for stage in self._stages:
            try:
                commit = stage.prepare(event)
            except Exception:  # a stage never stops the record; it counts its own errors
                commit = None
            if commit is not None:
                commits.append(commit)
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
        for commit in commits:
            try:
                commit()
            except Exception:
                pass
        for listener in self._listeners:
            listener(event)
        if failure is not None:
            raise failure

    def _write(self, line: bytes) -> None:
        if not self._dir_ready:
            private_dir(self.path.parent, self.group)
            self._dir_ready = True
        size = append_durable(self.path, line)
        if not self._file_ready:  # once per file: the first write of this process, and after each rotation
            share_events_file(self.path, self.group)
            self._file_ready = True
        if size > self.max_bytes:
            os.replace(self.path, rotated_path(self.path))
            fsync_dir(self.path.parent)
            self.rotations_total += 1
            self._file_ready = False


def redacted(event: Event) -> Event:
    """The event with `redact` applied to its summary and every string in its fields."""
    fields = redact_value(dict(event.fields))
    return replace(event, summary=redact(event.summary), fields=fields)


def rotated_path(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def _parse_lines(lines: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for raw in lines:
        try:
            item = json.loads(raw)
        except (ValueError, RecursionError):  # torn, foreign, or nested beyond reason: skipped, never fatal
            continue
        if isinstance(item, dict) and isinstance(item.get("kind"), str):
            out.append(item)
    return out


def read_events(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The last `limit` events (all if None), oldest first, across events.jsonl and its rotated generation.

    Torn or foreign lines are skipped. Raises StateFileError (one line) when the file is a symlink, a FIFO or a
    directory: a reader never follows, blocks on or crashes over what someone planted there.
    """
    if limit is not None and limit <= 0:
        return []
    out: list[dict[str, Any]] = []
    for candidate in (path, rotated_path(path)):
        want = None if limit is None else limit - len(out)
        if want is not None and want <= 0:
            break
        try:
            fd = open_regular(candidate)
        except FileNotFoundError:
            continue
        try:
            if want is not None:
                lines = _tail_lines(fd, 2 * want + 8)  # spare lines for torn or foreign ones
            else:
                lines = _head_lines(fd)
        finally:
            os.close(fd)
        events = _parse_lines(lines)
        if want is not None:
            events = events[-want:]
        out = events + out
    return out


def _head_lines(fd: int) -> list[bytes]:
    chunks = []
    size = 0
    while size < EVENTS_READ_MAX_BYTES:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks).splitlines()


def _tail_lines(fd: int, limit: int, block: int = 65536) -> list[bytes]:
    """The last `limit` lines, reading blocks backwards from the end: linear in what is read, not in the file."""
    end = os.fstat(fd).st_size
    blocks: list[bytes] = []
    newlines = 0
    pos = end
    while pos > 0 and newlines <= limit:
        step = min(block, pos)
        pos -= step
        chunk = os.pread(fd, step, pos)
        if len(chunk) < step:  # the file shrank under us (rotated): use what we have
            break
        blocks.append(chunk)
        newlines += chunk.count(b"\n")
    lines = b"".join(reversed(blocks)).splitlines()
    if pos > 0 and lines:
        lines = lines[1:]  # the first line may be cut
    return lines[-limit:]
