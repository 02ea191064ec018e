"""The verdict on the previous boot, once per boot, at start: a `previous_boot` event, an alert unless it ended
cleanly, and the class as a metric.

It runs in the telemetry process, on a thread of its own that ends when the verdict is out: journalctl is a
subprocess that can take seconds on a big journal, and the guard must be polling within milliseconds of its start.
It reads the previous boot's journal, pstore, the flight recorder and events.jsonl (telemetry.sources.prevboot),
judges them (core.postmortem.verdict) and appends the event, durably, before the outbox sends it (common.eventlog). Then
it writes `<state_dir>/postmortem.json` with the running boot's id, so a daemon restarted within the same boot (or a
telemetry process restarted by the guard) says nothing again and exports the class it found. A telemetry process
that died between the event and that file finds the event in events.jsonl and does not judge twice.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sparkwatch.common import logs
from sparkwatch.common.durable import StateFileError, private_dir, read_regular, write_atomic
from sparkwatch.common.eventlog import EventLog, EventLogError, make_event, read_events
from sparkwatch.common.sources.boot import read_boot_id, read_boot_time
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.postmortem.verdict import BootEnd, Verdict, describe, judge, verdict_fields
from sparkwatch.telemetry.sources.prevboot import gather

log = logs.get("postmortem")
STATE_NAME = "postmortem.json"
SUMMARY_MAX_CHARS = 600
EVENTS_LOOKED_AT = 200  # events.jsonl's last events searched for a verdict already given in this boot


class PostmortemSettings(Protocol):
    @property
    def postmortem(self) -> bool: ...
    @property
    def postmortem_journal_dir(self) -> Path | None: ...
    @property
    def state_dir(self) -> Path: ...
    @property
    def proc_root(self) -> Path: ...
    @property
    def root(self) -> Path: ...


@dataclass(frozen=True, slots=True)
class Judged:
    """What the exporter shows: the class, and when the previous boot ended (unix seconds)."""

    boot_class: BootEnd
    ended_at: float
    judged_boot_id: str | None


def judged_from(data: object) -> Judged | None:
    if not isinstance(data, dict):
        return None
    try:
        klass = BootEnd(str(data.get("class")))
    except ValueError:
        return None
    ended = data.get("ended_at")
    judged = data.get("boot_id")
    return Judged(
        klass,
        float(ended) if isinstance(ended, (int, float)) else 0.0,
        judged if isinstance(judged, str) else None,
    )


class PostmortemWatch:
    def __init__(self, settings: PostmortemSettings, events: EventLog) -> None:
        self.settings = settings
        self.events = events
        self.state_path = settings.state_dir / STATE_NAME
        self.result: Judged | None = None
        self.verdict: Verdict | None = None  # when this process judged (not when it found the verdict on disk)
        self.errors_total = 0
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the lifecycle of a component
    def start(self) -> None:
        if not self.settings.postmortem:
            self.done.set()
            return
        self._thread = daemon_thread(self._run, "sparkwatch-postmortem")
        self._thread.start()

    def stop(self) -> None:
        pass  # a daemon thread that ends by itself; a journalctl still running is bounded by its own timeout

    def counters(self) -> dict[str, int]:
        return {"errors": self.errors_total}

    def _run(self) -> None:
        try:
            self.result = self.judge_once()
        except Exception as exc:  # never a reason for telemetry to stop: say it, count it
            self.errors_total += 1
            log.error("ERROR postmortem of the previous boot failed: %r", exc)
        finally:
            self.done.set()

    # --- once per boot
    def _mark(self) -> dict[str, object]:
        try:
            data = json.loads(read_regular(self.state_path, 1 << 20))
        except FileNotFoundError:
            return {}
        except (OSError, StateFileError, ValueError) as exc:
            log.warning("postmortem: %s unreadable (%s); judging the previous boot again", self.state_path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def _already_said(self, key: str) -> dict[str, object] | None:
        """A previous_boot event this boot already wrote (a telemetry process that died before its mark)."""
        try:
            recent = read_events(self.settings.state_dir / "events.jsonl", EVENTS_LOOKED_AT)
        except (OSError, StateFileError):
            return None
        for event in reversed(recent):
            if event.get("kind") == EventKind.PREVIOUS_BOOT and event.get("current_boot_id") == key:
                return dict(event)
        return None

    def _write_mark(self, key: str, fields: dict[str, object]) -> None:
        data = {"current_boot_id": key, **{k: fields.get(k) for k in ("class", "boot_id", "ended_at", "event_id")}}
        try:
            private_dir(self.state_path.parent)
            write_atomic(self.state_path, (json.dumps(data) + "\n").encode())
        except OSError as exc:
            self.errors_total += 1
            log.error("ERROR postmortem: could not write %s: %s", self.state_path, exc.strerror or exc)

    def judge_once(self) -> Judged | None:
        s = self.settings
        running = read_boot_id(s.proc_root)
        mark = self._mark()
        if running is not None and mark.get("current_boot_id") == running:
            return judged_from(mark)
        if running is not None:
            said = self._already_said(running)
            if said is not None:
                ended = said.get("ended_at") or read_boot_time(s.proc_root) or time.time()
                self._write_mark(running, {**said, "ended_at": ended, "event_id": said.get("id")})
                return judged_from({**said, "ended_at": ended})
        boot_started = read_boot_time(s.proc_root)
        t0 = time.monotonic()
        gathered = gather(
            state_dir=s.state_dir,
            root=s.root,
            running_boot_id=running,
            boot_started_at=boot_started,
            journal_dir=s.postmortem_journal_dir,
        )
        verdict = judge(gathered.boot)
        # Without this boot's id (a fixture /proc) the judged boot stands for it: each previous boot is judged once.
        key = running or f"judged:{verdict.boot_id}"
        if running is None and mark.get("current_boot_id") == key:
            return judged_from(mark)
        fields = {"current_boot_id": key, **verdict_fields(verdict)}
        summary = describe(verdict)
        if len(summary) > SUMMARY_MAX_CHARS:
            summary = summary[: SUMMARY_MAX_CHARS - 1] + "…"
        event = make_event(EventKind.PREVIOUS_BOOT, summary, fields)
        line = f"sparkwatch: {summary} (judged in {time.monotonic() - t0:.1f} s; `sparkwatch postmortem` for more)"
        if verdict.boot_class in (BootEnd.CLEAN, BootEnd.UNKNOWN):
            log.info(line)
        else:
            log.warning(line)
        try:
            self.events.append(event)  # durable, then the outbox (an alert unless the end was clean)
        except EventLogError as exc:
            self.errors_total += 1
            log.error("ERROR could not record the previous_boot event: %s", exc)
        self.verdict = verdict
        # The metric's value: when that boot ended; at the latest when this one started, where nothing says more.
        ended = verdict.ended_at or boot_started or time.time()
        self._write_mark(key, {**fields, "ended_at": ended, "event_id": event.id})
        return Judged(verdict.boot_class, ended, verdict.boot_id)
