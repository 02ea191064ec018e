"""The alert outbox: events spooled durably under <state_dir>/outbox/, delivered to the webhook at least once.

Why a spool of files: the receiver may be down for hours and sparkwatch may restart meanwhile (an update, a reboot
after a stranded driver). Each alert is one file `<event id>.json` (durable write: actuators/durable.py), first as
`.pending-<event id>.json` before its event is written, renamed once the event is durable (see Outbox); it is
removed only after the receiver answered 2xx. On start every file left is sent again. Files that are not ours
(a name that is not an event id, JSON that does not parse) go to `outbox/bad/`; the worker is supervised; the
outbox holds at most `max_alerts` and drops the oldest past that.
The event id travels as `X-Sparkwatch-Event-Id`, so a receiver that saw a POST whose answer got lost can drop the
duplicate: delivery is at least once, never at most once.

Retries back off exponentially from `backoff_min_s` to `backoff_max_s` (with ±20 % jitter so several nodes do not
retry in lock step). A failure of the transport (refused, timed out, garbage instead of HTTP) pauses the whole queue;
an HTTP error answer pushes back only that item, so one payload a receiver rejects cannot block the others forever.

Redirects are never followed: a 3xx is a failed attempt, retried like a 500. Following a redirect would re-send a
signed alert, and for Slack-style URLs the secret in the path, to wherever a Location header points.

The URL and the secret never appear in logs or counters: a Slack webhook URL carries its secret in the path, so the
target is shown as scheme://host only, and error text is scrubbed of both.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import logging
import os
import random
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkwatch import __version__
from sparkwatch.common import logs
from sparkwatch.common.durable import (
    append_durable,
    fsync_dir,
    open_regular,
    private_dir,
    read_regular,
)
from sparkwatch.common.events import make_event
from sparkwatch.common.lifecycle import Backoff, run_with_restarts
from sparkwatch.common.spool import BAD, PENDING, SAFE_ID, TMP, commit_file, prepare_file
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import Event
from sparkwatch.core.redact import safe_text
from sparkwatch.core.urls import redact_url

EVENTS_SCAN_BYTES = 4 << 20  # how much of events.jsonl's end start-up recovery searches for a prepared alert's id
TIMED_OUT = "timed out: no complete answer within {:g} s"
_RESPONSE_READ_MAX = 65536  # a receiver's answer is read (so the connection ends cleanly) but never trusted


def sign(secret: bytes, body: bytes) -> str:
    """The X-Sparkwatch-Signature value: sha256=<hex HMAC-SHA256 of the exact body bytes>."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


class DeliveryError(Exception):
    """One failed attempt. `transport` is True when the receiver was not reached or did not speak HTTP."""

    def __init__(self, message: str, transport: bool) -> None:
        super().__init__(message)
        self.transport = transport


@dataclass
class _Item:
    event_id: str
    body: bytes
    path: Path | None  # None: could not be spooled (full disk); delivered from memory if we live long enough
    attempts: int = 0
    next_due_s: float = 0.0


OUTBOX_MAX_ALERTS = 1000  # spooled alerts kept; past this the oldest is dropped (counted, alerted once)
SPOOL_FILE_MAX_BYTES = 1 << 20  # an alert is ~1-2 KiB of JSON; a bigger spool file is not ours
SUPERVISE_BACKOFF_S = (0.1, 30.0)  # the worker restarts after a crash, backing off to 30 s if it keeps crashing


def _spool_name_ok(name: str) -> bool:
    return name.endswith(".json") and SAFE_ID.match(name[: -len(".json")]) is not None


