"""The commands' own read of the other nodes' agents (`peers`): `status`, `doctor` and `launch` (issue 39).

Each configured peer's document is read once (`GET /peer/v1/state`), all peers at once, each bounded in time
(`timeout_s`, a second by default) and size, through the peer watch's own read (telemetry.peerwatch.fetch): with
`peer_key_file` a fresh nonce goes with each read and the answer's proof must hold (a document that fails it is
refused, as the agent refuses it); an `https://` peer is read under the same TLS rules. Nothing is recorded and no
thread outlives the read: telemetry's running watch (its loss rule, its events) is the agent's, not a command's.

Without peers nothing is read and nothing of this is imported (status --once stays fast).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkwatch.common import peerproof
from sparkwatch.common.peeraddr import parse_peer
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.report.peerchecks import PeerView
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.peerwatch import PEER_TIMEOUT_S, PeerError, fetch, load_key, tls_context

if TYPE_CHECKING:
    import ssl

    from sparkwatch.config.settings import Settings


@dataclass(frozen=True)
class PeerReading:
    """One peer's agent as a command read it: its document, or why there is none."""

    label: str  # as configured
    doc: peerdoc.PeerDoc | None
    error: str | None = None  # why no document was taken (its kind first: refused, timeout, bad_proof, …)
    proof: str | None = None  # how its word is proven: "key", "mtls"; None: display-only
    taken: float | None = None  # wall time its document was taken

    @property
    def proven(self) -> bool:
        return self.doc is not None and self.proof is not None


def read_peers(settings: Settings, timeout_s: float = PEER_TIMEOUT_S) -> list[PeerReading]:
    """One read of each peer in `settings.peers`, all at once, each within `timeout_s`: in the configured order."""
    if not settings.peers:
        return []
    key = load_key(settings)
    mtls = peerproof.mtls_of(settings)
    context: list[ssl.SSLContext] = []

    def tls() -> ssl.SSLContext:
        if not context:  # one context for all the https:// peers (built in the first read that needs it)
            context.append(tls_context(settings))
        return context[0]

    out: list[PeerReading | None] = [None] * len(settings.peers)

    def read(i: int, label: str) -> None:
        scheme, host, port = parse_peer(label)
        proof = peerproof.proof_kind(scheme, key is not None, mtls)
        try:
            doc, _body = fetch(scheme, host, port, timeout_s, key=key, tls=tls)
        except PeerError as exc:
            out[i] = PeerReading(label, None, f"{exc.kind}: {peerdoc.clean(str(exc))}", proof)
            return
        except Exception as exc:  # a TLS file gone bad since validation: said, never fatal to the command
            out[i] = PeerReading(label, None, f"{type(exc).__name__}: {peerdoc.clean(str(exc))}", proof)
            return
        out[i] = PeerReading(label, doc, None, proof, time.time())

    threads = [daemon_thread(read, "sparkwatch-peerread", i, p) for i, p in enumerate(settings.peers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 1.0  # the client's own bound, and a margin for the TLS handshake
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    return [
        r if r is not None else PeerReading(label, None, f"timeout: no answer in {timeout_s:g} s")
        for label, r in zip(settings.peers, out, strict=True)
    ]


def view(reading: PeerReading, now: float, last: PeerReading | None = None) -> PeerView:
    """`reading` as status and doctor show it; `last`: this peer's last reading that took a document (status keeps
    it), shown with its age when this one took none."""
    shown = reading if reading.doc is not None or last is None else last
    doc = shown.doc
    age = None if shown.taken is None else now - shown.taken
    if doc is None:
        return PeerView(reading.label, reading.proof, reading.error)
    groups = None if doc.groups is None else tuple(f"{peerdoc.clean(m.key)} rank {m.node_rank}" for m in doc.groups)
    return PeerView(
        label=reading.label,
        proof=shown.proof,
        error=reading.error,
        node=peerdoc.clean(doc.node),
        age_s=age,
        mem_available_bytes=doc.mem_available_bytes,
        engines=len(doc.engines),
        groups=groups,
        ray_nodes=len(doc.ray_node_ids),
    )


class PeerBoard:
    """The live status's peers: read again every `interval_s` on a thread of its own (a frame never waits on a
    peer), each peer's last document kept with the time it was taken."""

    def __init__(
        self,
        settings: Settings,
        interval_s: float,
        timeout_s: float = PEER_TIMEOUT_S,
        reader: Callable[[Settings, float], list[PeerReading]] = read_peers,
    ) -> None:
        self.settings = settings
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.reader = reader
        self._latest: list[PeerReading] = []
        self._answered: dict[str, PeerReading] = {}
        self._first = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = daemon_thread(self._run, "sparkwatch-peerboard")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            readings = self.reader(self.settings, self.timeout_s)
            with self._lock:
                self._latest = readings
                self._answered.update({r.label: r for r in readings if r.doc is not None})
            self._first.set()
            self._stop.wait(self.interval_s)

    def views(self, wait_s: float = 0.0) -> tuple[PeerView, ...]:
        """The peers as last read (waiting up to `wait_s` for the first read); empty before it."""
        self._first.wait(wait_s)
        with self._lock:
            latest, answered = list(self._latest), dict(self._answered)
        now = time.time()
        return tuple(view(r, now, answered.get(r.label)) for r in latest)

    def close(self) -> None:
        self._stop.set()


def views(readings: Sequence[PeerReading]) -> tuple[PeerView, ...]:
    now = time.time()
    return tuple(view(r, now) for r in readings)
