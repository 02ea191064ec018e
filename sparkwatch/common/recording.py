"""The one way a process wires its record: events.jsonl, the journal after each fsync, and the alerts routed to a
spool (the guard's FileSpool, telemetry's Outbox) before each write. Both processes call `open_recording`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.eventlog import EventLog
from sparkwatch.common.spool import AlertRouter, Spooler
from sparkwatch.common.systemd import JournalSink


@dataclass
class Recording:
    events: EventLog
    journal: JournalSink
    router: AlertRouter | None  # None without a webhook
    log_handler: logging.Handler | None = None

    def counters(self) -> dict[str, int]:
        """The record's own error counters, exported as the `events` component's."""
        return {
            "event_write_errors": self.events.write_errors_total,
            "journal_send_errors": self.journal.send_errors_total,
            "log_send_errors": logs.send_errors_total(self.log_handler),
        }


def open_recording(
    events_path: Path,
    max_bytes: int,
    spooler: Spooler | None,
    log_handler: logging.Handler | None = None,
    group: int | None = None,
    *,
    journal_backend: str = "auto",
) -> Recording:
    """`group`: events_group's gid (common/sharing.py), whose members may read the record. `journal_backend`: as
    JournalSink's (the guard process passes 'builtin')."""
    events = EventLog(events_path, max_bytes=max_bytes, group=group)
    journal = JournalSink(journal_backend)
    events.subscribe(journal)
    router = None
    if spooler is not None:
        router = AlertRouter(spooler)
        events.subscribe(router)
    return Recording(events, journal, router, log_handler)
