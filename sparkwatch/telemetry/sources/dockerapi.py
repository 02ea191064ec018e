"""The Docker Engine API on its unix socket: the containers, what each is (core.container.ContainerFacts), their
events as they happen, and the three acts telemetry may take on one (pause, unpause, kill). Podman's
Docker-compatible socket answers the same paths.

The socket is the `docker_host` setting when set, else `DOCKER_HOST`'s when it names a unix socket, else
/var/run/docker.sock (`docker_socket`). A `tcp://` DOCKER_HOST is refused in words: the API there is another
host's, or this one's without the socket's file permissions, and telemetry acts only on this node's containers.

The client is telemetry's own HTTP client (telemetry.sources.httpget: h11 on a socket), not the `docker` SDK (7.2):
the SDK's APIClient pulls in requests, urllib3 and ssl, +18.1 MiB of RSS (list, inspect, events stream) in a process
that already has h11, against +0.5 MiB for this module and the container watch; a whole idle telemetry process on a
Docker host is 0.6 MiB larger than without the watch, h11 included (bench/RESULTS-containers.md), for the five paths
used. Paths are
unversioned: the daemon answers them at its own API version (dockerd 20.10's 1.41 here; podman 4's compat API too).

The events stream is one long GET whose chunks are JSON lines; the reader blocks in recv with no timeout (an idle
box costs no wake-up), and `close` from another thread ends it (shutdown of the socket).

h11 (and httpget with it) is imported at the first exchange, after a connect succeeded: a node without Docker never
loads it, as a node without peers or Ray does not (tests/test_telemetry_imports.py).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from sparkwatch.core.container import ContainerFacts, facts_from_inspect

if TYPE_CHECKING:
    import h11

DEFAULT_SOCKET = "/var/run/docker.sock"
ANSWER_MAX_BYTES = 4 << 20  # a host with a few hundred containers lists well under 1 MiB
EVENT_LINE_MAX_BYTES = 64 << 10  # one event's JSON; a longer line is dropped, never parsed in pieces
READ_BYTES = 64 << 10
# The events telemetry follows: what changes a container's facts or tells it started, died or was paused.
EVENT_ACTIONS = ("create", "start", "restart", "die", "kill", "oom", "pause", "unpause", "rename", "update", "destroy")


class DockerApiError(Exception):
    """A failed exchange: `kind` is httpget's (timeout, refused, broken, unreachable) or `status` (an HTTP error)."""

    def __init__(self, kind: str, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


def docker_socket(configured: str, environ: Mapping[str, str] = os.environ) -> tuple[str | None, str]:
    """The socket path, and in words where it came from (or why there is none)."""
    if configured:
        path = configured.removeprefix("unix://")
        return path, f"docker_host = {configured}"
    host = environ.get("DOCKER_HOST", "")
    if host.startswith("unix://"):
        return host.removeprefix("unix://"), f"DOCKER_HOST={host}"
    if host:
        return None, f"DOCKER_HOST={host} is not a unix socket: containers are read only through this node's socket"
    return DEFAULT_SOCKET, f"the default {DEFAULT_SOCKET}"


@dataclass(frozen=True, slots=True)
class DockerEvent:
    """One container event: its action (start, die, …), the container's id, and its attributes (name, image,
    labels, exitCode for die, signal for kill)."""

    action: str
    id: str
    time_ns: int
    attributes: Mapping[str, str]


def parse_event(line: bytes) -> DockerEvent | None:
    """One line of the events stream; None for anything that is not a container event with a full id."""
    try:
        doc = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("Type") != "container":
        return None
    actor = doc.get("Actor") if isinstance(doc.get("Actor"), dict) else {}
    cid = actor.get("ID") if isinstance(actor, dict) else None
    action = doc.get("Action")
    if not isinstance(cid, str) or len(cid) != 64 or not isinstance(action, str):
        return None
    attrs = actor.get("Attributes") if isinstance(actor, dict) else None
    attributes = {str(k): str(v) for k, v in attrs.items()} if isinstance(attrs, dict) else {}
    time_ns = doc.get("timeNano")
    # exec_start: sh -c …, health_status: healthy: the action's own words after the colon are not needed here
    return DockerEvent(action.split(":", 1)[0], cid, time_ns if isinstance(time_ns, int) else 0, attributes)


class DockerApi:
    """Requests to one daemon. Each call is one bounded exchange (`timeout_s`); a failure raises DockerApiError."""

    def __init__(self, socket_path: str, timeout_s: float = 3.0) -> None:
        from sparkwatch.telemetry.sources.httpget import HttpGet  # noqa: PLC0415 - h11: a node with Docker only

        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._client = HttpGet("docker", 80, unix_path=socket_path, keep_alive=True)

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str) -> tuple[int, bytes]:
        from sparkwatch.telemetry.sources.httpget import HttpGetError  # noqa: PLC0415 - loaded by __init__ already

        try:
            if method == "GET":
                status, body, cut = self._client.get(path, self.timeout_s, ANSWER_MAX_BYTES)
            else:
                status, body, cut = self._client.post(path, self.timeout_s, ANSWER_MAX_BYTES)
        except HttpGetError as exc:
            raise DockerApiError(exc.kind, f"{self.socket_path}: {exc}") from None
        if cut:
            raise DockerApiError("broken", f"{method} {path}: answer over {ANSWER_MAX_BYTES} bytes")
        return status, body

    def _json(self, path: str) -> object:
        status, body = self._call("GET", path)
        if status != 200:
            raise DockerApiError("status", f"GET {path}: HTTP {status}: {_message(body)}", status)
        try:
            return json.loads(body)
        except ValueError:
            raise DockerApiError("broken", f"GET {path}: not JSON") from None

    def ping(self) -> None:
        status, body = self._call("GET", "/_ping")
        if status != 200:
            raise DockerApiError("status", f"GET /_ping: HTTP {status}: {_message(body)}", status)

    def running_ids(self) -> list[str]:
        """The ids of the running (and paused, and restarting) containers."""
        doc = self._json("/containers/json")
        return (
            [c["Id"] for c in doc if isinstance(c, dict) and isinstance(c.get("Id"), str)]
            if isinstance(doc, list)
            else []
        )

    def inspect(self, container: str) -> ContainerFacts | None:
        """One container's facts; None when the daemon knows no such container (removed)."""
        try:
            doc = self._json(f"/containers/{quote(container, safe='')}/json")
        except DockerApiError as exc:
            if exc.status == 404:
                return None
            raise
        return facts_from_inspect(doc) if isinstance(doc, dict) else None

    def _act(self, container: str, verb: str, query: str = "") -> None:
        path = f"/containers/{quote(container, safe='')}/{verb}{query}"
        status, body = self._call("POST", path)
        if status not in (200, 204, 304):  # 304: already in that state
            raise DockerApiError("status", f"POST {path}: HTTP {status}: {_message(body)}", status)

    def pause(self, container: str) -> None:
        """Freeze every process of the container (the cgroup freezer): nothing runs, nothing is freed."""
        self._act(container, "pause")

    def unpause(self, container: str) -> None:
        self._act(container, "unpause")

    def kill(self, container: str) -> None:
        """SIGKILL through the API, which also cancels a pending restart (moby marks the container stopped by the
        owner): unlike a kill from outside, the policy does not start it again."""
        self._act(container, "kill", "?signal=KILL")


