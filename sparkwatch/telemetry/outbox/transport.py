"""One webhook POST: sign it, send it within one deadline, and say what the answer means for the queue.

`Transport.deliver` returns on a 2xx and raises `DeliveryError` otherwise; the error's `transport` flag is the
classification the retry queue (queue.py) acts on:
- True, a failure of the transport: refused, timed out, garbage instead of HTTP, and the answers that say the
  receiver itself is unwell (5xx, 408, 429). The whole queue pauses: the next alert would fare no better.
- False, this item was rejected: any other 4xx, and every 3xx. Only this item is pushed back, so one payload a
  receiver rejects cannot block the others forever.

Redirects are never followed: a 3xx is a failed attempt. Following a redirect would re-send a signed alert, and for
Slack-style URLs the secret in the path, to wherever a Location header points.

The URL and the secret never leave this module: a Slack webhook URL carries its secret in the path, so the target is
shown as scheme://host only (`target`), and `scrub` removes both from any error text before it is logged or counted.

http.client and ssl are imported by the first Transport or delivery, hmac and hashlib (libcrypto) by the first
signature: telemetry imports this module whether or not a webhook is configured, and without one it loads none of
them (tests/test_telemetry_imports.py).
"""

from __future__ import annotations

import base64
import socket
import threading
import urllib.parse
from typing import TYPE_CHECKING

from sparkwatch import __version__
from sparkwatch.core.redact import safe_text
from sparkwatch.core.urls import redact_url

if TYPE_CHECKING:
    import http.client
    import ssl

TIMED_OUT = "timed out: no complete answer within {:g} s"
_RESPONSE_READ_MAX = 65536  # a receiver's answer is read (so the connection ends cleanly) but never trusted


def sign(secret: bytes, body: bytes) -> str:
    """The X-Sparkwatch-Signature value: sha256=<hex HMAC-SHA256 of the exact body bytes>."""
    import hashlib  # noqa: PLC0415 - hmac and hashlib load libcrypto: only where a webhook is configured
    import hmac  # noqa: PLC0415

    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


class DeliveryError(Exception):
    """One failed attempt. `transport` is True when the receiver was not reached or did not speak HTTP."""

    def __init__(self, message: str, transport: bool) -> None:
        super().__init__(message)
        self.transport = transport


def classify(status: int, location: str = "") -> DeliveryError | None:
    """What an HTTP answer means: None for delivered (2xx), else the failed attempt, transport or this item's."""
    if 200 <= status < 300:
        return None
    if 300 <= status < 400:
        where = f" to {redact_url(location)}" if location.startswith(("http://", "https://")) else ""
        return DeliveryError(f"answered {status} (a redirect{where}; not followed: fix webhook_url)", transport=False)
    return DeliveryError(f"answered HTTP {status}", transport=status >= 500 or status in (408, 429))


class Transport:
    """POSTs to one webhook URL (http or https), signed with `secret` when there is one."""

    def __init__(self, url: str, secret: str | None, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("webhook_url must be an http:// or https:// URL with a host")
        self._url = url
        self._parts = parts
        self._secret = secret.encode() if secret else None
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            import ssl  # noqa: PLC0415 - only for an https webhook: ssl and libcrypto cost telemetry 5 MiB RSS

            self._ssl = ssl.create_default_context()
        self.target = redact_url(url)
        self.timeout_s = timeout_s

    def deliver(self, event_id: str, body: bytes) -> None:
        """One POST within `timeout_s` in all (connect, send, headers, body). Returns on 2xx; raises DeliveryError
        otherwise. Never follows a redirect.

        http.client's timeout is per socket operation: a receiver that answers one byte a second never trips it. A
        timer shuts the socket down at the deadline, which ends whatever read is blocked on it.
        """
        import http.client  # noqa: PLC0415 - only where a webhook is configured (http.client pulls in email's parser)

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
            # A socket operation's own timeout is the whole deadline too (it is timeout_s long): whichever of it and
            # the timer fires first, the answer did not come in time (the two raced: "TimeoutError: timed out").
            if expired.is_set() or isinstance(exc, TimeoutError):
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
        failed = classify(status, location)
        if failed is not None:
            raise failed

    def scrub(self, text: str) -> str:
        """`text` without the URL, its path, query or password, or the secret; one line, at most 300 characters."""
        for secret in (self._url, self._parts.path, self._parts.query, self._parts.password):
            if secret and len(secret) > 1:
                text = text.replace(secret, "…")
        if self._secret:
            text = text.replace(self._secret.decode(errors="replace"), "…")
        return safe_text(text)[:300]
