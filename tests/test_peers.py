"""The other nodes' agents (`peers`, issue 29): what a node tells its peers, and what it makes of theirs.

Against real HTTP on loopback: a peer that serves a document, refuses (its agent stopped: never lost), goes quiet
(`peer_lost`, once, with what it last said) and comes back (`peer_back`); the peer guard's word on a pid it killed;
a document of another shape refused whole; secrets in a peer's words redacted. The document a real daemon serves is
parsed by the same reader. The two-node case (node B's guard kills a rank, node A's event carries its word) is in
tests/test_ray_group.py.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sparkwatch.common import peerproof
from sparkwatch.common.messages import GroupTeardownMsg
from sparkwatch.common.peeraddr import parse_peer
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.common.stats import RecentKill
from sparkwatch.config.settings import ConfigError, load_settings
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill import mpgroup
from sparkwatch.core.model import EngineTree, Event, MemInfo, Proc
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.mpwatch import MpGroupWatch
from sparkwatch.telemetry.peerwatch import PEER_LOST_AFTER, PeerWatch
from tests.daemon import free_port, scrape, sparkwatch_run
from tests.helpers.peerkey import key_file, key_of

GiB = 1 << 30
TOKEN = "hf_" + "A1b2C3d4E5f6G7h8I9j0K1"  # a Hugging Face token's shape (core.redact), never a real one


def recent(pid: int, trigger: str = "budget", reason: str = "") -> RecentKill:
    """A kill as the guard remembers it at the signal (guard.killpath -> common.stats.RecentKill)."""
    return RecentKill(
        1764824400.0, trigger, reason or "footprint 602 MiB (rss) over its budget 64.0 MiB (config)", (pid,)
    )


def doc_bytes(kills: tuple[peerdoc.PeerKill, ...] = (), node_ids: tuple[str, ...] = ("b" * 56,)) -> bytes:
    mem = MemInfo(
        total_bytes=128 * GiB,
        free_bytes=50 * GiB,
        available_bytes=52 * GiB,
        cached_bytes=2 * GiB,
        buffers_bytes=0,
        swap_total_bytes=0,
        swap_free_bytes=0,
    )
    return peerdoc.build("spark-b", node_ids, mem, (), kills)


class Peer:
    """A peer agent on loopback: serves `body` at /peer/v1/state, proven by `key` (the pair's, common.peerproof)
    when the reader sends a nonce; `forge` rewrites the proof's headers (a forger's answer)."""

    def __init__(self, key: bytes | None = None) -> None:
        self.body = doc_bytes()
        self.requests = 0
        self.key = key
        self.node = "spark-b"  # the node its proof names
        self.status = 200
        self.forge: Callable[[str, tuple[tuple[str, str], ...]], tuple[tuple[str, str], ...]] | None = None
        self.nonces: list[str] = []
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                peer.requests += 1
                ok = self.path.split("?", 1)[0] == peerdoc.PATH
                self.send_response(peer.status if ok else 404)
                self.send_header("Content-Type", "application/json")
                nonce = peerproof.nonce_of(self.path)
                if ok and nonce is not None:
                    peer.nonces.append(nonce)
                    proof: tuple[tuple[str, str], ...] = ()
                    if peer.key is not None:
                        proof = peerproof.prove(peer.key, peer.node, nonce, peer.body)
                    if peer.forge is not None:
                        proof = peer.forge(nonce, proof)
                    for name, value in proof:
                        self.send_header(name, value)
                self.end_headers()
                self.wfile.write(peer.body if ok else b"{}")

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def peer(key: bytes | None = None) -> Iterator[Peer]:
    p = Peer(key)
    try:
        yield p
    finally:
        p.stop()


def watch(tmp_path: Path, *peers: str, keyed: bool = True, **overrides: object) -> tuple[PeerWatch, list[Event]]:
    """A peer watch over `peers`, holding the pair's key (tests.helpers.peerkey) unless not `keyed`."""
    keys = {"peer_key_file": key_file(tmp_path / "key")} if keyed else {}
    settings = load_settings(
        None, {"state_dir": tmp_path / "state", "peers": list(peers), **keys, **overrides}, check_memory=False
    )
    recorded: list[Event] = []
    return PeerWatch(settings, recorded.append), recorded


