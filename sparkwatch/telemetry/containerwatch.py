"""The containers on this node, kept current from the Docker Engine API (telemetry.sources.dockerapi): the facts of
every running container by id, and each container event handed on as it comes, to the parts that act on one (the
after-kill policy) through `subscribers`, and the word that the API answers through `on_up`, both passed in at
construction.

One thread: it opens the events stream, then lists the running containers (so none that starts in between is
missed), then reads events until the stream ends. Each event of a container is followed by one inspect of it. An idle
node costs nothing: the thread blocks in recv with no timeout. With no daemon (no socket, refused) it tries again
every `retry_s` (a connect to a unix socket: microseconds), and says so once, not at every try.

The facts of a container that stopped are kept (at most RECENT_MAX, the newest) so a kill line written after the
engine died still names its container.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from sparkwatch.common import logs
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.container import ContainerFacts
from sparkwatch.telemetry.sources.dockerapi import DockerApi, DockerApiError, DockerEvent, DockerEvents

log = logs.get("containers")

RECENT_MAX = 64
RETRY_S = 30.0

Subscriber = Callable[[DockerEvent, ContainerFacts | None], object]


class ContainerStore:
    """What the watch knows, for its readers in any thread: the running containers' facts by id, the lately stopped
    ones, and whether the daemon answers. Built first and handed to the watch (which writes it) and to the parts that
    read it (the after-kill policy), so construction goes one way: store, readers, then the watch with them as its
    subscribers."""

    def __init__(self) -> None:
        self.up = False  # the daemon answered and the events stream is open
        self._lock = threading.Lock()
        self._running: dict[str, ContainerFacts] = {}
        self._recent: OrderedDict[str, ContainerFacts] = OrderedDict()

    def facts(self, container_id: str) -> ContainerFacts | None:
        """A container's last known facts (running, or stopped lately), by full id."""
        with self._lock:
            return self._running.get(container_id) or self._recent.get(container_id)

    def running(self) -> tuple[ContainerFacts, ...]:
        with self._lock:
            return tuple(self._running.values())

    def replace(self, running: dict[str, ContainerFacts]) -> None:
        with self._lock:
            self._running = running

    def record(self, container_id: str, facts: ContainerFacts | None) -> None:
        """A container's facts after an event (None: removed)."""
        with self._lock:
            old = self._running.pop(container_id, None)
            if facts is not None and facts.state in ("running", "paused", "restarting"):
                self._running[container_id] = facts
            elif facts is not None or old is not None:
                self._recent[container_id] = facts or old  # type: ignore[assignment]
                self._recent.move_to_end(container_id)
                while len(self._recent) > RECENT_MAX:
                    self._recent.popitem(last=False)


class ContainerWatch:
    def __init__(
        self,
        socket_path: str | None,
        where: str,
        *,
        subscribers: Sequence[Subscriber] = (),
        retry_s: float = RETRY_S,
        store: ContainerStore | None = None,
        on_up: Sequence[Callable[[], object]] = (),
    ) -> None:
        """`socket_path`: the API's socket (None: none to read, `where` says why). `subscribers`: called from the
        watch's thread with each event and the container's facts after it (None once removed). `store`: where the
        facts are kept for readers built before the watch (a new one when none is given). `on_up`: called from the
        watch's thread each time the API answers (the store is `up`, the running containers listed), before any
        event: a reader that waits for the API is told, never left to look."""
        self.store = store if store is not None else ContainerStore()
        self.socket_path = socket_path
        self.where = where
        self.subscribers = tuple(subscribers)
        self.on_up = tuple(on_up)
        self.retry_s = retry_s
        self.api: DockerApi | None = None  # built once the events stream connected: no Docker, no HTTP client
        self.errors: dict[str, int] = {"unreachable": 0, "refused": 0, "timeout": 0, "broken": 0, "status": 0}
        self.events_total = 0
        self.error: str | None = None if socket_path else where
        self._stream: DockerEvents | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self.socket_path is None:
            log.info("containers: not read (%s)", self.where)
            return
        self._stop.clear()
        self._thread = daemon_thread(self._run, "sparkwatch-containers")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread is not None:
            self._thread.join(5)
        if self.api is not None:
            self.api.close()

    def counters(self) -> dict[str, int]:
        return {f"docker_errors_{k}": n for k, n in self.errors.items()}

    # --- what the others read (any thread) ---------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.store.up

    def facts(self, container_id: str) -> ContainerFacts | None:
        return self.store.facts(container_id)

    def running(self) -> tuple[ContainerFacts, ...]:
        return self.store.running()

    # --- the thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        said: str | None = None
        while not self._stop.is_set():
            try:
                self._follow()
            except DockerApiError as exc:
                self.errors[exc.kind] = self.errors.get(exc.kind, 0) + 1
                self.error = str(exc)
                if said != exc.kind:
                    # No socket at all is a node without Docker: said, not warned (it is looked for every retry_s)
                    absent = exc.kind == "unreachable" and not os.path.exists(self.socket_path or "")
                    level = logging.INFO if absent else logging.WARNING
                    log.log(level, "containers: the Docker API at %s does not answer: %s", self.where, exc)
                    said = exc.kind
            except Exception as exc:  # a bug: counted, said, survived
                self.errors["broken"] += 1
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("containers: watch failed: %s", self.error)
            else:
                said = None
            self.store.up = False
            self._stop.wait(self.retry_s)

    def _follow(self) -> None:
        assert self.socket_path is not None
        stream = self._stream = DockerEvents(self.socket_path)
        if self._stop.is_set():
            return
        stream.open()
        if self.api is None:
            self.api = DockerApi(self.socket_path)
        try:
            running: dict[str, ContainerFacts] = {}
            for cid in self.api.running_ids():
                facts = self.api.inspect(cid)
                if facts is not None:
                    running[cid] = facts
            self.store.replace(running)
            self.store.up, self.error = True, None
            log.info("containers: following the Docker API at %s (%d running)", self.where, len(running))
            for told in self.on_up:
                try:
                    told()
                except Exception as exc:  # one part's bug never stops the watch
                    log.error("containers: telling of the API up failed: %s: %s", type(exc).__name__, exc)
            for event in stream:
                self._on_event(event)
        finally:
            stream.close()
            self._stream = None

    def _on_event(self, event: DockerEvent) -> None:
        self.events_total += 1
        facts = None if event.action == "destroy" else self.api.inspect(event.id) if self.api else None
        self.store.record(event.id, facts)
        for subscriber in self.subscribers:
            try:
                subscriber(event, facts)
            except Exception as exc:  # one part's bug never stops the watch
                log.error("containers: %s on %s failed: %s: %s", event.action, event.id[:12], type(exc).__name__, exc)
