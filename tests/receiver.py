"""A real webhook receiver on 127.0.0.1 (http.server in a thread) that can go down, answer 500 or any status,
redirect or hang."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Delivery:
    event_id: str
    signature: str | None
    body: bytes
    path: str

    @property
    def payload(self) -> dict[str, object]:
        data = json.loads(self.body)
        assert isinstance(data, dict)
        return data

    def signature_ok(self, secret: bytes) -> bool:
        want = "sha256=" + hmac.new(secret, self.body, hashlib.sha256).hexdigest()
        return self.signature is not None and hmac.compare_digest(want, self.signature)


class Receiver:
    """mode: 'ok' (204), '500', 'redirect' (302 to `redirect_to`), 'hang' (never answers), 'slow_body' (200, then
    its body at 2 bytes a second), 'answer' (`answer_status`, no body). Whatever the mode, a POST whose event id is
    in `reject_ids` is answered 400."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self.mode = "ok"
        self.redirect_to = ""
        self.answer_status = 204
        self.reject_ids: set[str] = set()
        self.deliveries: list[Delivery] = []  # the POSTs answered in mode "ok" (204), none of the others
        self.requests_total = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._hang = threading.Event()

    @property
    def url_base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    receiver.requests_total += 1
                    mode, status = receiver.mode, receiver.answer_status
                    if self.headers.get("X-Sparkwatch-Event-Id", "") in receiver.reject_ids:
                        mode, status = "answer", 400
                if mode == "hang":
                    receiver._hang.wait(30)
                    return
                if mode == "answer":
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if mode == "500":
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"internal error")
                    return
                if mode == "slow_body":  # 200 and a body one byte every half second: a per-read timeout never trips
                    self.send_response(200)
                    self.send_header("Content-Length", "120")
                    self.end_headers()
                    for _ in range(120):
                        if receiver._hang.wait(0.5):
                            return
                        try:
                            self.wfile.write(b"x")
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                if mode == "redirect":
                    self.send_response(302)
                    self.send_header("Location", receiver.redirect_to)
                    self.end_headers()
                    return
                with receiver._lock:
                    receiver.deliveries.append(
                        Delivery(
                            self.headers.get("X-Sparkwatch-Event-Id", ""),
                            self.headers.get("X-Sparkwatch-Signature"),
                            body,
                            self.path,
                        )
                    )
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._hang.clear()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Down: the port refuses connections until start() again (same port)."""
        self._hang.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def ids(self) -> list[str]:
        with self._lock:
            return [d.event_id for d in self.deliveries]


class GarbageServer:
    """Speaks something that is not HTTP (an SSH banner, as when the URL names the wrong port)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(1)
                try:
                    conn.recv(65536)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n\x00\x00garbage")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()
