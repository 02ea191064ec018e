"""The alert outbox: events spooled durably under <state_dir>/outbox/, delivered to the webhook at least once.

Why a spool of files: the receiver may be down for hours and sparkwatch may restart meanwhile (an update, a reboot
after a stranded driver). Each alert is one file `<event id>.json`, written to a temporary name, fsynced, renamed and
the directory fsynced; it is removed only after the receiver answered 2xx. On start every file left is sent again.
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
import errno
import hashlib
import hmac
import http.client
import json
import os
import random
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkwatch import __version__
from sparkwatch.core.alerts import RateState, alert_text, dedup_key, is_alerting, rate_limit
from sparkwatch.core.redact import redact_url
from sparkwatch.model import Event

_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_RESPONSE_READ_MAX = 65536  # a receiver's answer is read (so the connection ends cleanly) but never trusted


def sign(secret: bytes, body: bytes) -> str:
    """The X-Sparkwatch-Signature value: sha256=<hex HMAC-SHA256 of the exact body bytes>."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def alert_payload(event: Event) -> dict[str, object]:
    """The event JSON plus `text`, so Slack-compatible receivers show it as is."""
    data = event.to_json_dict()
    data["text"] = alert_text(event.kind, event.node, event.summary)
    return data


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


class Outbox:
    """Durable, at-least-once webhook delivery on one worker thread. Counters are plain attributes for the exporter.

    `pending`, `delivered_total`, `failed_attempts_total`, `spool_errors_total`, `last_error` (scrubbed),
    `last_delivery_timestamp_s`.
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
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.spool_dir = spool_dir
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
        self._log = log or (lambda line: None)
        self._lock = threading.Condition()
        self._items: dict[str, _Item] = {}
        self._transport_failures = 0
        self._paused_until_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_logged: dict[str, float] = {}
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        # counters
        self.delivered_total = 0
        self.failed_attempts_total = 0
        self.spool_errors_total = 0
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
        self._thread = threading.Thread(target=self._run, name="sparkwatch-outbox", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 2)

    def _load_spool(self) -> None:
        try:
            self.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            names = sorted(os.listdir(self.spool_dir))
        except OSError as exc:
            self._spool_error(f"outbox {self.spool_dir} unusable: {exc.strerror or exc}")
            return
        loaded = 0
        for name in names:
            path = self.spool_dir / name
            if name.startswith(".tmp-"):
                try:
                    path.unlink()  # torn write of a crash before its rename: never acknowledged to anyone
                except OSError:
                    pass
                continue
            if not name.endswith(".json"):
                continue
            try:
                body = path.read_bytes()
                json.loads(body)
            except (OSError, ValueError) as exc:
                self._spool_error(f"outbox: unreadable spool file {name}: {exc}")
                continue
            event_id = name[: -len(".json")]
            with self._lock:
                self._items.setdefault(event_id, _Item(event_id, body, path))
            loaded += 1
        if loaded:
            self._log(f"sparkwatch: outbox: {loaded} undelivered alerts from before, sending to {self.target}")

    # --- producers
    def submit(self, payload: Mapping[str, object]) -> None:
        """Spool one alert durably (or keep it in memory if the disk refuses) and wake the worker. Never raises."""
        raw_id = str(payload.get("id") or "")
        event_id = raw_id if _SAFE_ID.match(raw_id) else hashlib.sha256(raw_id.encode()).hexdigest()[:32]
        body = json.dumps(payload, separators=(",", ":"), default=str).encode()
        spool_path = self.spool_dir / f"{event_id}.json"
        path: Path | None = spool_path
        try:
            self._write_durably(spool_path, body)
        except OSError as exc:
            path = None
            self._spool_error(
                f"outbox: could not spool alert {event_id} under {self.spool_dir}: "
                f"{exc.strerror or exc}; keeping it in memory only"
                + (" (disk full)" if exc.errno == errno.ENOSPC else "")
            )
        with self._lock:
            if event_id not in self._items:
                self._items[event_id] = _Item(event_id, body, path)
            self._lock.notify_all()

    def _write_durably(self, path: Path, body: bytes) -> None:
        self.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".tmp-{path.name}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            os.close(fd)
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        os.close(fd)
        os.rename(tmp, path)
        dfd = os.open(self.spool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _spool_error(self, message: str) -> None:
        self.spool_errors_total += 1
        self.last_error = self._scrub(message)
        self._log_limited("spool", f"sparkwatch: ERROR {self.last_error}")

    # --- the worker
    def _backoff_s(self, failures: int) -> float:
        delay = min(self.backoff_max_s, self.backoff_min_s * float(2 ** min(max(failures - 1, 0), 60)))
        return delay * random.uniform(0.8, 1.2)

    def _next(self) -> _Item | None:
        """The due item with the earliest (due time, id), waiting until one is due or we stop."""
        with self._lock:
            while not self._stop.is_set():
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

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._next()
            if item is None:
                return
            try:
                self.deliver(item.event_id, item.body)
            except DeliveryError as exc:
                self._failed(item, exc)
            else:
                self._delivered(item)

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
            self._log(f"sparkwatch: outbox: {self.target} reachable again, delivering")

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
        self._log_limited(
            "deliver",
            f"sparkwatch: WARNING alert delivery to {self.target} failed ({self.last_error}); "
            f"{pending} pending, retrying with backoff up to {self.backoff_max_s:g} s",
        )

    def deliver(self, event_id: str, body: bytes) -> None:
        """One POST. Returns on 2xx; raises DeliveryError otherwise. Never follows a redirect."""
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
        try:
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            response.read(_RESPONSE_READ_MAX)
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            raise DeliveryError(f"{type(exc).__name__}: {exc}", transport=True) from None
        finally:
            conn.close()
        if 200 <= status < 300:
            return
        if 300 <= status < 400:
            raise DeliveryError(f"answered {status} (a redirect; not followed: fix webhook_url)", transport=False)
        raise DeliveryError(f"answered HTTP {status}", transport=status >= 500 or status in (408, 429))

    # --- hygiene
    def _scrub(self, text: str) -> str:
        for secret in (self._url, self._parts.path, self._parts.query, self._parts.password):
            if secret and len(secret) > 1:
                text = text.replace(secret, "…")
        if self._secret:
            text = text.replace(self._secret.decode(errors="replace"), "…")
        return text[:300]

    def _log_limited(self, key: str, line: str, every_s: float = 300.0) -> None:
        now = time.monotonic()
        last = self._last_logged.get(key)
        if last is None or now - last >= every_s:
            self._last_logged[key] = now
            self._log(line)


class AlertRouter:
    """The EventLog listener: picks the alerting events, rate-limits them, and hands them to the outbox.

    EventLog calls it after the event is fsynced to events.jsonl, on the appending thread; it only spools a file.
    """

    def __init__(self, outbox: Outbox, clock: Callable[[], float] = time.monotonic) -> None:
        self.outbox = outbox
        self._clock = clock
        self._lock = threading.Lock()
        self._state = RateState()
        self.suppressed_total = 0
        self.errors_total = 0

    def __call__(self, event: Event) -> None:
        # Runs on whichever thread appended the event (the guard's reaper for a kill): it must never raise into it.
        try:
            self._route(event)
        except Exception as exc:
            self.errors_total += 1
            self.outbox._spool_error(f"outbox: could not route {event.kind} event {event.id}: {exc}")

    def _route(self, event: Event) -> None:
        if not is_alerting(event.kind):
            return
        key = dedup_key(event.kind, {"id": event.id, **event.fields})
        with self._lock:
            self._state, send = rate_limit(self._state, event.kind, key, self._clock())
            if not send:
                self.suppressed_total += 1
                return
        self.outbox.submit(alert_payload(event))
