"""The metrics endpoint: a bounded HTTP(S) server for a private prometheus_client registry.

Why not prometheus_client's own server: it spends one thread per connection and has no read timeout, and with TLS
it runs the handshake in the accept loop. Measured against it: under the unit's TasksMax=32, 22 idle connections
stopped every scrape (and the driver check failed with "can't start new thread"), and one TLS connection that never
sent a ClientHello blocked every HTTPS scrape.

This one has a fixed number of threads whatever the clients do:
- one selector thread accepts, runs TLS handshakes and reads request heads, all non-blocking: a client that connects
  and sends nothing, or no ClientHello, or one byte a second, costs a file descriptor, never a thread;
- at most `max_connections` connections waiting for their request: past that the oldest is closed; one that has not
  sent a whole request head within `idle_timeout_s` of connecting is closed;
- `workers` threads only render and send an answer, within `request_timeout_s` (the selector thread shuts a
  connection down past its deadline, so a client that never reads cannot hold a worker either);
- one request per connection (`Connection: close`), request head at most 16 KiB.

The registry holds only sparkwatch's collector (no process/platform/gc collectors: they would do /proc I/O at scrape
time and add names outside the contract). Encoding (text or OpenMetrics, by the Accept header) is prometheus_client's,
without its exposition module (exporter/exposition.py); ssl is imported only where TLS is configured.
"""

from __future__ import annotations

import errno
import math
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.registry import CollectorRegistry

from sparkwatch.common import logs
from sparkwatch.common.peerproof import nonce_of
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.model import Snapshot
from sparkwatch.telemetry.exporter.collector import (
    EventLogLike,
    GuardLike,
    KernelLogLike,
    OutboxLike,
    SparkwatchCollector,
)
from sparkwatch.telemetry.exporter.exposition import choose_encoder, generate_text

if TYPE_CHECKING:
    import ssl

    from sparkwatch.config.settings import Settings

MAX_CONNECTIONS = 64  # open connections at once; Prometheus and a curl need one or two
WORKERS = 2  # scrapes render in ~1 ms; two workers keep one slow client from delaying the next scrape
REQUEST_TIMEOUT_S = 5.0  # handshake + request + answer, in all, for one connection
IDLE_TIMEOUT_S = 10.0  # a connection that sends nothing for this long is closed
REQUEST_HEAD_MAX_BYTES = 16384
# The port in use at start: usually the telemetry process before this one, still going away (a second or two), but
# it can be another program for good. Telemetry runs on meanwhile (alerts, driver checks, the guard's GPU figures)
# and binds again this often; before, the process exited and the guard restarted it, with backoff, for as long as
# the port stayed taken, and no alert went out all that time.
BIND_RETRY_S = 5.0
TAKEN_SAY_S = 60.0  # while the port stays taken, the error (with its holder) again this often
EVICT_MIN_IDLE_S = 0.2  # a connection younger than this is not evicted for a newer one (a scrape sends at once)

log = logs.get("metrics")