def pair_key(tmp_path: Path) -> bytes:
    return key_of(key_file(tmp_path / "key"))


def test_peer_addresses_and_the_config_key_that_is_wrong() -> None:
    assert parse_peer("spark-b:9847") == ("http", "spark-b", 9847)
    assert parse_peer("https://10.0.0.2:9847") == ("https", "10.0.0.2", 9847)
    for bad in ("spark-b", "ftp://spark-b:21", "http://user:pw@spark-b:9847", "spark-b:9847/metrics", "spark-b:x"):
        with pytest.raises(ValueError):
            parse_peer(bad)
    with pytest.raises(ConfigError, match="peers"):
        load_settings(None, {"peers": ["spark-b"]}, check_memory=False)


def test_the_document_carries_the_guards_kills_and_redacts_their_words() -> None:
    kills = peerdoc.kills_from_guard(
        [recent(301), recent(303, "floor", f"MemAvailable 4.6 GiB <= floor 8.0 GiB; vllm --api-key {TOKEN}")]
    )
    assert [(k.trigger, k.pids, k.kind) for k in kills] == [("budget", (301,), "kill"), ("floor", (303,), "kill")]
    assert TOKEN not in kills[1].summary and "<redacted>" in kills[1].summary
    assert kills[0].ts.startswith("2025-12-04T")
    doc = peerdoc.parse(doc_bytes(kills))
    assert doc.node == "spark-b" and doc.mem_available_bytes == 52 * GiB and doc.kills == kills
    word = peerdoc.kill_word(doc, 301)
    assert word == "killed by sparkwatch on spark-b: budget: footprint 602 MiB (rss) over its budget 64.0 MiB (config)"
    assert peerdoc.kill_word(doc, 999) is None and peerdoc.kill_word(doc, None) is None
    many = peerdoc.kills_from_guard([recent(i) for i in range(1, 40)])
    assert len(many) == peerdoc.KILLS_SHOWN and many[-1].pids == (39,)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "Expecting value"),
        (json.dumps({"version": 1, "node": "b"}).encode(), "ray_node_ids"),  # missing fields: refused whole
        (json.dumps({**json.loads(doc_bytes()), "mem_available_bytes": "lots"}).encode(), "mem_available_bytes"),
        (json.dumps({**json.loads(doc_bytes()), "version": 2}).encode(), "version 2"),
    ],
)
def test_a_document_of_another_shape_is_refused_naming_the_field(body: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        peerdoc.parse(body)


@contextmanager
def silent_host() -> Iterator[int]:
    """A port whose host takes the connection and never answers (a wedged node: its kernel accepts, nothing reads)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def test_a_peer_read_then_lost_once_then_back(tmp_path: Path) -> None:
    with peer(pair_key(tmp_path)) as p:
        w, recorded = watch(tmp_path, f"127.0.0.1:{p.port}")
        p.body = doc_bytes(peerdoc.kills_from_guard([recent(301)]))
        w.poll_once()
        assert w.peers[0].doc is not None and w.peers[0].doc.node == "spark-b"
    # its agent stopped (or restarting): the port refuses, its host answers. Never lost, however long.
    for _ in range(PEER_LOST_AFTER + 2):
        w.poll_once()
    assert recorded == [] and not w.peers[0].lost
    assert w.counters()["peer_errors_refused"] == PEER_LOST_AFTER + 2
    # its host takes connections and nothing answers (wedged): lost after PEER_LOST_AFTER reads in a row, said once,
    # with what it last said
    with silent_host() as port:
        w.peers[0].port = port
        for _ in range(PEER_LOST_AFTER + 1):
            w.poll_once()
    lost = [e for e in recorded if e.kind == EventKind.PEER_LOST]
    assert len(lost) == 1 and w.counters()["peers_lost"] == 1
    fields = lost[0].fields
    assert fields["peer"] == f"127.0.0.1:{p.port}" and fields["node"] == "spark-b"
    assert fields["mem_available_bytes"] == 52 * GiB
    assert isinstance(fields["last_kill"], dict) and fields["last_kill"]["trigger"] == "budget"
    assert "spark-b" in lost[0].summary and "52.0 GiB" in lost[0].summary
    assert w.counters()["peer_errors_timeout"] == PEER_LOST_AFTER + 1
    # it answers again (on another port here: the test cannot count on getting the old one back): peer_back, once
    with peer(pair_key(tmp_path)) as again:
        w.peers[0].port = again.port
        w.poll_once()
        w.poll_once()
    assert [e.kind for e in recorded] == [EventKind.PEER_LOST, EventKind.PEER_BACK]


def test_a_peer_that_never_answered_is_not_lost_and_bad_answers_are_counted(tmp_path: Path) -> None:
    with peer(pair_key(tmp_path)) as p:
        p.body = b"<html>not sparkwatch</html>"
        w, recorded = watch(tmp_path, f"127.0.0.1:{p.port}")
        for _ in range(PEER_LOST_AFTER + 1):
            w.poll_once()
    assert recorded == []  # it never said anything: there is nothing to say it stopped saying
    assert w.counters()["peer_errors_bad_answer"] == PEER_LOST_AFTER + 1


def test_the_kill_word_is_read_again_once_when_the_last_document_does_not_name_the_pid(tmp_path: Path) -> None:
    node_b = "b" * 56
    with peer(pair_key(tmp_path)) as p:
        w, _ = watch(tmp_path, f"127.0.0.1:{p.port}")
        w.poll_once()  # its document names no kill yet
        p.body = doc_bytes(peerdoc.kills_from_guard([recent(301)]))  # its guard has just recorded it
        before = p.requests
        word = w.kill_word(node_b, 301)
        assert word is not None and "budget" in word and p.requests == before + 1
        assert w.kill_word("c" * 56, 301) is None  # a node no peer serves: nobody is asked
        assert w.kill_word(node_b, 777) is None  # its guard did not kill that pid
        assert p.requests == before + 2


def test_a_real_daemon_serves_its_state_to_peers(tmp_path: Path) -> None:
    """`sparkwatch run`'s endpoint answers /peer/v1/state with a document the peer reader takes."""
    with sparkwatch_run(tmp_path) as daemon:
        url = f"http://127.0.0.1:{daemon.port}{peerdoc.PATH}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.headers["Content-Type"] == "application/json"
            doc = peerdoc.parse(resp.read())
    assert doc.node and doc.ray_node_ids == () and doc.kills == ()
    assert doc.mem_available_bytes is None or doc.mem_available_bytes > 0


# --- issue 37: a peer proves who it is before its word moves anything

KEY = "10.0.0.1:29501"
NODE_B = "b" * 56


def member_trees() -> list[EngineTree]:
    """This test process as node A's member of group KEY (its own namespace and start time)."""
    me = os.getpid()
    proc = Proc(me, 1, os.getuid(), "vllm", "S", read_start_ticks("/proc", me) or 0, 1 << 20,
                ("vllm", "serve", "m", "--nnodes", "2", "--master-addr", "10.0.0.1"))  # fmt: skip
    return [EngineTree("vllm", proc, (proc,))]


def b_doc(*, member: bool = True, budget: int = 0, kill_pid: int | None = None) -> bytes:
    """Node B's document: its member of KEY (pid 200), a worker budget for placement group pg1, a kill."""
    kills = peerdoc.kills_from_guard([recent(kill_pid, "budget", "forged reason: rm -rf /")]) if kill_pid else ()
    budgets = (peerdoc.PeerBudget("pg1", budget, os.getuid()),) if budget else ()
    groups = (peerdoc.PeerMember(KEY, 1, 200, os.getuid()),) if member else ()
    return peerdoc.build("spark-b", (NODE_B,), None, (), kills, groups=groups, budgets=budgets)


def group_watch(w: PeerWatch) -> tuple[MpGroupWatch, list[GroupTeardownMsg]]:
    sent: list[GroupTeardownMsg] = []
    trees = member_trees()
    return MpGroupWatch(w.settings, sent.append, lambda: trees), sent


def moved(w: PeerWatch, mp: MpGroupWatch) -> tuple[list[GroupTeardownMsg], list[peerdoc.WorkerBudget], str | None]:
    """One read of the peers and what its word moved: a teardown here, a worker budget, a kill word."""
    w.poll_once()
    return mp.observe(w.peers), w.worker_budgets(), w.kill_word(NODE_B, 301)


def replay_of(recorded: tuple[tuple[str, str], ...]) -> Callable[[str, tuple[tuple[str, str], ...]], Headers]:
    return lambda nonce, proof: recorded


Headers = tuple[tuple[str, str], ...]


@pytest.mark.parametrize("forgery", ["unsigned", "another key", "replayed", "another node"])
def test_a_forged_document_moves_nothing_and_is_counted(tmp_path: Path, forgery: str) -> None:
    """The peer's port answers with a document that drops B's member, sets a 1-byte worker budget on its rank and
    claims a kill word, without the pair's proof: unsigned, signed with another key, an honest proof replayed from
    an earlier read, or the proof of another node. Nothing moves: no teardown, no budget, no word; bad_proof
    counted, and the last proven document stands."""
    with peer(pair_key(tmp_path)) as p:
        w, _ = watch(tmp_path, f"127.0.0.1:{p.port}")
        mp, sent = group_watch(w)
        p.body = b_doc(member=True)
        assert moved(w, mp) == ([], [], None)  # the honest document: B's member listed
        honest_nonce = p.nonces[-1]
        honest_proof = peerproof.prove(pair_key(tmp_path), "spark-b", honest_nonce, b_doc(member=False))
        p.body = b_doc(member=False, budget=1, kill_pid=301)
        if forgery == "unsigned":
            p.key = None
        elif forgery == "another key":
            p.key = os.urandom(32)
        elif forgery == "replayed":  # a proof the honest agent gave for the earlier read (the body as forged)
            p.forge = replay_of(honest_proof)
        else:  # a proof the pair's key made for another node's answer (spark-c's, replayed as spark-b)
            p.node = "spark-c"
        for _ in range(3):
            assert moved(w, mp) == ([], [], None)
        assert sent == []
        assert w.counters()["peer_errors_bad_proof"] == 6  # each poll, and kill_word's one read again
        assert w.peers[0].doc is not None and w.peers[0].doc.groups is not None and w.peers[0].doc.groups
        # the same document, proven: it moves (the forgery alone was refused)
        p.key, p.forge, p.node = pair_key(tmp_path), None, "spark-b"
        teardowns, budgets, word = moved(w, mp)
        assert [t.cause for t in teardowns] == [mpgroup.RANK_GONE]
        assert [(b.group, b.budget_bytes) for b in budgets] == [("pg1", 1)]
        assert word is not None and "killed by sparkwatch on spark-b: budget" in word


def test_without_a_key_peers_are_display_only(tmp_path: Path) -> None:
    """No peer_key_file (and a plain-HTTP peer): its memory shows, its word moves nothing: a dropped member ends no
    group, its budget binds no rank, its kill word is not repeated, torn_down and ray_gone answer nothing."""
    with peer() as p:
        w, _ = watch(tmp_path, f"127.0.0.1:{p.port}", keyed=False)
        mp, sent = group_watch(w)
        p.body = b_doc(member=True)
        assert moved(w, mp) == ([], [], None)
        kills = peerdoc.kills_from_guard([recent(301, "group_teardown")])
        budgets = (peerdoc.PeerBudget("pg1", 1, os.getuid()),)
        p.body = peerdoc.build(
            "spark-b", (NODE_B,), None, (), kills, groups=(), budgets=budgets, ray_gone=((NODE_B, 301),)
        )
        assert moved(w, mp) == ([], [], None) and sent == []
        assert w.torn_down(NODE_B) == frozenset() and w.ray_gone(NODE_B) == frozenset()
        doc = w.peers[0].doc
        assert doc is not None and doc.node == "spark-b"  # shown, marked unproven
        assert [(v.node, v.proven) for v in w.view()] == [("spark-b", False)]
        assert p.nonces == []  # no key: no proof asked for


@pytest.mark.parametrize("answer", ["refused", "http 404", "bad proof"])
def test_a_witness_that_gives_no_proven_document_for_peer_lost_after_s_is_lost(tmp_path: Path, answer: str) -> None:
    """A proven peer that held a member of a group then answers, for longer than peer_lost_after_s, with a refused
    connection, an HTTP 404, or a document without its proof: it is lost for that group (a teardown is sent, cause
    peer_lost), once, whatever it answered; before that time nothing is decided."""
    with peer(pair_key(tmp_path)) as p:
        w, recorded = watch(tmp_path, f"127.0.0.1:{p.port}", peer_lost_after_s=1.0)
        mp, _ = group_watch(w)
        p.body = b_doc(member=True)
        assert moved(w, mp)[0] == []
        if answer == "refused":
            p.stop()
        elif answer == "http 404":
            p.status = 404
        else:
            p.key = os.urandom(32)
        assert moved(w, mp)[0] == []  # within peer_lost_after_s: not yet
        time.sleep(1.1)
        (msg,) = moved(w, mp)[0]
        assert (msg.group, msg.cause, msg.first_pid) == (KEY, mpgroup.PEER_LOST, None)
        (lost,) = [e for e in recorded if e.kind == EventKind.PEER_LOST]
        assert "gave no document" in lost.summary and lost.fields["error"]
        if answer == "refused":  # p.stop() closed it already
            p.server.server_close = lambda: None  # type: ignore[method-assign]
            p.server.shutdown = lambda: None  # type: ignore[method-assign]


def test_an_honest_restart_shorter_than_peer_lost_after_s_is_not_a_loss(tmp_path: Path) -> None:
    """B's agent restarts: its port refuses for a while, then the new agent answers, proven, its groups unknown until
    its first cycle, then listing its member again. Nothing is lost, nothing is torn down."""
    with peer(pair_key(tmp_path)) as p:
        w, recorded = watch(tmp_path, f"127.0.0.1:{p.port}", peer_lost_after_s=2.0)
        mp, sent = group_watch(w)
        p.body = b_doc(member=True)
        assert moved(w, mp)[0] == []
        port = p.port
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # refused, read after read
        assert moved(w, mp)[0] == []
        time.sleep(0.2)
    with peer(pair_key(tmp_path)) as again:
        w.peers[0].port = again.port  # (the test cannot count on getting port back)
        assert port
        again.body = peerdoc.build("spark-b", (NODE_B,), None, (), ())  # before its first cycle: groups unknown
        assert moved(w, mp)[0] == []
        again.body = b_doc(member=True)
        assert moved(w, mp)[0] == []
    assert sent == [] and recorded == [] and w.counters()["peer_errors_refused"] >= 3


def test_a_real_daemon_proves_its_document_with_the_pair_s_key(tmp_path: Path) -> None:
    """`sparkwatch run` with peer_key_file answers a reader's nonce with its proof: a reader with the same key takes
    its document, proven; a reader with another key refuses it (bad_proof) and keeps nothing."""
    key = key_file(tmp_path / "key")
    with sparkwatch_run(tmp_path / "agent", env={"SPARKWATCH_PEER_KEY_FILE": str(key)}) as daemon:
        w, _ = watch(tmp_path, f"127.0.0.1:{daemon.port}")
        w.poll_once()
        assert w.peers[0].doc is not None and w.peers[0].proven
        other = key_file(tmp_path / "other")
        w2, _ = watch(tmp_path / "2", f"127.0.0.1:{daemon.port}", peer_key_file=other)
        w2.poll_once()
        assert w2.peers[0].doc is None and w2.counters()["peer_errors_bad_proof"] == 1
        # a plain read (no nonce) still gets the document, unproven: it is display information
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}{peerdoc.PATH}", timeout=10) as resp:
            assert resp.headers.get(peerproof.PROOF_HEADER) is None and peerdoc.parse(resp.read()).node


def cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    full.update({"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "XDG_STATE_HOME": str(tmp_path / "xdg-state"),
                 "XDG_RUNTIME_DIR": str(tmp_path / "run"), **(env or {})})  # fmt: skip
    return subprocess.run([sys.executable, "-m", "sparkwatch", *args], env=full, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_check_config_doctor_and_status_say_display_only_in_one_line(tmp_path: Path) -> None:
    """Peers without peer_key_file: check-config warns, doctor's peers check warns, status shows the line; with the
    key each says they are proven. A key file others may read is refused by name."""
    line = "peers: 1 configured, display-only: no peer_key_file (docs/multinode.md)"
    env = {"SPARKWATCH_PEERS": '["127.0.0.1:9"]'}
    out = cli(tmp_path, "check-config", env=env)
    assert out.returncode == 0 and f"sparkwatch: WARNING {line}" in out.stderr.splitlines()
    doctor = cli(tmp_path, "doctor", "--json", env=env)
    (peers,) = [c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "peers"]
    assert peers["status"] == "warn" and peers["summary"].startswith(line) and "peer-key write" in peers["fix"]
    status = cli(tmp_path, "status", "--once", env=env)
    assert status.returncode == 0 and line in status.stdout, status.stderr
    keyed = {**env, "SPARKWATCH_PEER_KEY_FILE": str(key_file(tmp_path / "key"))}
    out = cli(tmp_path, "check-config", env=keyed)
    assert out.returncode == 0 and "peers: 1 configured, proven by peer_key_file" in out.stdout.splitlines()
    assert "display-only" not in out.stderr
    loose = key_file(tmp_path / "loose")
    loose.chmod(0o640)
    out = cli(tmp_path, "check-config", env={**env, "SPARKWATCH_PEER_KEY_FILE": str(loose)})
    assert out.returncode == 2 and "peer_key_file" in out.stderr and "chmod 600" in out.stderr
    assert loose.read_text().strip() not in out.stderr + out.stdout  # the key is never echoed


def test_peer_key_write_makes_a_private_key_and_keeps_an_existing_one(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    out = cli(tmp_path, "peer-key", "write", str(path))
    assert out.returncode == 0 and stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text()
    assert len(bytes.fromhex(key.strip())) == 32 and key.strip() not in out.stdout + out.stderr
    again = cli(tmp_path, "peer-key", "write", str(path))
    assert again.returncode == 1 and path.read_text() == key
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(peerproof.PeerKeyError, match="symlink"):
        peerproof.read_key(link)


def test_a_port_taken_at_start_is_named_by_doctor_and_the_metric(tmp_path: Path) -> None:
    """Another process (here uid 65534's, listening) holds the agent's port when it starts: doctor's listen check
    fails naming its pid and uid; the agent logs the holder; once the holder is gone the agent binds, and
    sparkwatch_listen_port_taken_seconds says how long another process answered in its place. (The holder is the
    system's python3: uid 65534 cannot run the test's venv.)"""
    port = free_port()
    holder = subprocess.Popen(
        ["/usr/bin/python3", "-c", f"import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
         f"socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', {port})); s.listen(); print('ok', flush=True); "
         "time.sleep(60)"],
        user=65534, group=65534, extra_groups=[], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        env = {"SPARKWATCH_LISTEN": f"127.0.0.1:{port}"}
        doctor = cli(tmp_path, "doctor", "--json", env=env)
        (listen,) = [c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "listen"]
        assert listen["status"] == "fail" and f"pid {holder.pid}" in listen["summary"]
        assert "uid 65534" in listen["summary"] and "not this node's agent" in listen["summary"]
        with sparkwatch_run(tmp_path / "agent", env=env) as daemon:
            assert any("is in use by pid" in line and str(holder.pid) in line for line in daemon.stderr_lines)
            holder.kill()
            holder.wait(5)
            deadline = time.monotonic() + 20
            while True:
                try:
                    text = scrape(port, 2)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the agent never took its port back"
                    time.sleep(0.5)
            (taken,) = [ln for ln in text.splitlines() if ln.startswith("sparkwatch_listen_port_taken_seconds ")]
            assert float(taken.split()[1]) > 0
    finally:
        holder.kill()
        holder.wait(5)
        if holder.stdout is not None:
            holder.stdout.close()
