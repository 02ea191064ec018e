"""The one HTTP client of telemetry's readers of other agents: the peers' documents (telemetry.peerwatch), Ray's
state API (telemetry.sources.raystate), the engines' counters, the serving probe's one-token completion
(telemetry.sources.completion, a POST with a body), and the Docker Engine API on its unix socket
(telemetry.sources.dockerapi: GETs, and the POSTs that pause, unpause or kill a container). Bounded in time (one
deadline for the whole exchange, not per read: a peer that drips a byte a second is as late as one that says nothing)
and in size (an answer past `max_bytes` is cut and its connection never reused).

Plain HTTP goes through h11 (the HTTP/1.1 state machine, no I/O of its own) on a socket: `http.client` imports
`ssl`, whose libssl and libcrypto were 4.4 MiB of the group watch's +5.5 MiB of telemetry RSS
(bench/RESULTS-group-teardown.md), on a box where nothing else needs TLS. An `https://` peer or dashboard goes
through `http.client` with the caller's context: TLS needs ssl anyway.

Failures are one exception with a kind: `timeout` (no answer within the deadline), `refused` (the host answered
that nothing listens there, or reset or closed the connection without an answer), `broken` (something answered,
and not with whole HTTP: not HTTP at all, cut short, or a TLS handshake it refused), `unreachable` (any other
failure to connect or read). Only `timeout` and `unreachable` say that nothing answered (telemetry.peerwatch). The
caller counts them by its own kinds.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import h11

if TYPE_CHECKING:
    import http.client
    import ssl

READ_BYTES = 64 << 10


class HttpGetError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # timeout, refused, unreachable


class HttpGet:
    """Requests to one host: `get(path)` -> (status, body, cut), `post(path, body=…)` the same for a POST. With
    `keep_alive` the connection is reused by the next call while the server keeps it open and the last answer was
    read whole; any failure closes it. With `unix_path` the host is a unix socket (the Docker API's): `host` is then
    only the Host header."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: Callable[[], ssl.SSLContext] | None = None,
        keep_alive: bool = False,
        headers: tuple[tuple[str, str], ...] = (),
        unix_path: str | None = None,
        on_connect: Callable[[socket.socket], None] | None = None,
    ) -> None:
        self.host = host
        self.unix_path = unix_path
        self.port = port
        self.tls = tls  # None: plain HTTP
        self.keep_alive = keep_alive
        where = f"[{host}]" if ":" in host else host  # an IPv6 address
        self.headers = (("Host", f"{where}:{port}"), *headers, ("Connection", "keep-alive" if keep_alive else "close"))
        # Called with each new plain connection before anything is sent on it; raising sends nothing and closes it
        # (the serving probe's landing check: telemetry.sources.completion).
        self.on_connect = on_connect
        self.last_headers: dict[str, str] = {}  # the last answer's headers, names lower-cased (a peer's proof)
        self._sock: socket.socket | None = None
        self._h11: h11.Connection | None = None
        self._https: http.client.HTTPSConnection | None = None

    def get(self, path: str, timeout_s: float, max_bytes: int) -> tuple[int, bytes, bool]:
        """The status, the body (at most `max_bytes`), and whether the body was cut there. Its headers: in
        `last_headers`."""
        return self._request("GET", path, timeout_s, max_bytes)

    def post(self, path: str, timeout_s: float, max_bytes: int, body: bytes = b"") -> tuple[int, bytes, bool]:
        """A POST of `body` (empty: the Docker API's pause, unpause, kill; the serving probe's one-token completion,
        telemetry.sources.completion), answered as `get`."""
        return self._request("POST", path, timeout_s, max_bytes, body)

    def _request(
        self, method: str, path: str, timeout_s: float, max_bytes: int, body: bytes = b""
    ) -> tuple[int, bytes, bool]:
        self.last_headers = {}
        try:
            if self.tls is not None:
                return self._get_tls(method, path, timeout_s, max_bytes, body)
            return self._get_plain(method, path, time.monotonic() + timeout_s, max_bytes, body)
        except HttpGetError:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise HttpGetError("timeout", f"no answer within {timeout_s:g} s") from None
        except (ConnectionRefusedError, ConnectionResetError) as exc:
            self.close()
            raise HttpGetError("refused", exc.strerror or type(exc).__name__) from None
        except h11.ProtocolError as exc:
            self.close()
            raise HttpGetError("broken", str(exc) or type(exc).__name__) from None
        except OSError as exc:
            self.close()
            raise HttpGetError("unreachable", str(exc) or type(exc).__name__) from None
        except BaseException:  # on_connect's own reason to send nothing, or an interrupt: never reused
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._https is not None:
            self._https.close()
        self._sock, self._h11, self._https = None, None, None

    def _get_plain(
        self, method: str, path: str, deadline: float, max_bytes: int, data: bytes = b""
    ) -> tuple[int, bytes, bool]:
        if self._sock is None or self._h11 is None:
            self._sock = self._connect(deadline)
            self._h11 = h11.Connection(our_role=h11.CLIENT)
            if self.on_connect is not None:
                self.on_connect(self._sock)
        sock, conn = self._sock, self._h11
        sock.settimeout(_left(deadline))
        headers = [*self.headers, ("Content-Length", str(len(data)))] if method != "GET" else list(self.headers)
        sock.sendall(conn.send(h11.Request(method=method, target=path, headers=headers)) or b"")
        if data:
            sock.sendall(conn.send(h11.Data(data=data)) or b"")
        sock.sendall(conn.send(h11.EndOfMessage()) or b"")
        status, body, cut, heard = 0, bytearray(), False, False
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                sock.settimeout(_left(deadline))
                data = sock.recv(READ_BYTES)
                if not data and not heard:  # closed without a byte (a kept-alive one the server dropped too)
                    raise ConnectionResetError(0, "closed without an answer")
                heard = True
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                self.last_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_bytes:
                    cut = True
                    break
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionResetError(0, "closed without an answer")
        if cut or not self.keep_alive or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            self.close()  # the rest of a cut answer is never read: never reuse that connection
        else:
            conn.start_next_cycle()
        return status, bytes(body[:max_bytes]), cut

    def _connect(self, deadline: float) -> socket.socket:
        if self.unix_path is None:
            return socket.create_connection((self.host, self.port), timeout=_left(deadline))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_left(deadline))
            sock.connect(self.unix_path)
        except BaseException:
            sock.close()
            raise
        return sock

    def _get_tls(
        self, method: str, path: str, timeout_s: float, max_bytes: int, data: bytes = b""
    ) -> tuple[int, bytes, bool]:
        """Through http.client, whose timeout is per read (not one deadline): TLS peers are the rare case."""
        import http.client  # noqa: PLC0415  (imports ssl: only for an https:// peer or dashboard)
        import ssl  # noqa: PLC0415

        assert self.tls is not None
        if self._https is None:
            self._https = http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self.tls())
        conn = self._https
        try:
            conn.request(method, path, body=data if method != "GET" else None, headers=dict(self.headers[1:]))
            resp = conn.getresponse()
            body = resp.read(max_bytes + 1)
        except (http.client.HTTPException, ssl.SSLError) as exc:  # an answer, broken (or a handshake refused)
            raise HttpGetError("broken", str(exc) or type(exc).__name__) from None
        self.last_headers = {k.lower(): v for k, v in resp.getheaders()}
        cut = len(body) > max_bytes
        if cut or resp.will_close or not self.keep_alive:
            self.close()
        return resp.status, body[:max_bytes], cut


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