class Outbox:
    """Durable, at-least-once webhook delivery on one supervised worker thread. Counters are plain attributes for
    the exporter: `pending`, `delivered_total`, `failed_attempts_total`, `spool_errors_total`, `dropped_total`,
    `quarantined_total`, `worker_restarts_total`, `last_error` (scrubbed), `last_delivery_timestamp_s`.

    Crash consistency with events.jsonl: an alert is first spooled as `.pending-<id>.json`, then its event is
    written, then the file is renamed to `<id>.json`. On start a pending file whose event is missing from
    events.jsonl gets its event appended from the spooled copy, then it is promoted: a crash between the two writes
    loses neither the record nor the alert, and no alert goes out for an event the log does not hold.
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
        self.spool_dir = spool_dir
        self.events_group = events_group  # the state dir's group (events_group), as the event log keeps it
        self.bad_dir = spool_dir / BAD
        self.events_path = events_path if events_path is not None else spool_dir.parent / "events.jsonl"
        self._url = url
        self._secret = secret.encode() if secret else None
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("webhook_url must be an http:// or https:// URL with a host")
        self._parts = parts
        self.target = redact_url(url)
        self.timeout_s = timeout_s
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = max(backoff_max_s, backoff_min_s)
        self.max_alerts = max(1, max_alerts)
        self._log = log or logs.get("outbox").log  # (level, line); tests pass their own
        self._lock = threading.Condition()
        self._items: dict[str, _Item] = {}
        self._transport_failures = 0
        self._paused_until_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_logged: dict[str, float] = {}
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
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
            return len(self._items)

    # --- lifecycle
    def start(self) -> None:
        self._load_spool()
        self._thread = daemon_thread(self._supervise, "sparkwatch-outbox")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 2)

    def _load_spool(self) -> None:
        try:
            private_dir(self.spool_dir.parent, self.events_group)  # the state dir: 0700 (0750 with events_group)
            private_dir(self.spool_dir)
            names = sorted(os.listdir(self.spool_dir))
        except OSError as exc:
            self._spool_error(f"outbox {self.spool_dir} unusable: {exc.strerror or exc}")
            return
        loaded = 0
        logged_ids: set[str] | None = None
        for name in names:
            if name == self.bad_dir.name:
                continue
            path = self.spool_dir / name
            if name.startswith(TMP):
                try:
                    path.unlink()  # torn write of a crash before its rename: never acknowledged to anyone
                except OSError:
                    pass
                continue
            pending = name.startswith(PENDING)
            final = name[len(PENDING) :] if pending else name
            if not _spool_name_ok(final):
                self._quarantine(path, "a name that is not an event id")
                continue
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
            event_id = final[: -len(".json")]
            if pending:
                if logged_ids is None:
                    logged_ids = self._logged_event_ids()
                try:
                    if event_id not in logged_ids:
                        self._restore_event(data)
                    target = self.spool_dir / final
                    os.rename(path, target)
                    fsync_dir(self.spool_dir)
                    path = target
                except (OSError, ValueError) as exc:
                    self._spool_error(f"outbox: could not recover prepared alert {event_id}: {exc}")
                    continue
            with self._lock:
                self._items.setdefault(event_id, _Item(event_id, body, path))
            loaded += 1
        self._enforce_cap()
        if loaded:
            self._log(logging.INFO, f"outbox: {loaded} undelivered alerts from before, sending to {self.target}")

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
        safe = hashlib.sha256(os.fsencode(path.name)).hexdigest()[:32]
        try:
            private_dir(self.bad_dir)
            os.rename(path, self.bad_dir / f"{int(time.time())}-{safe}")
        except OSError as exc:
            try:
                path.unlink()
            except OSError:
                self._spool_error(f"outbox: could not quarantine or remove a spool file: {exc.strerror or exc}")
                return
        self.quarantined_total += 1
        self._log(logging.WARNING, f"WARNING outbox: quarantined spool file {safe_text(path.name)!r} ({why}) to bad/")
        self._notice(
            EventKind.OUTBOX_QUARANTINED,
            f"The alert outbox moved an unreadable spool file to {self.bad_dir}",
            {"reason": why[:200]},
        )

    def _notice(self, kind: EventKind, summary: str, fields: dict[str, object]) -> None:
        """Queue one event of `kind` for the log (once per daemon run): recorded by the worker, outside every lock."""
        with self._lock:
            if kind in self._announced:
                return
            self._announced.add(kind)
            self._notices.append((kind, summary, fields))
            self._lock.notify_all()

    # --- producers
    def prepare(self, payload: Mapping[str, object]) -> Callable[[], None]:
        """Spool one alert as pending (before its event is written); the returned commit makes it deliverable."""
        prepared = prepare_file(self.spool_dir, payload)
        if prepared.error is not None:
            self._spool_error(f"outbox: {prepared.error}; keeping it in memory only")
        event_id, body = prepared.event_id, prepared.body

        def commit() -> None:
            path: Path | None = None
            if prepared.error is None:
                try:
                    path = commit_file(prepared)
                except OSError as exc:
                    self._spool_error(f"outbox: could not commit alert {event_id}: {exc.strerror or exc}")
                    path = prepared.pending if prepared.pending.exists() else None
            with self._lock:
                if event_id not in self._items:
                    self._items[event_id] = _Item(event_id, body, path)
                self._lock.notify_all()
            self._enforce_cap()

        return commit

    def spool_error(self, message: str) -> None:
        """The Spooler interface (actuators.spool.AlertRouter reports routing errors here)."""
        self._spool_error(message)

    def attach_recorder(self, record: Callable[[Event], None]) -> None:
        """Where the outbox records its own drop/quarantine events (the EventLog it is a stage of)."""
        self._record = record

    def submit(self, payload: Mapping[str, object]) -> None:
        """Spool one alert durably (or keep it in memory if the disk refuses) and wake the worker. Never raises."""
        self.prepare(payload)()

    def _enforce_cap(self) -> None:
        """Drop the oldest alerts past `max_alerts` (event ids sort by time), each counted; the drop alerted once."""
        dropped: list[_Item] = []
        with self._lock:
            while len(self._items) > self.max_alerts:
                oldest = min(self._items)
                dropped.append(self._items.pop(oldest))
            self.dropped_total += len(dropped)
        for item in dropped:
            if item.path is not None:
                try:
                    item.path.unlink()
                except OSError:
                    pass
        if dropped:
            self._log_limited(
                "drop",
                logging.WARNING,
                f"WARNING outbox full ({self.max_alerts} alerts): dropped {len(dropped)} oldest "
                f"({self.dropped_total} in all); is {self.target} down?",
            )
            self._notice(
                EventKind.OUTBOX_DROPPED,
                f"The alert outbox is full ({self.max_alerts} alerts) and dropped the oldest undelivered alerts",
                {"max_alerts": self.max_alerts},
            )

    def _spool_error(self, message: str) -> None:
        self.spool_errors_total += 1
        self.last_error = self._scrub(message)
        self._log_limited("spool", logging.ERROR, f"ERROR {self.last_error}")

    # --- the worker
    def _backoff_s(self, failures: int) -> float:
        delay = min(self.backoff_max_s, self.backoff_min_s * float(2 ** min(max(failures - 1, 0), 60)))
        return delay * random.uniform(0.8, 1.2)

    def _next(self) -> _Item | None:
        """The due item with the earliest (due time, id), waiting until one is due or we stop."""
        with self._lock:
            while not self._stop.is_set():
                if self._notices:
                    return None
                now = time.monotonic()
                wake = None
                if self._items:
                    first = min(self._items.values(), key=lambda i: (i.next_due_s, i.event_id))
                    due = max(first.next_due_s, self._paused_until_s)
                    if due <= now:
                        return first
                    wake = due - now
                self._lock.wait(wake)
        return None

    def _supervise(self) -> None:
        """Run the worker; restart it after any exception (counted, logged), backing off while it keeps failing."""
        run_with_restarts(self._run_worker, self._stop, Backoff(*SUPERVISE_BACKOFF_S), self._worker_crashed)

    def _run_worker(self) -> str | None:
        self._run()
        return None  # returns only when stopping

    def _worker_crashed(self, why: str, _delay_s: float) -> None:
        self.worker_restarts_total += 1
        self.last_error = self._scrub(f"worker crashed: {why}")
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

    def _delivered(self, item: _Item) -> None:
        if item.path is not None:
            try:
                item.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._spool_error(f"outbox: delivered {item.event_id} but could not remove its file: {exc}")
        with self._lock:
            self._items.pop(item.event_id, None)
            self._transport_failures = 0
            self._paused_until_s = 0.0
            self.delivered_total += 1
            self.last_delivery_timestamp_s = time.time()
        if self._last_logged.pop("deliver", None) is not None:
            self._log(logging.INFO, f"outbox: {self.target} reachable again, delivering")

    def _failed(self, item: _Item, exc: DeliveryError) -> None:
        now = time.monotonic()
        with self._lock:
            self.failed_attempts_total += 1
            item.attempts += 1
            self.last_error = self._scrub(str(exc))
            item.next_due_s = now + self._backoff_s(item.attempts)
            if exc.transport:
                self._transport_failures += 1
                self._paused_until_s = now + self._backoff_s(self._transport_failures)
            pending = len(self._items)
        # Every distinct reason is logged (then at most every 5 min): a redirect, a 4xx and a timeout each show.
        self._log_limited(
            "deliver:" + re.sub(r"\d+", "N", self.last_error)[:80],
            logging.WARNING,
            f"WARNING alert delivery to {self.target} failed ({self.last_error}); "
            f"{pending} pending, retrying with backoff up to {self.backoff_max_s:g} s",
        )
        self._last_logged.setdefault("deliver", now)

    def deliver(self, event_id: str, body: bytes) -> None:
        """One POST within `timeout_s` in all (connect, send, headers, body). Returns on 2xx; raises DeliveryError
        otherwise. Never follows a redirect.

        http.client's timeout is per socket operation: a receiver that answers one byte a second never trips it. A
        timer shuts the socket down at the deadline, which ends whatever read is blocked on it.
        """
        parts = self._parts
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"sparkwatch/{__version__}",
            "X-Sparkwatch-Event-Id": event_id,
        }
        if self._secret is not None:
            headers["X-Sparkwatch-Signature"] = sign(self._secret, body)
        if parts.username is not None:
            userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn: http.client.HTTPConnection
        if self._ssl is not None:
            conn = http.client.HTTPSConnection(
                parts.hostname or "", parts.port, timeout=self.timeout_s, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=self.timeout_s)
        expired = threading.Event()
        held: list[socket.socket] = []

        def cut() -> None:
            expired.set()
            for sock in held:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.timeout_s, cut)
        timer.daemon = True
        timer.start()
        location = ""
        response: http.client.HTTPResponse | None = None
        try:
            conn.connect()
            held.append(conn.sock)  # the response keeps reading it after http.client lets go of conn.sock
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            response.read(_RESPONSE_READ_MAX)
            status = response.status
            location = response.getheader("Location") or ""
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set():
                raise DeliveryError(TIMED_OUT.format(self.timeout_s), transport=True) from None
            raise DeliveryError(f"{type(exc).__name__}: {exc}", transport=True) from None
        finally:
            timer.cancel()
            if response is not None:
                response.close()
            conn.close()
            for sock in held:
                sock.close()
        if expired.is_set():
            raise DeliveryError(TIMED_OUT.format(self.timeout_s), transport=True)
        if 200 <= status < 300:
            return
        if 300 <= status < 400:
            where = f" to {redact_url(location)}" if location.startswith(("http://", "https://")) else ""
            raise DeliveryError(
                f"answered {status} (a redirect{where}; not followed: fix webhook_url)", transport=False
            )
        raise DeliveryError(f"answered HTTP {status}", transport=status >= 500 or status in (408, 429))

    # --- hygiene
    def _scrub(self, text: str) -> str:
        for secret in (self._url, self._parts.path, self._parts.query, self._parts.password):
            if secret and len(secret) > 1:
                text = text.replace(secret, "…")
        if self._secret:
            text = text.replace(self._secret.decode(errors="replace"), "…")
        return safe_text(text)[:300]

    def _log_limited(self, key: str, level: int, line: str, every_s: float = 300.0) -> None:
        now = time.monotonic()
        last = self._last_logged.get(key)
        if last is None or now - last >= every_s:
            if len(self._last_logged) >= 256:  # reasons carry text: keep the map bounded
                self._last_logged.clear()
            self._last_logged[key] = now
            self._log(level, line)
