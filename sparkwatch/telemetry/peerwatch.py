"""The other nodes' agents (config `peers`): their state, read every `peer_poll_s`, and `peer_lost` when one stops
giving a document (issue 29; docs/multinode.md).

Each peer is another node's sparkwatch, reached on the endpoint it already serves (`GET /peer/v1/state` beside
/metrics, telemetry.peerdoc), under the same TLS rules: an `https://` peer is verified against `tls_client_ca_file`
and, where this node has a certificate (`tls_cert_file`), shown it (the peer may require it: mTLS). One short
connection a read (telemetry.sources.httpget), bounded in time (PEER_TIMEOUT_S) and size (peerdoc.MAX_DOC_BYTES).

Proven or display-only (issue 37). A peer's word moves the guard only when its document is proven:
- with `peer_key_file` set, every read sends a fresh nonce and the answer must carry the key's proof over this
  node's nonce, the peer's node name and the body (common.peerproof). A document that fails its proof is not the
  peer's, whoever holds its port: it is refused (`bad_proof`, said once per change in the log) and counts as no
  answer;
- without a key, an `https://` peer verified against `tls_client_ca_file` (a CA the owner made, pinned: never the
  system store) with this node's own certificate shown (mutual TLS) is proven by the channel;
- any other peer is display-only: its memory and raylets show (status, launch's plan), and nothing it says moves
  anything: no teardown (telemetry.mpwatch skips it), no worker budget, no kill word, no `torn_down` or `ray_gone`.

What a proven peer says:
- the group watch (telemetry.raywatch) asks `kill_word(node_id, pid)` when a group's member died on a peer's node:
  the peer guard's own line when it killed it ("killed by sparkwatch on spark-b: budget: …"), for this node's
  `group_teardown` event and the launch that started the engine here;
- a peer that gave a document and then gives none is lost, recorded once as `peer_lost` with what it last said
  (MemAvailable, its engine trees, its last kill), and `peer_back` when it gives one again. Lost: PEER_LOST_AFTER
  reads in a row without any answer (each read timed out, or its host unreachable: the node is wedged, down or cut
  off), or no document taken for `peer_lost_after_s`, whatever the answers were (refused, an HTTP error, a bad
  document or a bad proof). The second is the witness rule (issue 37, item 4): `peer_lost_after_s` (30 s by
  default) is longer than an agent's restart (systemd's RestartSec=2s and the start, ~3 s: docs/multinode.md), so a
  restart is never a loss; a port that refuses or answers unproven for longer is;
- for engine groups without Ray (telemetry.mpwatch, after each read of the peers): a peer's member of a group this
  node also runs that it no longer lists, or the peer lost, ends the group here. That is a reason to look at this
  node's own members, never to signal anything else: the guard kills only processes whose own command line names
  the group's rendezvous, in its own network namespace, with the pid and start time named.
For Ray's groups a slow or unreachable peer never decides a kill: the group watch tears a group down on Ray's word
that a member died, or on the word of the agent of the member's own node that its process ended (`ray_gone`), and
the guard checks this node's members again on its own /proc.

An unchanged body (the same bytes as the document taken last) is not parsed again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparkwatch.common import logs, peerproof
from sparkwatch.common.eventlog import make_event
from sparkwatch.common.peeraddr import parse_peer
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import Event
from sparkwatch.core.units import format_size
from sparkwatch.core.words import plural
from sparkwatch.telemetry import peerdoc

if TYPE_CHECKING:
    import ssl

    from sparkwatch.config.settings import Settings

log = logs.get("peers")
PEER_TIMEOUT_S = 1.0  # one read of a peer on the same switch answers in milliseconds
ACCEPT = (("Accept", "application/json"),)
WORD_TIMEOUT_S = 0.5  # a read for a kill's word, on the group watch's thread: a teardown waits at most this
PEER_LOST_AFTER = 3  # reads in a row without an answer: one slow read of a busy peer is not a lost node
ERROR_KINDS = ("refused", "unreachable", "timeout", "http", "bad_answer", "bad_proof")
# Only these say nothing answered on the peer's host: lost after PEER_LOST_AFTER reads. Any other failure is lost
# after `peer_lost_after_s` without a document taken ("refused": its kernel answering that no agent listens, stopped
# or restarting; "http", "bad_answer": something answering that is not a peer agent; "bad_proof": not the peer's).
SILENT_KINDS = frozenset({"unreachable", "timeout"})
KEY, MTLS = "key", "mtls"  # how a peer's document is proven (PeerWatch.proof)


class PeerError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Peer:
    label: str  # as configured (host:port or a URL), for events and logs
    scheme: str
    host: str
    port: int
    doc: peerdoc.PeerDoc | None = None  # its last document taken: proven, or display-only (`proven` says which)
    proven: bool = False
    last_ok_wall: float | None = None
    last_ok_mono: float | None = None  # when its last document was taken: peer_lost_after_s counts from it
    failures: int = 0  # reads in a row that nothing answered (SILENT_KINDS)
    lost: bool = False
    last_error: str | None = None
    body: bytes | None = None  # the body of `doc`: the same bytes again are not parsed again
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, slots=True)
class PeerState:
    """A peer as the exporter shows it (telemetry.exporter.peermetric)."""

    peer: str  # as configured
    node: str  # the name it last gave
    lost: bool
    proven: bool = True  # False: display-only (no peer_key_file, no mutual TLS)


class PeerWatch:
    LIVE_KEYS = frozenset({"peer_poll_s"})

    def __init__(
        self,
        settings: Settings,
        record: Callable[[Event], object],
        wall_clock: Callable[[], float] = time.time,
        after_poll: Callable[[list[Peer]], object] = lambda peers: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`record`: where `peer_lost` and `peer_back` go (the telemetry process's event log). `after_poll`: called
        with the peers after each read of them all (telemetry.mpwatch.MpGroupWatch.observe)."""
        self.settings = settings
        self.record = record
        self.after_poll = after_poll
        self.wall_clock = wall_clock
        self.clock = clock
        self.key = load_key(settings)
        self.peers = [Peer(p, *parse_peer(p)) for p in settings.peers]
        self.errors: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        self.lost_total = 0
        self._context: ssl.SSLContext | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.peers:
            return
        line, display_only = peerproof.settings_line(self.settings)
        (log.warning if display_only else log.info)("%s", line)
        self._stop.clear()
        self._thread = daemon_thread(self._run, "sparkwatch-peers")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def apply(self, settings: Settings) -> frozenset[str]:
        self.settings = settings
        return self.LIVE_KEYS

    def counters(self) -> dict[str, int]:
        return {**{f"peer_errors_{k}": n for k, n in self.errors.items()}, "peers_lost": self.lost_total}

    def view(self) -> tuple[PeerState, ...]:
        """The peers that answered once, whether each is lost now and proven. Called from the scrape's thread."""
        return tuple(PeerState(p.label, p.doc.node, p.lost, p.proven) for p in self.peers if p.doc is not None)

    def proof(self, peer: Peer) -> str | None:
        """How `peer`'s documents are proven: KEY (peer_key_file), MTLS (an https:// peer, the pinned client CA and
        this node's certificate), or None: display-only."""
        return peerproof.proof_kind(peer.scheme, self.key is not None, peerproof.mtls_of(self.settings))

    def _proven(self, peer: Peer) -> peerdoc.PeerDoc | None:
        """`peer`'s last document when proven: the only one whose word moves anything."""
        return peer.doc if peer.proven else None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # a bug: counted, said, survived
                self.errors["bad_answer"] += 1
                log.error("peer watch failed: %s: %s", type(exc).__name__, exc)
            self._stop.wait(self.settings.peer_poll_s)

    def poll_once(self) -> None:
        for peer in self.peers:
            self._read(peer, PEER_TIMEOUT_S)
        self.after_poll(self.peers)

    def kill_word(self, node_id: str, pid: int | None) -> str | None:
        """The word of the peer whose raylet serves `node_id` on `pid`, when its guard killed it. A peer's last
        document that does not say so yet (its guard records a kill ~0.1 s after the signal; a peer that has not
        found its raylet yet names no node) is read again once, within WORD_TIMEOUT_S. Only the peer that names
        `node_id` is believed: pids repeat across machines. None: no such peer, or its guard did not kill it."""
        for peer in self._candidates(node_id):
            doc = self._proven(peer)
            if doc is not None and node_id in doc.ray_node_ids:
                word = peerdoc.kill_word(doc, pid)
                if word is not None:
                    return word
            if self._read(peer, WORD_TIMEOUT_S) and (doc := self._proven(peer)) and node_id in doc.ray_node_ids:
                return peerdoc.kill_word(doc, pid)
        return None

    def torn_down(self, node_id: str) -> frozenset[int]:
        """The pids the peer whose raylet serves `node_id` stopped as a group teardown (read again first, within
        WORD_TIMEOUT_S): a consequence of another member's death, never its cause. Empty when no peer says so."""
        for peer in self._candidates(node_id):
            self._read(peer, WORD_TIMEOUT_S)
            doc = self._proven(peer)
            if doc is not None and node_id in doc.ray_node_ids:
                return frozenset(pid for k in doc.kills if k.trigger == "group_teardown" for pid in k.pids)
        return frozenset()

    def ray_gone(self, node_id: str) -> frozenset[int]:
        """The pids of the Ray ranks on `node_id` that its own agent (the peer that names that node) says ended, from
        its last document: no read here (the peer watch reads every `peer_poll_s`, and wakes the group watch when
        one says so). A reason to look, never to kill: the guard checks this node's own members."""
        for peer in self._candidates(node_id):
            doc = self._proven(peer)
            if doc is not None and node_id in doc.ray_node_ids:
                return peerdoc.ray_gone(doc, node_id)
        return frozenset()

    def ray_state(self, gcs_addresses: frozenset[str]) -> peerdoc.RayRelay | None:
        """Ray's state as relayed by the proven peer that heads a cluster whose GCS this node's raylets name
        (peerdoc.RayRelay), from its last document: no read here (the peer watch reads every `peer_poll_s`, and wakes
        the group watch when a relay changes). None: no proven peer relays it, and Ray's state of that host moves
        nothing here."""
        for peer in self.peers:
            doc = self._proven(peer)
            if doc is not None and doc.ray is not None and doc.ray.gcs_address in gcs_addresses:
                return doc.ray
        return None

    def worker_budgets(self) -> list[peerdoc.WorkerBudget]:
        """The worker budgets each peer's last document says its launches gave (telemetry.peerdoc `budgets`), each
        with the Ray nodes that peer serves: a budget binds only a group whose driver runs there."""
        out = []
        for peer in self.peers:
            doc = self._proven(peer)
            if doc is not None and doc.ray_node_ids:
                nodes = frozenset(doc.ray_node_ids)
                out += [
                    peerdoc.WorkerBudget(b.group, b.budget_bytes, b.uid, nodes)
                    for b in doc.budgets
                    if b.budget_bytes > 0
                ]
        return out

    def _candidates(self, node_id: str) -> Iterator[Peer]:
        """The peers that may be the agent of the node `node_id`: those whose last document names it, or names no
        node yet (not read yet, or its raylet not found yet); never another node's agent, nor a display-only peer."""
        for peer in self.peers:
            if self.proof(peer) is None:
                continue
            doc = peer.doc
            if doc is None or not doc.ray_node_ids or node_id in doc.ray_node_ids:
                yield peer

    def _read(self, peer: Peer, timeout_s: float) -> bool:
        with peer.lock:
            proof = self.proof(peer)
            last = (peer.body, peer.doc) if peer.body is not None and peer.doc is not None else None
            try:
                doc, body = fetch(peer.scheme, peer.host, peer.port, timeout_s, key=self.key, tls=self._tls,
                                  last=last)  # fmt: skip
            except PeerError as exc:
                self._failed(peer, exc.kind, str(exc))
                return False
            was_lost = peer.lost
            peer.doc, peer.body, peer.proven = doc, body, proof is not None
            peer.failures, peer.lost, peer.last_error = 0, False, None
            peer.last_ok_wall, peer.last_ok_mono = self.wall_clock(), self.clock()
        if was_lost:
            log.info("peer %s (%s) answers again", peer.label, doc.node)
            self.record(make_event(EventKind.PEER_BACK, f"peer {doc.node} ({peer.label}) answers again",
                                   {"peer": peer.label, "node": doc.node}))  # fmt: skip
        return True

    def _failed(self, peer: Peer, kind: str, message: str) -> None:
        """Under the peer's lock."""
        self.errors[kind] = self.errors.get(kind, 0) + 1
        peer.failures = peer.failures + 1 if kind in SILENT_KINDS else 0
        if message != peer.last_error:
            log.warning("peer %s: %s", peer.label, peerdoc.clean(message))
            peer.last_error = message
        if peer.lost or peer.doc is None:
            return
        since = None if peer.last_ok_mono is None else self.clock() - peer.last_ok_mono
        if peer.failures >= PEER_LOST_AFTER or (since is not None and since >= self.settings.peer_lost_after_s):
            peer.lost = True
            self.lost_total += 1
            self.record(lost_event(peer, self.wall_clock()))

    def _tls(self) -> ssl.SSLContext:
        if self._context is None:
            self._context = tls_context(self.settings)
        return self._context


