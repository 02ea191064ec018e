"""The alert spool on disk: the one protocol both processes write, and the routing rule that decides what is spooled.

An alerting event is spooled as `<state_dir>/outbox/.pending-<id>.json` before its event is written to events.jsonl,
and renamed to `<id>.json` once the event is durable. A crash between the two leaves a `.pending-` file, which the
outbox's spool dir (telemetry/outbox/spooldir.py, in the telemetry process) reconciles with events.jsonl when it
starts: the event is restored if it never reached the log, and the alert is delivered either way. The names are
spelled here only (`prepared_file`, `parse_name`).

The guard process spools its own events (kills, kernel-log alerts) here with `FileSpool` before it hands them to
telemetry, so a guard that dies between writing a kill and handing it over loses no alert. This module imports no
HTTP or TLS: the guard process stays small. Spooling the same event twice (the guard, then telemetry's outbox when the
event arrives over the channel) writes the same bytes to the same name: idempotent.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sparkwatch.common.durable import fsync_dir, private_dir, write_atomic
from sparkwatch.core.model import Event
from sparkwatch.core.report.alerts import RateState, alert_text, dedup_key, is_alerting, is_quiet, rate_limit

SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # always fullmatch: `$` also matches before a trailing newline
PENDING = ".pending-"  # spooled before its event was written; promoted once the event is durable
SUFFIX = ".json"
TMP = ".tmp-"  # durable.write_atomic's temporary name: a torn write
BAD = "bad"  # outbox/bad/: spool files the outbox would not trust, moved aside


def alert_payload(event: Event) -> dict[str, object]:
    """The event JSON plus `text`, so Slack-compatible receivers show it as is."""
    data = event.to_json_dict()
    data["text"] = alert_text(event.kind, event.node, event.summary)
    return data


def spool_id(raw_id: str) -> str:
    """The file name stem for an event id: the id itself, or a hash of anything that is not a safe name."""
    if SAFE_ID.fullmatch(raw_id):
        return raw_id  # every id sparkwatch makes (common.eventlog.new_event_id)
    # Only a foreign id gets here. hashlib loads OpenSSL's libcrypto (3.3 MiB of the guard's locked RSS, measured):
    # imported when needed, never at the guard's start.
    import hashlib  # noqa: PLC0415

    return hashlib.sha256(raw_id.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Prepared:
    event_id: str
    body: bytes
    pending: Path
    final: Path
    error: str | None  # why the pending file could not be written (the alert then lives in memory only)


def parse_name(name: str) -> tuple[str, bool] | None:
    """A spool file name's event id and whether it is still pending (`.pending-<id>.json`, `<id>.json`); None for a
    name this protocol never writes."""
    pending = name.startswith(PENDING)
    final = name[len(PENDING) :] if pending else name
    if not final.endswith(SUFFIX) or SAFE_ID.fullmatch(final[: -len(SUFFIX)]) is None:
        return None
    return final[: -len(SUFFIX)], pending


def prepared_file(spool_dir: Path, event_id: str, body: bytes) -> Prepared:
    """One alert's pending and final paths under `spool_dir`: the one place they are spelled."""
    pending, final = spool_dir / f"{PENDING}{event_id}{SUFFIX}", spool_dir / f"{event_id}{SUFFIX}"
    return Prepared(event_id, body, pending, final, None)


def prepare_file(spool_dir: Path, payload: Mapping[str, object]) -> Prepared:
    """Write `.pending-<id>.json` (fsynced, under a 0700 dir). Never raises: a failure is in `error`."""
    event_id = spool_id(str(payload.get("id") or ""))
    prepared = prepared_file(spool_dir, event_id, json.dumps(payload, separators=(",", ":"), default=str).encode())
    try:
        private_dir(spool_dir)
        write_atomic(prepared.pending, prepared.body)
    except OSError as exc:
        error = f"could not spool alert {event_id} under {spool_dir}: {exc.strerror or exc}" + (
            " (disk full)" if exc.errno == errno.ENOSPC else ""
        )
        return dataclasses.replace(prepared, error=error)
    return prepared


def commit_file(prepared: Prepared) -> Path:
    """Promote a prepared alert to `<id>.json` and make the rename durable. Raises OSError."""
    os.rename(prepared.pending, prepared.final)
    fsync_dir(prepared.final.parent)
    return prepared.final


class Spooler(Protocol):
    def prepare(self, payload: Mapping[str, object]) -> Callable[[], None]: ...
    def spool_error(self, message: str) -> None: ...


class FileSpool:
    """The guard process's spooler: files only. Telemetry's Outbox delivers what it finds (at start, or when the
    event arrives over the channel). Counts its errors for the exporter."""

    def __init__(self, spool_dir: Path) -> None:
        self.spool_dir = spool_dir
        self.spool_errors_total = 0
        self.last_error: str | None = None

    def spool_error(self, message: str) -> None:
        self.spool_errors_total += 1
        self.last_error = message

    def prepare(self, payload: Mapping[str, object]) -> Callable[[], None]:
        prepared = prepare_file(self.spool_dir, payload)
        if prepared.error is not None:
            self.spool_error(prepared.error)

        def commit() -> None:
            if prepared.error is None:
                try:
                    commit_file(prepared)
                except OSError as exc:
                    self.spool_error(f"could not commit alert {prepared.event_id}: {exc.strerror or exc}")

        return commit


class _Recorder(Protocol):
    def append(self, event: Event) -> None: ...


class AlertRouter:
    """The EventLog stage: picks the alerting events, rate-limits them, and spools them.

    EventLog calls `prepare` before it writes the event (a pending spool file) and the returned commit after the
    fsync (the file becomes deliverable); `attach` lets an outbox record its own drop/quarantine events.
    """

    def __init__(self, spooler: Spooler, clock: Callable[[], float] = time.monotonic) -> None:
        self.spooler = spooler
        self._clock = clock
        self._lock = threading.Lock()
        self._state = RateState()
        self.suppressed_total = 0
        self.errors_total = 0

    def attach(self, events: _Recorder) -> None:
        attach = getattr(self.spooler, "attach_recorder", None)
        if attach is not None:
            attach(events.append)

    def __call__(self, event: Event) -> None:
        """Route and spool at once (no event log in between)."""
        commit = self.prepare(event)
        if commit is not None:
            commit()

    def prepare(self, event: Event) -> Callable[[], None] | None:
        # Runs on whichever thread appends the event (the guard's reaper for a kill): it must never raise into it.
        try:
            return self._route(event)
        except Exception as exc:
            self.errors_total += 1
            self.spooler.spool_error(f"outbox: could not route {event.kind} event {event.id}: {exc}")
            return None

    def _route(self, event: Event) -> Callable[[], None] | None:
        if not is_alerting(event.kind) or is_quiet(event.kind, event.fields):
            return None
        key = dedup_key(event.kind, {"id": event.id, **event.fields})
        with self._lock:
            self._state, send = rate_limit(self._state, event.kind, key, self._clock())
            if not send:
                self.suppressed_total += 1
                return None
        return self.spooler.prepare(alert_payload(event))
