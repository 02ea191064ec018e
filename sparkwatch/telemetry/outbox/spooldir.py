"""The outbox's spool directory, <state_dir>/outbox/: the alerts on disk, and which of them may be trusted.

Each alert is one file `<event id>.json` (durable write: common/durable.py), first as `.pending-<event id>.json`
before its event is written, renamed once the event is durable; it is removed only after the receiver answered 2xx
(or when the cap drops it). The names and the prepare-then-commit protocol are common/spool.py's, which the guard
process writes too; this module adds what only the telemetry process does with the directory:

- load, on start: every file left is queued again; a torn temporary write is removed; a `.pending-` file whose event
  is missing from events.jsonl gets its event appended from the spooled copy, then it is promoted. So a crash between
  the two writes loses neither the record nor the alert, and no alert goes out for an event the log does not hold.
- quarantine: a file that is not ours (a name that is not an event id, JSON that does not parse, too large, written
  by another user) is moved to `outbox/bad/` under a safe name, never parsed again, never fatal.
- remove, after delivery or a drop at the cap.

No HTTP, no threads, no counters: what goes wrong is handed to the outbox (`on_error`, `on_quarantined`), which
counts, logs and alerts it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from sparkwatch.common.durable import append_durable, open_regular, private_dir, read_regular
from sparkwatch.common.spool import BAD, TMP, Prepared, commit_file, parse_name, prepare_file, prepared_file

EVENTS_SCAN_BYTES = 4 << 20  # how much of events.jsonl's end start-up recovery searches for a prepared alert's id
SPOOL_FILE_MAX_BYTES = 1 << 20  # an alert is ~1-2 KiB of JSON; a bigger spool file is not ours


class SpoolDir:
    def __init__(
        self,
        path: Path,
        events_path: Path,
        events_group: int | None,
        *,
        log: Callable[[int, str], None],
        on_error: Callable[[str], None],
        on_quarantined: Callable[[str, str], None],
    ) -> None:
        """`on_error(message)`: a spool error (the alert lives on in memory); `on_quarantined(name, why)`: a file was
        moved to bad/."""
        self.path = path
        self.bad_dir = path / BAD
        self.events_path = events_path
        self.events_group = events_group  # the state dir's group (events_group), as the event log keeps it
        self._log = log
        self._on_error = on_error
        self._on_quarantined = on_quarantined

    def load(self) -> list[Prepared]:
        """The alerts left from before, promoted and ready to send (each `final` is its file); the rest tidied."""
        try:
            private_dir(self.path.parent, self.events_group)  # the state dir: 0700 (0750 with events_group)
            private_dir(self.path)
            names = sorted(os.listdir(self.path))
        except OSError as exc:
            self._on_error(f"outbox {self.path} unusable: {exc.strerror or exc}")
            return []
        loaded: list[Prepared] = []
        logged_ids: set[str] | None = None
        for name in names:
            if name == self.bad_dir.name:
                continue
            path = self.path / name
            if name.startswith(TMP):
                try:
                    path.unlink()  # torn write of a crash before its rename: never acknowledged to anyone
                except OSError:
                    pass
                continue
            parsed = parse_name(name)
            if parsed is None:
                self._quarantine(path, "a name that is not an event id")
                continue
            event_id, pending = parsed
            try:
                # Only a file this daemon's user wrote: one another user planted is never sent, signed, as ours.
                body = read_regular(path, SPOOL_FILE_MAX_BYTES + 1, owned=True)
                if len(body) > SPOOL_FILE_MAX_BYTES:
                    raise ValueError(f"larger than {SPOOL_FILE_MAX_BYTES} bytes")
                data = json.loads(body)
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
            except FileNotFoundError:
                continue
            except (OSError, ValueError, RecursionError) as exc:
                self._quarantine(path, f"unreadable: {type(exc).__name__}: {exc}")
                continue
            prepared = prepared_file(self.path, event_id, body)
            if pending:
                if logged_ids is None:
                    logged_ids = self._logged_event_ids()
                try:
                    if event_id not in logged_ids:
                        self._restore_event(data)
                    commit_file(prepared)
                except (OSError, ValueError) as exc:
                    self._on_error(f"outbox: could not recover prepared alert {event_id}: {exc}")
                    continue
            loaded.append(prepared)
        return loaded

    def prepare(self, payload: Mapping[str, object]) -> Prepared:
        """Spool one alert as pending (common/spool.py); a failure is reported, and the alert lives in memory."""
        prepared = prepare_file(self.path, payload)
        if prepared.error is not None:
            self._on_error(f"outbox: {prepared.error}; keeping it in memory only")
        return prepared

    def commit(self, prepared: Prepared) -> Path | None:
        """Promote a prepared alert; its file now (the pending one if the rename failed), None if it has none."""
        if prepared.error is not None:
            return None
        try:
            return commit_file(prepared)
        except OSError as exc:
            self._on_error(f"outbox: could not commit alert {prepared.event_id}: {exc.strerror or exc}")
            return prepared.pending if prepared.pending.exists() else None

    def delivered(self, event_id: str, path: Path | None) -> None:
        """Remove a delivered alert's file. One left behind would be sent again after a restart: reported."""
        if path is None:
            return
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._on_error(f"outbox: delivered {event_id} but could not remove its file: {exc}")

    def drop(self, paths: Iterable[Path | None]) -> None:
        """Remove the files of alerts dropped at the cap, as far as it goes (the outbox counts the drop)."""
        for path in paths:
            if path is not None:
                try:
                    path.unlink()
                except OSError:
                    pass

    def _logged_event_ids(self) -> set[str]:
        """Ids in events.jsonl (its last EVENTS_SCAN_BYTES): which prepared alerts already have their event."""
        try:
            fd = open_regular(self.events_path, owned=True)
        except OSError:
            return set()
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, EVENTS_SCAN_BYTES, max(0, size - EVENTS_SCAN_BYTES))
        finally:
            os.close(fd)
        return {m.decode() for m in re.findall(rb'"id":"([A-Za-z0-9_-]{1,128})"', data)}

    def _restore_event(self, payload: dict[str, object]) -> None:
        """Append the event a prepared alert was spooled for (the crash came before its write)."""
        event = {k: v for k, v in payload.items() if k != "text"}
        line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
        append_durable(self.events_path, line)
        self._log(
            logging.WARNING, f"outbox: restored event {event.get('id')} to {self.events_path.name} (crash recovery)"
        )

    def _quarantine(self, path: Path, why: str) -> None:
        """Move a spool file we cannot trust to outbox/bad/ under a safe name: never parsed again, never fatal."""
        import hashlib  # noqa: PLC0415 - libcrypto, for a bad file only (common.spool.spool_id says why)

        safe = hashlib.sha256(os.fsencode(path.name)).hexdigest()[:32]
        try:
            private_dir(self.bad_dir)
            os.rename(path, self.bad_dir / f"{int(time.time())}-{safe}")
        except OSError as exc:
            try:
                path.unlink()
            except OSError:
                self._on_error(f"outbox: could not quarantine or remove a spool file: {exc.strerror or exc}")
                return
        self._on_quarantined(path.name, why)
