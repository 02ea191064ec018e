"""The outbox itself: the component that wires the spool dir, the retry queue and the transport, on one worker.

`Outbox` is what the rest of the daemon sees: the Spooler the event log's AlertRouter hands alerts to (`prepare`,
`submit`, `spool_error`), a lifecycle (`start`, `stop`), and the counters the exporter reads. It owns the one lock
over the queue, the supervised worker thread that takes the next due item and POSTs it, the counters, the log lines
(rate-limited per reason) and the notices: the outbox's own `outbox_dropped` and `outbox_quarantined` events, each
once per run, recorded by the worker outside every lock. The decisions are the parts': which files to trust
(spooldir.py), which item next and when (queue.py), what an answer means (transport.py).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.eventlog import make_event
from sparkwatch.common.lifecycle import Backoff, run_with_restarts
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import Event
from sparkwatch.core.redact import safe_text
from sparkwatch.telemetry.outbox.queue import Item, RetryQueue
from sparkwatch.telemetry.outbox.spooldir import SpoolDir
from sparkwatch.telemetry.outbox.transport import DeliveryError, Transport

OUTBOX_MAX_ALERTS = 1000  # spooled alerts kept; past this the oldest is dropped (counted, alerted once)
SUPERVISE_BACKOFF_S = (0.1, 30.0)  # the worker restarts after a crash, backing off to 30 s if it keeps crashing


class Outbox:
    """Durable, at-least-once webhook delivery on one supervised worker thread. Counters are plain attributes for
    the exporter: `pending`, `delivered_total`, `failed_attempts_total`, `spool_errors_total`, `dropped_total`,
    `quarantined_total`, `worker_restarts_total`, `last_error` (scrubbed), `last_delivery_timestamp_s`.

    The event id travels as `X-Sparkwatch-Event-Id`, so a receiver that saw a POST whose answer got lost can drop the
    duplicate: delivery is at least once, never at most once.
    """

    def __init__(
        self,
        spool_dir: Path,
        url: str,
        secret: str | None = None,
        *,
        timeout_s: float = 10.0,
        backoff_min_s: float = 1.0,
        backoff_max_s: float = 300.0,
        max_alerts: int = OUTBOX_MAX_ALERTS,
        events_path: Path | None = None,
        log: Callable[[int, str], None] | None = None,
        events_group: int | None = None,
    ) -> None:
        self._transport = Transport(url, secret, timeout_s)
        self.target = self._transport.target
        self._log = log or logs.get("outbox").log  # (level, line); tests pass their own
        self._spool = SpoolDir(
            spool_dir,
            events_path if events_path is not None else spool_dir.parent / "events.jsonl",
            events_group,
            log=self._log,
            on_error=self._spool_error,
            on_quarantined=self._quarantined,
        )
        self._queue = RetryQueue(backoff_min_s, backoff_max_s, max_alerts)
        self._lock = threading.Condition()  # over _queue and _notices
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_logged: dict[str, float] = {}
        self._record: Callable[[Event], None] | None = None  # EventLog.append, set by AlertRouter.attach
        self._notices: list[tuple[EventKind, str, dict[str, object]]] = []  # drop/quarantine events to record
        self._announced: set[EventKind] = set()
        # counters
        self.delivered_total = 0
        self.failed_attempts_total = 0
        self.spool_errors_total = 0
        self.dropped_total = 0
        self.quarantined_total = 0
        self.worker_restarts_total = 0
        self.last_error: str | None = None
        self.last_delivery_timestamp_s: float | None = None

    # --- counters
    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    # --- lifecycle
    def start(self) -> None:
        loaded = self._spool.load()
        with self._lock:
            for spooled in loaded:
                self._queue.add(Item(spooled.event_id, spooled.body, spooled.final))
        self._enforce_cap()
        if loaded:
            self._log(logging.INFO, f"outbox: {len(loaded)} undelivered alerts from before, sending to {self.target}")
        self._thread = daemon_thread(self._supervise, "sparkwatch-outbox")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(self._transport.timeout_s + 2)

    # --- producers
    def prepare(self, payload: Mapping[str, object]) -> Callable[[], None]:
        """Spool one alert as pending (before its event is written); the returned commit makes it deliverable."""
        prepared = self._spool.prepare(payload)

        def commit() -> None:
            path = self._spool.commit(prepared)
            with self._lock:
                self._queue.add(Item(prepared.event_id, prepared.body, path))
                self._lock.notify_all()
            self._enforce_cap()

        return commit

    def spool_error(self, message: str) -> None:
        """The Spooler interface (common.spool.AlertRouter reports routing errors here)."""
        self._spool_error(message)

    def attach_recorder(self, record: Callable[[Event], None]) -> None:
        """Where the outbox records its own drop/quarantine events (the EventLog it is a stage of)."""
        self._record = record

    def submit(self, payload: Mapping[str, object]) -> None:
        """Spool one alert durably (or keep it in memory if the disk refuses) and wake the worker. Never raises."""
        self.prepare(payload)()

    def deliver(self, event_id: str, body: bytes) -> None:
        """One POST (transport.py): returns on 2xx, raises DeliveryError otherwise. The worker's only way out."""
        self._transport.deliver(event_id, body)

    # --- what the spool dir and the queue report
    def _enforce_cap(self) -> None:
        """Drop the oldest alerts past `max_alerts` (event ids sort by time), each counted; the drop alerted once."""
        with self._lock:
            dropped = self._queue.over_cap()
            self.dropped_total += len(dropped)
        self._spool.drop(item.path for item in dropped)
        if dropped:
            max_alerts = self._queue.max_items
            self._log_limited(
                "drop",
                logging.WARNING,
                f"WARNING outbox full ({max_alerts} alerts): dropped {len(dropped)} oldest "
                f"({self.dropped_total} in all); is {self.target} down?",
            )
            self._notice(
                EventKind.OUTBOX_DROPPED,
                f"The alert outbox is full ({max_alerts} alerts) and dropped the oldest undelivered alerts",
                {"max_alerts": max_alerts},
            )

    def _quarantined(self, name: str, why: str) -> None:
        self.quarantined_total += 1
        self._log(logging.WARNING, f"WARNING outbox: quarantined spool file {safe_text(name)!r} ({why}) to bad/")
        self._notice(
            EventKind.OUTBOX_QUARANTINED,
            f"The alert outbox moved an unreadable spool file to {self._spool.bad_dir}",
            {"reason": why[:200]},
        )

    def _spool_error(self, message: str) -> None:
        self.spool_errors_total += 1
        self.last_error = self._transport.scrub(message)
        self._log_limited("spool", logging.ERROR, f"ERROR {self.last_error}")

    def _notice(self, kind: EventKind, summary: str, fields: dict[str, object]) -> None:
        """Queue one event of `kind` for the log (once per daemon run): recorded by the worker, outside every lock."""
        with self._lock:
            if kind in self._announced:
                return
            self._announced.add(kind)
            self._notices.append((kind, summary, fields))
            self._lock.notify_all()

    # --- the worker
    def _backoff_s(self, failures: int) -> float:
        """The queue's backoff after `failures` in a row (tests/test_outbox.py reads it through the outbox)."""
        return self._queue.backoff_s(failures)

    def _next(self) -> Item | None:
        """The queue's next due item, waiting until one is due, a notice is to be recorded, or we stop."""
        with self._lock:
            while not self._stop.is_set():
                if self._notices:
                    return None
                item, wait_s = self._queue.next_due(time.monotonic())
                if item is not None:
                    return item
                self._lock.wait(wait_s)
        return None

    def _supervise(self) -> None:
        """Run the worker; restart it after any exception (counted, logged), backing off while it keeps failing."""
        run_with_restarts(self._run_worker, self._stop, Backoff(*SUPERVISE_BACKOFF_S), self._worker_crashed)

    def _run_worker(self) -> str | None:
        self._run()
        return None  # returns only when stopping

    def _worker_crashed(self, why: str, _delay_s: float) -> None:
        self.worker_restarts_total += 1
        self.last_error = self._transport.scrub(f"worker crashed: {why}")
        self._log_limited(
            "crash:" + why.split(":", 1)[0], logging.ERROR, f"ERROR outbox {self.last_error}; restarting it"
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self._flush_notices()
            item = self._next()
            if item is None:
                if self._stop.is_set():
                    return
                continue
            try:
                self.deliver(item.event_id, item.body)
            except DeliveryError as exc:
                self._failed(item, exc)
            else:
                self._delivered(item)

    def _flush_notices(self) -> None:
        with self._lock:
            notices, self._notices = self._notices, []
        for kind, summary, fields in notices:
            if self._record is None:
                continue
            try:
                self._record(make_event(kind, summary, fields))
            except Exception as exc:  # the event log counts its own write errors
                self._log_limited("notice", logging.ERROR, f"ERROR outbox: could not record {kind}: {exc}")

    def _delivered(self, item: Item) -> None:
        self._spool.delivered(item.event_id, item.path)
        with self._lock:
            self._queue.delivered(item.event_id)
            self.delivered_total += 1
            self.last_delivery_timestamp_s = time.time()
        if self._last_logged.pop("deliver", None) is not None:
            self._log(logging.INFO, f"outbox: {self.target} reachable again, delivering")

    def _failed(self, item: Item, exc: DeliveryError) -> None:
        now = time.monotonic()
        with self._lock:
            self.failed_attempts_total += 1
            self.last_error = self._transport.scrub(str(exc))
            self._queue.failed(item, exc.transport, now)
            pending = len(self._queue)
        # Every distinct reason is logged (then at most every 5 min): a redirect, a 4xx and a timeout each show.
        self._log_limited(
            "deliver:" + re.sub(r"\d+", "N", self.last_error)[:80],
            logging.WARNING,
            f"WARNING alert delivery to {self.target} failed ({self.last_error}); "
            f"{pending} pending, retrying with backoff up to {self._queue.backoff_max_s:g} s",
        )
        self._last_logged.setdefault("deliver", now)

    # --- hygiene
    def _log_limited(self, key: str, level: int, line: str, every_s: float = 300.0) -> None:
        now = time.monotonic()
        last = self._last_logged.get(key)
        if last is None or now - last >= every_s:
            if len(self._last_logged) >= 256:  # reasons carry text: keep the map bounded
                self._last_logged.clear()
            self._last_logged[key] = now
            self._log(level, line)