def fetch(
    scheme: str,
    host: str,
    port: int,
    timeout_s: float,
    *,
    key: bytes | None,
    tls: Callable[[], ssl.SSLContext],
    last: tuple[bytes, peerdoc.PeerDoc] | None = None,
) -> tuple[peerdoc.PeerDoc, bytes]:
    """One read of a peer's document and its body: with the pair's `key`, a fresh nonce sent and the answer's proof
    over it checked (common.peerproof); `tls` makes the context of an https:// peer (tls_context). A body equal to
    `last`'s is not parsed again. Raises PeerError (its kind one of ERROR_KINDS). The peer watch's read, and the
    commands' (cli.peerread)."""
    nonce = peerproof.new_nonce() if key is not None else None
    body, headers = _get(scheme, host, port, timeout_s, tls=tls, nonce=nonce)
    try:
        node = None
        if nonce is not None:
            assert key is not None
            node = peerproof.check(key, nonce, body, headers)
        doc = last[1] if last is not None and body == last[0] else peerdoc.parse(body)
        if node is not None and node != doc.node:
            raise peerproof.ProofError("its proof is for another node than its document names")
    except peerproof.ProofError as exc:
        raise PeerError("bad_proof", f"not proven, refused: {exc}") from None
    except ValueError as exc:
        raise PeerError("bad_answer", str(exc)) from None
    return doc, body