def _message(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return body[:200].decode(errors="replace")
    return str(doc.get("message", ""))[:200] if isinstance(doc, dict) else ""


class DockerEvents:
    """The daemon's container events, from `open()` on, as an iterator. Blocks between events; `close()` from
    another thread ends the iteration (the socket is shut down under the reader). One stream per object."""

    def __init__(self, socket_path: str, connect_timeout_s: float = 3.0) -> None:
        self.socket_path = socket_path
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._conn: h11.Connection | None = None
        self._closed = False

    def close(self) -> None:
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def open(self) -> None:
        """Connect and ask for the container events from now on. Raises DockerApiError. Open before listing the
        containers, so none that starts in between is missed: its event waits in the socket."""
        filters = quote(json.dumps({"type": ["container"], "event": list(EVENT_ACTIONS)}), safe="")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout_s)
            sock.connect(self.socket_path)
            import h11  # noqa: PLC0415 - only once a daemon answered the connect

            conn = h11.Connection(our_role=h11.CLIENT)
            request = h11.Request(method="GET", target=f"/events?filters={filters}", headers=[("Host", "docker")])
            sock.sendall((conn.send(request) or b"") + (conn.send(h11.EndOfMessage()) or b""))
            sock.settimeout(None)  # events come when they come: no wake-up in between
        except OSError as exc:
            sock.close()
            raise DockerApiError("unreachable", f"{self.socket_path}: {exc.strerror or exc}") from None
        self._sock, self._conn = sock, conn
        if self._closed:
            self.close()

    def __iter__(self) -> Iterator[DockerEvent]:
        """Each event as it comes (after `open`). Raises DockerApiError on a refusal or a broken stream; ends when
        the daemon closes the stream or `close` was called."""
        sock, conn = self._sock, self._conn
        if sock is None or conn is None:
            return
        import h11  # noqa: PLC0415 - loaded by open already

        pending = b""
        try:
            while not self._closed:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = sock.recv(READ_BYTES)
                    except OSError:
                        return
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Response):
                    if event.status_code != 200:
                        raise DockerApiError("status", f"GET /events: HTTP {event.status_code}", event.status_code)
                elif isinstance(event, h11.Data):
                    pending += event.data
                    *lines, pending = pending.split(b"\n")
                    if len(pending) > EVENT_LINE_MAX_BYTES:
                        pending = b""
                    for line in lines:
                        parsed = parse_event(line) if line.strip() else None
                        if parsed is not None:
                            yield parsed
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return
        except h11.ProtocolError as exc:
            raise DockerApiError("broken", f"GET /events: {exc}") from None
        finally:
            self._sock, self._conn = None, None
            sock.close()


