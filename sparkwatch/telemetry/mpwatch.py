"""Engine groups over the multiprocessing backends (vLLM `--nnodes`/`--headless`, SGLang `--nnodes`/`--node-rank`):
learned from this node's engine trees and the peers' documents, their teardown handed to the guard (issue 29;
docs/multinode.md, "Without Ray").

Runs on the peer watch's thread, after each read of the peers (telemetry.peerwatch, every `peer_poll_s`):
1. this node's members: the roots of the engine trees of telemetry's last cycle whose command line names a
   rendezvous (core.kill.mpgroup.rendezvous), in this node's network namespace; published in this node's peer
   document (`groups`);
2. a member of a group this node also runs that a proven peer listed and no longer does (that rank ended: killed,
   OOM, crashed, stopped), or a proven peer lost that held one (no proven document for `peer_lost_after_s`, or
   silent: telemetry.peerwatch): the group is over. A display-only peer (no `peer_key_file`, no mutual TLS) ends
   nothing;
3. a `GroupTeardownMsg` to the guard naming this node's members (role `mp_rank`), which checks each one itself (the
   pid and start time, its own network namespace, the same rendezvous on its command line) and kills through its
   one kill path. Sent again at most every TEARDOWN_RESEND_S while a member still runs;
4. a member of this node that died (OOM-killed, crashed, killed by hand) leaves its children behind, reparented:
   vLLM's engine core and workers, stuck in a collective, never notice. Those telemetry saw in the member's tree
   and still running ORPHAN_GRACE_S later are handed to the guard (role `mp_orphan`, cause `rank_died` on this
   node), which stops only those of an engine's own shape (`VLLM::EngineCore`, `VLLM::Worker_TP0`, `sglang::…`).

A peer's word is a reason to look at this node's own processes: nothing is signalled that the guard cannot tie to
the group itself. With `group_teardown` off nothing is sent.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparkwatch.common import logs
from sparkwatch.common.messages import TEARDOWN_RESEND_S, GroupTeardownMsg
from sparkwatch.common.sources.procs import ProcParseError, ProcScanner, read_running_start_ticks, same_netns
from sparkwatch.core.kill import mpgroup
from sparkwatch.core.model import EngineTree
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.sources.listeners import connected_addresses

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings
    from sparkwatch.telemetry.peerwatch import Peer

log = logs.get("peers")
# A child a dead member left behind gets this long to exit on its own: vLLM's engine core notices its parent's death
# within a second when it is not stuck in a collective; one that is, never does.
ORPHAN_GRACE_S = 2.0


@dataclass
class _Family:
    """A member of this node and the rest of its tree as telemetry last saw it: (pid, start ticks) of each."""

    member: mpgroup.Member
    children: tuple[tuple[int, int], ...]
    gone_at: float | None = None  # when the member was first seen dead (monotonic)
    sent_at: float | None = None  # when its children were last handed to the guard


def local_members(trees: Iterable[EngineTree] | None, proc_root: Path) -> tuple[mpgroup.Member, ...]:
    """This node's members that may be stopped for their group: the engine trees whose root names a rendezvous, or
    rpc-servers (a llama.cpp head), in our network namespace."""
    out = []
    for tree in trees or ():
        root = tree.root
        keys = mpgroup.group_keys(root.argv)
        if keys and same_netns(proc_root, root.pid):
            out += [mpgroup.Member(key, rank, root.pid, root.start_ticks, root.uid) for key, rank in keys]
    return tuple(out)


def rpc_workers(trees: Iterable[EngineTree], proc_root: Path) -> tuple[mpgroup.Member, ...]:
    """This node's llama.cpp rpc-servers, one member per address a head reached it on (its established connections
    on its port): listed for the peers, never stopped for a group."""
    out = []
    for tree in trees:
        root = tree.root
        port = mpgroup.rpc_server_port(root.argv)
        if port is None or not same_netns(proc_root, root.pid):
            continue
        for addr in sorted(connected_addresses(proc_root, root.pid, port)):
            host = f"[{addr}]" if ":" in addr else addr
            out.append(mpgroup.Member(f"{host}:{port}", mpgroup.RPC_WORKER, root.pid, root.start_ticks, root.uid))
    return tuple(out)


class MpGroupWatch:
    def __init__(
        self,
        settings: Settings,
        send: Callable[[GroupTeardownMsg], None],
        engines: Callable[[], Iterable[EngineTree] | None] = lambda: (),
        node: str = "",
    ) -> None:
        """`engines`: the engine trees of telemetry's last cycle, None before its first. `node`: this node's name,
        for the events of what a dead member of its own left behind."""
        self.settings = settings
        self.node = node or socket.gethostname()
        self.send = send
        self.engines = engines
        self.proc_root = Path(settings.proc_root)
        self._then: dict[str, tuple[str, frozenset[mpgroup.Listed]]] = {}  # peer -> (node, its members) last seen
        self._sent_at: dict[mpgroup.GroupId, float] = {}  # group -> when its teardown was last sent (monotonic)
        self._losses: dict[
            mpgroup.GroupId, mpgroup.Loss
        ] = {}  # group -> what ended it, kept while this node's members run
        self._listed: dict[tuple[str, int, int], mpgroup.Member] = {}  # published last, by (key, pid, start)
        self._scanner = ProcScanner(Path(settings.proc_root))
        self._families: dict[tuple[int, int], _Family] = {}  # this node's members by (pid, start)
        self.teardowns_sent_total = 0

    def apply(self, settings: Settings) -> None:
        self.settings = settings

    def local_members(self, trees: Iterable[EngineTree] | None = None) -> tuple[mpgroup.Member, ...]:
        """This node's members that may be stopped for their group (`trees`, else telemetry's last cycle's)."""
        return local_members(self.engines() if trees is None else trees, self.proc_root)

    def published(self) -> tuple[peerdoc.PeerMember, ...] | None:
        """This node's members for its peers (rpc-servers included); None before telemetry's first cycle (unknown: a
        peer must not take an agent that just restarted for a node whose members all died). A member published
        before stays listed while its process lives (the same start time, not a zombie), even when a cycle's scan
        missed its tree (or an rpc-server's head disconnected: a new head reconnects to the same key): a peer ends
        the group when it is gone, never on a read that failed here."""
        trees = self.engines()
        if trees is None:
            return None
        trees = tuple(trees)
        now = {
            (m.key, m.pid, m.start_ticks): m for m in (*self.local_members(trees), *rpc_workers(trees, self.proc_root))
        }
        for key, m in self._listed.items():
            if key not in now and self._alive(m):
                now[key] = m
        self._listed = now
        return tuple(peerdoc.PeerMember(m.key, m.node_rank, m.pid, m.uid) for m in now.values())

    def _alive(self, m: mpgroup.Member) -> bool:
        try:
            proc = self._scanner.read_proc(m.pid)
        except (ProcParseError, ValueError):
            return True  # unreadable is not gone
        return proc is not None and proc.start_ticks == m.start_ticks and proc.state != "Z"

    def observe(self, peers: Iterable[Peer]) -> list[GroupTeardownMsg]:
        """After a read of every peer (telemetry.peerwatch's thread): decide, and send what must be stopped here."""
        now_mono = time.monotonic()
        trees = self.engines()
        local = self.local_members(trees)
        by_label = {p.label: p for p in peers}
        now: dict[str, tuple[str, frozenset[mpgroup.Listed]] | None] = {}
        for label, peer in by_label.items():
            doc = peer.doc
            if not peer.proven:  # display-only (no peer_key_file, no mutual TLS): its word ends nothing
                continue
            if peer.lost:
                now[label] = None
            elif doc is not None and doc.groups is not None:  # None: the peer does not know yet (it just started)
                now[label] = (doc.node, frozenset((g.key, g.uid, g.pid) for g in doc.groups))
        for t in mpgroup.teardowns(local, self._then, now, done=self._losses):
            self._losses[t.loss.key, t.loss.uid] = t.loss
        # The peers' members as last seen. A lost peer's are forgotten once its losses are taken: a group started
        # here again while it is still lost is not ended for members of a run that is over; its next answer counts.
        for label, seen in now.items():
            if seen is None:
                self._then.pop(label, None)
            else:
                self._then[label] = seen
        sent = []
        running: dict[mpgroup.GroupId, list[mpgroup.Member]] = {}
        for m in local:
            running.setdefault(m.group, []).append(m)
        for group, loss in list(self._losses.items()):
            members = running.get(group)
            if not members:  # this node's members are gone: the group is over here
                del self._losses[group]
                self._sent_at.pop(group, None)
                continue
            if (
                not self.settings.group_teardown
                or now_mono - self._sent_at.get(group, -TEARDOWN_RESEND_S) < TEARDOWN_RESEND_S
            ):
                continue
            doc = by_label[loss.peer].doc if loss.peer in by_label else None
            msg = GroupTeardownMsg(
                group=loss.key,
                cause=loss.cause,
                first_node=peerdoc.clean(loss.node),  # the peer's own word: printable, bounded
                first_pid=loss.pid,
                members=tuple((m.pid, m.start_ticks, mpgroup.MP_RANK) for m in members),
                detected_ts=time.time(),
                peer_word=None if doc is None else peerdoc.kill_word(doc, loss.pid),
                owner_uid=loss.uid,
            )
            self._sent_at[group] = now_mono
            log.info("group %s lost a member on %s (%s): stopping %d local member(s)", loss.key, msg.first_node,
                     loss.cause, len(members))  # fmt: skip
            self.send(msg)
            self.teardowns_sent_total += 1
            sent.append(msg)
        return sent + self._orphans(trees, local, now_mono)

    def _orphans(
        self, trees: Iterable[EngineTree] | None, local: tuple[mpgroup.Member, ...], now: float
    ) -> list[GroupTeardownMsg]:
        """What this node's dead members left behind (step 4 of the module's docstring)."""
        if trees is None:
            return []
        roots = {t.root.pid: t for t in trees}
        for m in local:
            tree = roots.get(m.pid)
            if tree is not None and tree.root.start_ticks == m.start_ticks:
                children = tuple((p.pid, p.start_ticks) for p in tree.members[1:])
                family = self._families.get((m.pid, m.start_ticks))
                if family is None:
                    self._families[m.pid, m.start_ticks] = _Family(m, children)
                else:
                    family.children = children
        live = {(m.pid, m.start_ticks) for m in local}
        sent = []
        for key, family in list(self._families.items()):
            if key in live or self._alive(family.member):
                continue
            if family.gone_at is None:
                family.gone_at = now
            left = tuple((pid, t) for pid, t in family.children if read_running_start_ticks(self.proc_root, pid) == t)
            if not left:
                del self._families[key]
                continue
            if (
                not self.settings.group_teardown
                or now - family.gone_at < ORPHAN_GRACE_S
                or (family.sent_at is not None and now - family.sent_at < TEARDOWN_RESEND_S)
            ):
                continue
            m = family.member
            msg = GroupTeardownMsg(
                group=m.key,
                cause=mpgroup.RANK_GONE,
                first_node=peerdoc.clean(self.node),
                first_pid=m.pid,
                members=tuple((pid, t, mpgroup.MP_ORPHAN) for pid, t in left),
                detected_ts=time.time(),
                peer_word=None,
                owner_uid=m.uid,
            )
            family.sent_at = now
            log.info("group %s: this node's member %d died; stopping %d process(es) it left behind", m.key, m.pid,
                     len(left))  # fmt: skip
            self.send(msg)
            self.teardowns_sent_total += 1
            sent.append(msg)
        return sent