def build_registry(
    settings: Settings,
    latest: Callable[[], Snapshot | None],
    guard: GuardLike | None = None,
    events: EventLogLike | None = None,
    outbox: OutboxLike | None = None,
    *,
    kernel_log: KernelLogLike | None = None,
) -> CollectorRegistry:
    """`kernel_log`: the guard's KernelLogWatch (taken from `guard.kernlog` when not given)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        SparkwatchCollector(latest, settings=settings, guard=guard, events=events, outbox=outbox, kernel_log=kernel_log)
    )
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_text(registry)


Headers = tuple[tuple[str, str], ...]
# (status, content type, body) or the same with headers of its own (a peer document's proof: common.peerproof)
Answer = tuple[int, str, bytes] | tuple[int, str, bytes, Headers]
Handler = Callable[[str, str, dict[str, str]], Answer]
Prover = Callable[[str, bytes], Headers]


@dataclass
class _Conn:
    sock: socket.socket  # the TCP socket, or its TLS wrapper (same fd)
    since_s: float
    fd: int
    handshaken: bool = True  # False until a TLS handshake completes
    buf: bytes = b""
    deadline_s: float = 0.0
    request: tuple[str, str, dict[str, str]] | None = field(default=None)


class BoundedHTTPServer:
    """A fixed-thread HTTP/1.x server: `handler(method, path, headers) -> (status, content_type, body)`.

    The selector thread does everything that waits on a client (accept, the TLS handshake, reading the request
    head), non-blocking; a worker only renders and sends the answer.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        ssl_context: ssl.SSLContext | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        workers: int = WORKERS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.handler = handler
        self.ssl_context = ssl_context
        # What a non-blocking step raises when it has to wait; ssl's two only where TLS is on (ssl is imported then).
        self._wait_errors: tuple[type[BaseException], ...] = (BlockingIOError, InterruptedError)
        if ssl_context is not None:
            import ssl  # noqa: PLC0415 - loaded already, with the context

            self._wait_errors += (ssl.SSLWantReadError, ssl.SSLWantWriteError)
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.idle_timeout_s = idle_timeout_s
        info = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self._listener = socket.socket(info[0], socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(info[4])
            self._listener.listen(128)
        except OSError:
            self._listener.close()  # the address is taken (MetricsServer tries again): no socket left behind
            raise
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._open: dict[int, _Conn] = {}  # fd -> connection still handshaking or sending its request head
        self._busy: dict[int, _Conn] = {}  # fd -> connection a worker answers, with its deadline
        self._busy_lock = threading.Lock()
        self._work: queue.Queue[_Conn | None] = queue.Queue(maxsize=max_connections)
        self._stop = threading.Event()
        self._accept_paused_until_s = 0.0
        self._threads = [daemon_thread(self._loop, "sparkwatch-metrics")]
        self._threads += [daemon_thread(self._worker, f"sparkwatch-metrics-{i}") for i in range(workers)]
        # counters
        self.connections_total = 0
        self.evicted_total = 0  # closed unanswered: too slow to send a request, or the oldest when the cap was hit
        self.timeouts_total = 0  # an answer not sent within request_timeout_s
        self.errors_total = 0  # handshake failures, garbage requests, resets
        self.render_errors_total = 0  # the handler raised: answered 500, said in the log once a minute
        self._render_error_logged_at = -math.inf

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        for _ in self._threads[1:]:
            try:
                self._work.put_nowait(None)
            except queue.Full:
                pass
        for thread in self._threads:
            thread.join(5)
        for conn in list(self._open.values()):
            conn.sock.close()
        self._open.clear()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- the selector thread: accept, handshake, read request heads, enforce deadlines
    def _select_timeout_s(self) -> float | None:
        """0.25 s while a deadline can fall due (a connection open or being answered, accepts paused); with nothing
        open, wait for the next connection (or stop's wake-up): an idle endpoint costs no wake-ups."""
        with self._busy_lock:
            busy = bool(self._busy)
        return 0.25 if self._open or busy or self._accept_paused_until_s else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready = self._selector.select(timeout=self._select_timeout_s())
            except OSError:
                return
            now = time.monotonic()
            if self._accept_paused_until_s and now >= self._accept_paused_until_s:
                self._accept_paused_until_s = 0.0
                self._selector.register(self._listener, selectors.EVENT_READ, "listen")
            for key, _mask in ready:
                if key.data == "listen":
                    continue  # after the connections: those that sent something are served before any eviction
                if key.data == "wake":
                    try:
                        self._wake_r.recv(64)
                    except OSError:
                        pass
                else:
                    self._progress(key.fd, now)
            if any(key.data == "listen" for key, _mask in ready):
                self._accept(now)
            self._expire(now)

    def _accept(self, now: float) -> None:
        while True:
            if len(self._open) >= self.max_connections:
                oldest = min(self._open.values(), key=lambda c: c.since_s)
                if now - oldest.since_s < EVICT_MIN_IDLE_S:
                    # Full of connections that only just arrived: leave the rest in the backlog for a moment, so
                    # that those which already sent a request are served before anyone is evicted for a newcomer.
                    self._selector.unregister(self._listener)
                    self._accept_paused_until_s = now + EVICT_MIN_IDLE_S
                    return
                self._close_open(oldest.fd)
                self.evicted_total += 1
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE and friends: the next select tries again
                self.errors_total += 1
                return
            self.connections_total += 1
            sock.setblocking(False)
            conn = _Conn(sock, now, fd=sock.fileno())
            if self.ssl_context is not None:
                conn.sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                conn.handshaken = False
            self._open[conn.fd] = conn
            self._selector.register(conn.sock, selectors.EVENT_READ, "conn")

    def _close_open(self, fd: int) -> None:
        conn = self._open.pop(fd, None)
        if conn is None:
            return
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _progress(self, fd: int, now: float) -> None:
        """Advance one connection: the TLS handshake, then the request head; hand it to a worker once complete."""
        conn = self._open.get(fd)
        if conn is None:
            return
        try:
            if not conn.handshaken:
                conn.sock.do_handshake()  # type: ignore[attr-defined] # handshaken is False only for an SSLSocket
                conn.handshaken = True
            while b"\r\n\r\n" not in conn.buf:
                chunk = conn.sock.recv(4096)
                if not chunk:
                    self._close_open(fd)
                    return
                conn.buf += chunk
                if len(conn.buf) > REQUEST_HEAD_MAX_BYTES:
                    raise ValueError("request head too large")
        except self._wait_errors:
            return  # more to come
        except (OSError, ValueError):
            self.errors_total += 1
            self._close_open(fd)
            return
        conn.request = _parse_head(conn.buf)
        if conn.request is None:
            self.errors_total += 1
            self._close_open(fd)
            return
        del self._open[fd]
        self._selector.unregister(conn.sock)
        conn.deadline_s = now + self.request_timeout_s
        try:
            self._work.put_nowait(conn)
        except queue.Full:
            self.evicted_total += 1
            conn.sock.close()

    def _expire(self, now: float) -> None:
        for fd in [fd for fd, c in self._open.items() if now - c.since_s > self.idle_timeout_s]:
            self._close_open(fd)
            self.evicted_total += 1
        # Under the lock: a worker takes its connection out of _busy before it closes the fd, so the fd shut down
        # here is still that connection's, never a reuse of the number.
        with self._busy_lock:
            for conn in self._busy.values():
                if now <= conn.deadline_s:
                    continue
                self.timeouts_total += 1
                conn.deadline_s = float("inf")
                try:
                    dup = socket.socket(fileno=os.dup(conn.fd))
                    try:
                        dup.shutdown(socket.SHUT_RDWR)  # ends the send the worker is blocked in
                    finally:
                        dup.close()
                except OSError:
                    pass

    # --- the workers: render and send
    def _worker(self) -> None:
        while True:
            conn = self._work.get()
            if conn is None or self._stop.is_set():
                if conn is not None:
                    conn.sock.close()
                return
            with self._busy_lock:
                self._busy[conn.fd] = conn
            try:
                self._answer(conn)
            except Exception:  # a client that went away mid-answer: that connection ends, the server goes on
                self.errors_total += 1
            finally:
                with self._busy_lock:
                    self._busy.pop(conn.fd, None)
                conn.sock.close()

    def _answer(self, conn: _Conn) -> None:
        assert conn.request is not None
        method, path, headers = conn.request
        extra: Headers = ()
        try:
            answer = self.handler(method, path, headers)
            status, content_type, body = answer[0], answer[1], answer[2]
            if len(answer) == 4:
                extra = answer[3]
        except Exception as exc:  # a collector that raises: say so and answer 500, never a silent empty reply
            self.render_errors_total += 1
            now = time.monotonic()
            if now - self._render_error_logged_at > 60:
                self._render_error_logged_at = now
                log.error("ERROR metrics: rendering %s failed: %r", path, exc)
            status, content_type, body = 500, "text/plain; charset=utf-8", b"metrics could not be rendered\n"
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}.get(
            status, "Error"
        )
        own = "".join(f"{name}: {value}\r\n" for name, value in extra)
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n{own}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        conn.sock.setblocking(True)
        conn.sock.settimeout(max(0.05, conn.deadline_s - time.monotonic()))
        conn.sock.sendall(head + (b"" if method == "HEAD" else body))