class ContainerLookup:
    """The facts of the containers a command's engine trees run in, read through the API itself (`sparkwatch engines`,
    `status`): no daemon needed. A container once read is kept for `fresh_s`; a socket that cannot be read (absent,
    permission denied: the socket is root's and the docker group's) leaves the containers named by id only, and `note`
    says why in one line; it is tried again after `fresh_s`."""

    def __init__(self, configured: str, environ: Mapping[str, str] = os.environ, fresh_s: float = 10.0) -> None:
        self.path, self.where = docker_socket(configured, environ)
        self.fresh_s = fresh_s
        self.note: str | None = None if self.path else f"containers named by id only: {self.where}"
        self._facts: dict[str, tuple[float, ContainerFacts | None]] = {}
        self._failed_at: float | None = None

    def lookup(self, ids: Iterable[str]) -> dict[str, ContainerFacts]:
        """The facts of these containers (by full id) that the API gave; the others are left out."""
        import time  # noqa: PLC0415 - the daemon never builds one

        now = time.monotonic()
        wanted = sorted(set(ids))
        stale = [i for i in wanted if i not in self._facts or now - self._facts[i][0] >= self.fresh_s]
        can_ask = self.path is not None and (self._failed_at is None or now - self._failed_at >= self.fresh_s)
        if stale and can_ask and self.path is not None:
            api = DockerApi(self.path, timeout_s=2.0)
            try:
                for cid in stale:
                    self._facts[cid] = (now, api.inspect(cid))
                self.note, self._failed_at = None, None
            except DockerApiError as exc:
                self._failed_at = now
                self.note = f"containers named by id only: the Docker API at {self.where} does not answer ({exc})"
            finally:
                api.close()
        return {i: facts for i in wanted if (got := self._facts.get(i)) is not None and (facts := got[1]) is not None}