def _get(
    scheme: str, host: str, port: int, timeout_s: float, *, tls: Callable[[], ssl.SSLContext], nonce: str | None
) -> tuple[bytes, dict[str, str]]:
    from sparkwatch.telemetry.sources.httpget import HttpGet, HttpGetError  # noqa: PLC0415  (a node with peers)

    client = HttpGet(host, port, tls=tls if scheme == "https" else None, headers=ACCEPT)
    path = peerdoc.PATH if nonce is None else f"{peerdoc.PATH}?{peerproof.NONCE_PARAM}={nonce}"
    try:
        status, body, cut = client.get(path, timeout_s, peerdoc.MAX_DOC_BYTES)
    except HttpGetError as exc:
        if exc.kind == "refused":
            raise PeerError("refused", f"{exc}: its host answers, no agent") from None
        if exc.kind == "broken":  # something answered: a certificate it refused is not a silent node
            raise PeerError("bad_answer", str(exc)) from None
        raise PeerError(exc.kind, str(exc)) from None
    if status != 200:
        raise PeerError("http", f"HTTP {status} (an agent older than peers, or not sparkwatch?)")
    if cut:
        raise PeerError("bad_answer", f"larger than {peerdoc.MAX_DOC_BYTES} bytes")
    return body, client.last_headers