def _parse_head(data: bytes) -> tuple[str, str, dict[str, str]] | None:
    lines = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1], headers


class MetricsServer:
    """A daemon component: serves `registry` on settings.listen until stopped."""

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry,
        bind_retry_s: float = BIND_RETRY_S,
        documents: Mapping[str, Callable[[], bytes]] | None = None,
        prover: Prover | None = None,
    ) -> None:
        """`documents`: JSON answers beside /metrics, by path (the peers' state, telemetry.peerdoc), under the same
        listener, TLS and limits. `prover`: the headers that prove a document answers a reader's nonce (the pair's
        key, common.peerproof), for a request that sends one; None: documents go unproven."""
        self.settings = settings
        self.registry = registry
        self.documents = dict(documents or {})
        self.prover = prover
        self.bind_retry_s = bind_retry_s
        self.port_in_use_total = 0  # binds refused because the address was taken
        self.port_in_use = False  # the address is taken now: this agent does not serve (sparkwatch_listen_port_in_use)
        self.holder = ""  # who holds it, as /proc tells (telemetry.sources.portholder)
        self.taken_since: float | None = None  # when a bind first found it taken (monotonic)
        self.taken_s = 0.0  # how long it was taken before this agent bound it
        self._server: BoundedHTTPServer | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._retry: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with listen port 0 in tests)."""
        if self._server is None:
            return self.settings.listen_port
        return int(self._server.server_address[1])

    @property
    def serving(self) -> bool:
        return self._server is not None

    def port_taken_s(self) -> float:
        """How long another process held this agent's port before it bound it (0: bound at once): exported as
        sparkwatch_listen_port_taken_seconds, so that the first scrape after the agent takes its port back says
        who answered for it meanwhile was not this agent."""
        if self.port_in_use and self.taken_since is not None:
            return time.monotonic() - self.taken_since
        return self.taken_s

    def counters(self) -> dict[str, int]:
        """What the endpoint closed unanswered and why, for sparkwatch_internal_errors_total: a rising count of
        evictions means something holds connections open (a scanner, a stuck scraper), timeouts a client too slow
        to take its answer, port_in_use another program holding the address at start."""
        counts = {"port_in_use": self.port_in_use_total}
        server = self._server
        if server is not None:
            counts["connections_evicted"] = server.evicted_total
            counts["request_timeouts"] = server.timeouts_total
            counts["connection_errors"] = server.errors_total
            counts["render_errors"] = server.render_errors_total
        return counts

    def ssl_context(self) -> ssl.SSLContext | None:
        s = self.settings
        if s.tls_cert_file is None or s.tls_key_file is None:
            return None
        import ssl  # noqa: PLC0415 - only where TLS is configured: ssl and libcrypto cost 5 MiB RSS (exporter/exposition.py)

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(str(s.tls_cert_file), str(s.tls_key_file))
        if s.tls_client_ca_file is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=str(s.tls_client_ca_file))
        return context

    def handle(self, method: str, path: str, headers: dict[str, str]) -> Answer:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"only GET\n"
        route = path.split("?", 1)[0]
        if route == "/favicon.ico":
            return 404, "text/plain; charset=utf-8", b"not found\n"
        document = self.documents.get(route)
        if document is not None:
            body = document()
            nonce = nonce_of(path) if self.prover is not None else None
            if self.prover is None or nonce is None:
                return 200, "application/json", body
            return 200, "application/json", body, self.prover(nonce, body)
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        return 200, content_type, encoder(self.registry)

    def start(self) -> None:
        """Serve, or, if the address is taken, keep trying every bind_retry_s on a thread of its own. Any other
        failure (TLS files, an address this host does not have) raises."""
        s = self.settings
        for warning in s.warnings():
            log.warning("WARNING %s", warning)
        self._stop.clear()
        if self._bind():
            return
        self._say_taken()
        self._retry = daemon_thread(self._keep_binding, "sparkwatch-metrics-bind")
        self._retry.start()

    def _say_taken(self) -> None:
        """Loudly, naming the holder: whoever holds the port answers as this node to its peers and to Prometheus
        (issue 37). Said at start and every TAKEN_SAY_S while it stays taken; doctor names it too."""
        from sparkwatch.telemetry.sources.portholder import describe, port_holders  # noqa: PLC0415

        s = self.settings
        try:
            _listening, holders = port_holders(s.proc_root, s.listen_port)
            self.holder = describe(holders)
        except OSError:
            self.holder = "a process /proc does not name"
        log.error(
            "ERROR metrics: %s is in use by %s, not this agent: it answers as this node to its peers and to Prometheus "
            "(peers with peer_key_file refuse its documents); trying again every %.0f s (alerts and checks run "
            "meanwhile; sparkwatch_listen_port_in_use 1, sparkwatch doctor names it)",
            s.listen,
            self.holder,
            self.bind_retry_s,
        )

    def _bind(self) -> bool:
        """True once serving; False while the address is in use."""
        s = self.settings
        try:
            server = BoundedHTTPServer(s.listen_host, s.listen_port, self.handle, self.ssl_context())
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            self.port_in_use_total += 1
            if self.taken_since is None:
                self.taken_since = time.monotonic()
            self.port_in_use = True
            return False
        if self.taken_since is not None:
            self.taken_s = time.monotonic() - self.taken_since
        self.port_in_use = False
        with self._lock:
            if self._stop.is_set():
                server.stop()
                return True
            server.start()
            self._server = server
        return True

    def _keep_binding(self) -> None:
        said = ""
        said_at = time.monotonic()
        while not self._stop.wait(self.bind_retry_s):
            try:
                if self._bind():
                    if not self._stop.is_set():
                        log.info("metrics on %s", self.settings.listen)
                    return
                if time.monotonic() - said_at >= TAKEN_SAY_S:
                    said_at = time.monotonic()
                    self._say_taken()
            except Exception as exc:  # e.g. the TLS files went away meanwhile: say so (once), keep trying
                if str(exc) != said:
                    said = str(exc)
                    log.error("ERROR metrics: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._retry is not None:
            self._retry.join(5)
            self._retry = None
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()