def tls_context(settings: Settings) -> ssl.SSLContext:
    """The context an https:// peer is read under: verified against `tls_client_ca_file`, this node's certificate
    shown where it has one (the peer may require it: mTLS)."""
    import ssl  # noqa: PLC0415

    s = settings
    context = ssl.create_default_context(cafile=str(s.tls_client_ca_file) if s.tls_client_ca_file else None)
    if s.tls_cert_file is not None and s.tls_key_file is not None:
        context.load_cert_chain(str(s.tls_cert_file), str(s.tls_key_file))
    return context


def load_key(settings: Settings) -> bytes | None:
    """The pair's key (`peer_key_file`), or None: unset, or not this user's to read (a user's `launch` with root's
    key: its peers are display-only, said once). A key file that went wrong since validation is said, never fatal."""
    path = settings.peer_key_file
    if path is None:
        return None
    try:
        return peerproof.read_key(path)
    except peerproof.PeerKeyError as exc:
        log.error("ERROR peers: peer_key_file: %s: the peers are display-only", exc)
        return None


def lost_event(peer: Peer, now: float) -> Event:
    """`peer_lost`: what the peer last said, for the human who looks at the survivor."""
    doc = peer.doc
    assert doc is not None
    ago = None if peer.last_ok_wall is None else round(now - peer.last_ok_wall, 1)
    last_kill = doc.kills[-1] if doc.kills else None
    mem = "MemAvailable unknown" if doc.mem_available_bytes is None else (
        f"MemAvailable {format_size(doc.mem_available_bytes)}")  # fmt: skip
    how = "stopped answering" if peer.failures >= PEER_LOST_AFTER else f"gave no document ({peer.last_error})"
    summary = (
        f"peer {doc.node} ({peer.label}) {how}: last seen {ago} s ago with {mem}, "
        f"{plural(len(doc.engines), 'engine tree')}"
        + (f"; its last kill: {last_kill.trigger}: {last_kill.summary}" if last_kill is not None else "")
    )
    fields: dict[str, object] = {
        "peer": peer.label,
        "node": doc.node,
        "last_seen_s_ago": ago,
        "error": peer.last_error,
        "mem_available_bytes": doc.mem_available_bytes,
        "engines": [{"root_pid": e.root_pid, "engine": e.engine, "rss_bytes": e.rss_bytes} for e in doc.engines],
        "ray_node_ids": list(doc.ray_node_ids),
        "last_kill": None
        if last_kill is None
        else {"ts": last_kill.ts, "trigger": last_kill.trigger, "summary": last_kill.summary},
    }
    return make_event(EventKind.PEER_LOST, peerdoc.clean(summary), fields)
