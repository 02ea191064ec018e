"""The group watch: engines that span nodes over Ray, learned from Ray's own state, and their teardown handed to the
guard (issue 29; docs/multinode.md).

On its own thread, every `ray_poll_s` (2 s) while a raylet runs in this node's network namespace. The raylets are
looked for in the telemetry loop's own process table, which each cycle hands over (`observe`: the processes named
raylet compared on the loop's thread, no read); the thread is woken when those change, and while raylets run it looks
again every `RAYLET_LOOK_S`. A box without Ray pays that comparison and nothing else: the thread never wakes (it
looked every 5 s before).
1. read the actors from the dashboard's state API (telemetry.sources.raystate), the nodes every `FULL_EVERY_S`, and
   jobs and placement groups with them as soon as an actor not known yet appears, while a teardown is under way,
   and at least every `FULL_MAX_S`; an answer like the last one decides nothing again;
2. core.kill.raygroup decides which groups lost a member and which of this node's processes belong to them, from the
   pids Ray names, read one by one from /proc only for a group that lost one (only those in our network
   namespace, with their start time);
3. for each, a `GroupTeardownMsg` to the guard, which checks every member again itself and kills them
   (guard.groupwatch). Sent again at most every `TEARDOWN_RESEND_S` (common.messages) while a member still runs
   (the guard may have been busy);
4. a placement group Ray still holds `PG_GRACE_S` after this node's teardown (its driver did not die: wedged, or on
   a node whose agent did not act) is removed by a short-lived helper in the engine's own interpreter (the one the
   local raylet runs its Python workers with): `ray.init(address=<GCS>)` and `remove_placement_group`, at most
   `REMOVE_TIMEOUT_S`, once per group. Ray offers no REST call for it, and Ray is never imported here.

This node's agent also tells its peers (telemetry.peerdoc, `ray_gone`) of its own ranks that Ray still lists ALIVE
and whose process it saw end: when a node's raylet dies first, Ray hears of its ranks only when its health check
gives up on that node (about 15 s), while the ranks exit within a second (each worker watches its raylet). The ranks
are kept, as Ray last listed them, RANKS_KEPT_S after the raylet went. A peer's such word marks that rank dead for the
decisions here (core.kill.raygroup.gone_per_agents), and a peer read that brings one wakes this watch at once: a
reason to look at this node's own members, which the guard checks again as ever.

Every failed poll is counted by kind (`ray_errors_*`) and said in the log once per change of reason; a failure
decides nothing. With `group_teardown` off nothing is sent.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sparkwatch.common import logs
from sparkwatch.common.messages import PEER_BUDGET_RESEND_S, TEARDOWN_RESEND_S, GroupTeardownMsg, PeerBudgetMsg
from sparkwatch.common.sources.procs import ProcParseError, ProcScanner, read_running_start_ticks, same_netns
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.kill import raygroup
from sparkwatch.core.model import Proc
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.sources.listeners import connected_to
from sparkwatch.telemetry.sources.raylets import LocalRaylet, local_raylets, raylets_named
from sparkwatch.telemetry.sources.raystate import (
    Connection,
    RayStateError,
    RayStateSource,
    cluster_owner,
    is_local_url,
    local_dashboard_url,
    start_remove_pg,
)

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings

log = logs.get("raywatch")
# While raylets run, the table is looked at again this often (another user's raylet, the dashboard their user
# started); a raylet started or gone is told at the telemetry cycle that sees it (observe).
RAYLET_LOOK_S = 5.0
# The nodes this often, all four listings at least every FULL_MAX_S (and at once for a new actor, or while a teardown
# is under way); in between only the actors (a death shows there first), without Ray's detail.
# Measured on the two-node test cluster: polling all four every second and re-reading the members' /proc entries,
# the group watch's thread took 0.72 % of a core; the actors alone through urllib 0.32 %, on one kept-alive
# connection 0.27 % (the dead actors of 20 runs in each answer, death causes and all); bench/RESULTS-group-teardown.md
FULL_EVERY_S = 10.0
FULL_MAX_S = 60.0
MAX_PIDS = 512  # pids read from /proc a poll: ranks, drivers and their parents of the groups Ray lists
RANKS_KEPT_S = 60.0  # this node's ranks are told of this long after the last answer from Ray that listed them
REMOVE_TIMEOUT_S = 30.0  # the helper connects as a Ray driver: 2-3 s on the 2-core test box


@dataclass(frozen=True, slots=True)
class GroupView:
    """What the exporter shows of the groups (telemetry.exporter.groupmetric): as of Ray's last answer."""

    rows: tuple[raygroup.GroupRow, ...]
    nodes: tuple[raygroup.RayNode, ...]
    teardowns_sent_total: int
    pg_removed_total: int


class PeerWords(Protocol):
    """What the group watch asks of the other nodes' agents (telemetry.peerwatch.PeerWatch), by Ray node id."""

    def kill_word(self, node_id: str, pid: int | None) -> str | None:
        """The peer guard's own line when it killed `pid` on that node (text for the event), else None."""
        ...

    def torn_down(self, node_id: str) -> frozenset[int]:
        """The pids that node's agent stopped as a group teardown: consequences, never a first death."""
        ...

    def ray_gone(self, node_id: str) -> frozenset[int]:
        """The pids of that node's ranks that its own agent saw end while Ray still lists them ALIVE."""
        ...

    def worker_budgets(self) -> Sequence[peerdoc.WorkerBudget]:
        """The budgets the peers' launches gave their engines' ranks on other nodes (`--budget worker=SIZE`)."""
        ...

    def ray_state(self, gcs_addresses: frozenset[str]) -> peerdoc.RayRelay | None:
        """Ray's state as the proven agent of the head of a cluster with one of these GCS addresses relays it."""
        ...


class NoPeers:
    """No peers configured: nobody to ask."""

    def kill_word(self, node_id: str, pid: int | None) -> str | None:
        return None

    def torn_down(self, node_id: str) -> frozenset[int]:
        return frozenset()

    def ray_gone(self, node_id: str) -> frozenset[int]:
        return frozenset()

    def worker_budgets(self) -> Sequence[peerdoc.WorkerBudget]:
        return ()

    def ray_state(self, gcs_addresses: frozenset[str]) -> peerdoc.RayRelay | None:
        return None


def _cluster_of(raylets: tuple[LocalRaylet, ...]) -> raygroup.Cluster:
    """This node's part of the cluster these raylets (one user's, at least one) serve."""
    return raygroup.Cluster(frozenset(r.node_id for r in raylets), raylets[0].uid, frozenset(r.pid for r in raylets))


class RayWatch:
    LIVE_KEYS = frozenset({"group_teardown", "ray_poll_s"})

    def __init__(
        self,
        settings: Settings,
        send: Callable[[GroupTeardownMsg | PeerBudgetMsg], None],
        peers: PeerWords | None = None,
        wake: threading.Event | None = None,
    ) -> None:
        """`peers`: what the other nodes' agents say (telemetry.peerwatch.PeerWatch), text and reasons to look, never
        reasons to kill. The process table where the raylets are looked for comes from each telemetry cycle
        (`observe`). `wake`: the event that makes the thread poll now, given where the peers' news sets it (the
        telemetry process's PeerNews, built before the peer watch that this watch asks)."""
        self.settings = settings
        self.send = send
        self.peers: PeerWords = peers or NoPeers()
        self.proc_root = Path(settings.proc_root)
        self.source = RayStateSource(settings.ray_dashboard_url)
        self.scanner = ProcScanner(settings.proc_root)
        self._state: raygroup.RayState | None = None
        self._decided: raygroup.RayState | None = None  # the state the last decisions were made on
        self._gone_decided: frozenset[tuple[str, int]] = frozenset()  # and the peers' word on their ranks then
        # (node id, pid) -> start ticks (None: never seen running here, never told of as ended): this node's ranks
        self._ranks: dict[tuple[str, int], int | None] = {}
        self._ranks_at = 0.0  # when Ray last listed them (monotonic)
        self._actors_seen: tuple[tuple[str, str, int | None, str], ...] = ()  # the last answer's actors, in brief
        self._nodes_at = 0.0
        self._full_at = 0.0
        self.raylets: tuple[LocalRaylet, ...] = ()
        self.node_ids: frozenset[str] = frozenset()
        # The cluster whose state this node believes, tied to its raylets of one user (_trust, _relayed); None: Ray's
        # state is shown, never acted on (no teardown, no budget, no removal, no word to the peers)
        self.cluster: raygroup.Cluster | None = None
        self.untrusted_why: str | None = None
        self.remote = False  # the dashboard is another host's: Ray's state moves nothing here unless a peer relays it
        self.groups: tuple[raygroup.RayGroup, ...] = ()  # the last poll's groups (for `engines` and metrics later)
        self.teardowns_sent_total = 0
        self._budgets_sent: tuple[tuple[int, int, int, int, str], ...] = ()  # the last PeerBudgetMsg's budgets
        self._budgets_sent_at = 0.0
        self.proc_errors_total = 0
        self._sent_at: dict[str, float] = {}
        self._words: dict[str, str | None] = {}  # group -> the peer's word on its first death, asked once
        self._torn_at: dict[str, float] = {}  # group -> when this node first tore it down (monotonic)
        self._removing: dict[str, tuple[subprocess.Popen[bytes], float]] = {}  # group -> (helper, started)
        self._remove_tried: set[str] = set()
        self.pg_removed_total = 0
        self.pg_remove_errors_total = 0
        self._next_look = 0.0  # the next look for raylets in the process table, while raylets run
        # Written on the telemetry loop's thread (observe): its last table, the processes named raylet in it, and how
        # often those changed; this thread looks when that count is not the one it last looked at.
        self._table: tuple[Proc, ...] = ()
        self._named: frozenset[tuple[int, int]] = frozenset()  # the processes named raylet, by (pid, start ticks)
        self._local_named: frozenset[tuple[int, int]] = frozenset()  # those of them in our network namespace
        self._named_changes = 0
        self._looked_changes = 0  # (this thread's)
        self.looks_total = 0  # looks over a table for raylets
        self._stop = threading.Event()
        # set by nudge() and the peers' news (poll now), and by observe() (a raylet started or gone)
        self._wake = wake if wake is not None else threading.Event()
        self._thread: threading.Thread | None = None
        self._said: str | None = None

    def start(self) -> None:
        if not self.settings.ray_dashboard_url:
            return
        self._stop.clear()
        self._thread = daemon_thread(self._run, "sparkwatch-raywatch")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        self.source.close()
        for helper, _started in self._removing.values():  # our own children, never anything else
            helper.kill()
            helper.wait()
        self._removing.clear()

    def apply(self, settings: Settings) -> frozenset[str]:
        self.settings = settings
        return self.LIVE_KEYS

    def counters(self) -> dict[str, int]:
        out = {f"ray_errors_{kind}": n for kind, n in self.source.errors.items()}
        out["proc_errors"] = self.proc_errors_total
        out["pg_remove_errors"] = self.pg_remove_errors_total
        return out

    def nudge(self) -> None:
        """Poll now (a peer says one of its ranks ended), not at the next `ray_poll_s`."""
        self._wake.set()

    def observe(self, table: tuple[Proc, ...]) -> None:
        """A telemetry cycle's process table (the loop's thread; never blocks): kept for the next look, and the
        thread woken when the processes named raylet in this network namespace changed (a raylet started, or
        gone). One named raylet in another namespace (another node's on this box: a container's, the two-node tests')
        costs a readlink when it appears, and wakes nothing."""
        self._table = table
        named = raylets_named(table)
        if named == self._named:
            return
        self._named = named
        local = frozenset(key for key in named if same_netns(self.proc_root, key[0]))
        if local == self._local_named:
            return
        self._local_named = local
        self._named_changes += 1  # after the table: a look that sees this count reads this table or a newer one
        self._wake.set()

    def published_node_ids(self) -> frozenset[str]:
        """The node ids this node's raylets serve, and those of the ranks still told of after a raylet went."""
        if time.monotonic() - self._ranks_at > RANKS_KEPT_S:
            return self.node_ids
        return self.node_ids | {node_id for node_id, _pid in self._ranks}

    def gone_ranks(self) -> tuple[tuple[str, int], ...]:
        """This node's ranks that Ray last listed ALIVE and whose process has ended since (read now: one stat each),
        for the peers. Only a rank seen running here counts: one never seen (another pid namespace) is never gone."""
        ranks, listed_at = self._ranks, self._ranks_at
        if time.monotonic() - listed_at > RANKS_KEPT_S:
            return ()
        return tuple(
            sorted(
                key
                for key, ticks in ranks.items()
                if ticks is not None and read_running_start_ticks(self.proc_root, key[1]) != ticks
            )
        )

    def view(self) -> GroupView | None:
        """The groups as of Ray's last answer, with this node's members marked; None while no raylet runs here or
        Ray has not answered yet. Called from the scrape's thread: it reads references the poll replaces whole."""
        state, node_ids = self._state, self.node_ids
        if state is None or not node_ids:
            return None
        return GroupView(
            raygroup.group_rows(state, node_ids), state.nodes, self.teardowns_sent_total, self.pg_removed_total
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # a bug: reported, counted, survived
                self.source.errors["internal"] = self.source.errors.get("internal", 0) + 1
                log.error("group watch failed: %s: %s", type(exc).__name__, exc)
            # Without a raylet here the thread sleeps until a telemetry cycle tells it of one (observe), or a peer
            # nudges it: a quiet box stays quiet.
            self._wake.wait(self.settings.ray_poll_s if self.node_ids else None)
            self._wake.clear()

    def poll_once(self) -> list[GroupTeardownMsg]:
        now = time.monotonic()
        changes = self._named_changes
        if changes != self._looked_changes or (self.raylets and (now >= self._next_look or not self._raylets_alive())):
            # telemetry's own process table (its last cycle): no /proc scan of ours
            self._looked_changes = changes
            table = self._table
            self.looks_total += 1
            self.raylets = local_raylets(table, self.proc_root)
            self.node_ids = frozenset(r.node_id for r in self.raylets)
            self._trust(table)
            self._next_look = now + RAYLET_LOOK_S
        if not self.node_ids:
            self.groups, self._state = (), None
            return []
        state = self._relayed() if self.remote else None
        if state is None:
            state = self._poll_state(now)
        if state is None:
            return []
        cluster = self.cluster
        if cluster is None:
            self.groups = raygroup.groups(state)  # shown (engines, metrics), never acted on
            return []
        self._keep_ranks(state, cluster, now)
        self._send_budgets(state, cluster, now)
        gone = self._peers_gone(state)
        if (
            state is self._decided
            and gone == self._gone_decided
            and not (self._sent_at or self._torn_at or self._removing)
        ):
            return []  # the same answer as last time and nothing under way: nothing new to decide
        self._decided, self._gone_decided = state, gone
        state = raygroup.gone_per_agents(state, gone)
        self.groups = raygroup.groups(state)
        # /proc is read only for groups that lost a member (none, nearly always)
        procs = self._local_procs(tuple(g for g in self.groups if raygroup.first_death(g, state) is not None))
        sent = []
        for teardown in raygroup.teardowns(state, cluster, procs, consequences=self._consequences(state)):
            if (
                not self.settings.group_teardown
                or now - self._sent_at.get(teardown.group, -TEARDOWN_RESEND_S) < TEARDOWN_RESEND_S
            ):
                continue
            if teardown.group not in self._words:  # the peer is asked once per group, resends carry its word
                self._words[teardown.group] = self._peer_word(teardown.death)
            msg = GroupTeardownMsg(
                group=teardown.group,
                cause=teardown.death.cause,
                first_node=teardown.death.node_ip or teardown.death.node_id,
                first_pid=teardown.death.pid,
                members=tuple((m.pid, m.start_ticks, m.role) for m in teardown.members),
                detected_ts=time.time(),
                peer_word=self._words[teardown.group],
                owner_uid=cluster.uid,
            )
            self._sent_at[teardown.group] = now
            self._torn_at.setdefault(teardown.group, now)
            self.send(msg)
            self.teardowns_sent_total += 1
            sent.append(msg)
        live = {g.group for g in self.groups}
        self._sent_at = {g: t for g, t in self._sent_at.items() if g in live}
        self._words = {g: w for g, w in self._words.items() if g in live}
        self._reap_helpers(now)
        for group in raygroup.leaked_groups(self.groups, self._torn_at, now):
            if group not in self._remove_tried:
                self._remove_tried.add(group)
                self._remove(group, cluster, now)
        self._torn_at = {g: t for g, t in self._torn_at.items() if g in live or g in self._removing}
        self._remove_tried &= live | set(self._removing)
        return sent

    def _send_budgets(self, state: raygroup.RayState, cluster: raygroup.Cluster, now: float) -> None:
        """This node's ranks of each group a peer's launch gave a worker budget (the peer that serves the group's
        driver node, for its own user's ranks), to the guard: when they changed, else every PEER_BUDGET_RESEND_S
        while any (the guard forgets them after PEER_BUDGET_TTL_S)."""
        told = {b.group: b for b in self.peers.worker_budgets()}
        budgets: list[tuple[int, int, int, int, str]] = []
        if told:
            for group in raygroup.groups(state):
                word = told.get(group.group)
                if word is None or group.driver_node_id not in word.node_ids or word.uid != cluster.uid:
                    continue
                procs = self._local_procs((group,))
                for m in raygroup.local_members(group, cluster, procs):
                    proc = procs.get(m.pid)
                    if m.role == raygroup.RANK and proc is not None and proc.uid == word.uid:
                        budgets.append((m.pid, m.start_ticks, proc.uid, word.budget_bytes, group.group))
        current = tuple(sorted(budgets))
        if current == self._budgets_sent and (not current or now - self._budgets_sent_at < PEER_BUDGET_RESEND_S):
            return
        self._budgets_sent, self._budgets_sent_at = current, now
        self.send(PeerBudgetMsg(current))

    def _keep_ranks(self, state: raygroup.RayState, cluster: raygroup.Cluster, now: float) -> None:
        """This node's ranks as Ray lists them now, each with its start time read once when first listed."""
        listed = raygroup.local_ranks(state, cluster.node_ids)
        if listed != self._ranks.keys():
            then = self._ranks
            self._ranks = {k: then[k] if k in then else read_running_start_ticks(self.proc_root, k[1]) for k in listed}
        self._ranks_at = now

    def _peers_gone(self, state: raygroup.RayState) -> frozenset[tuple[str, int]]:
        """(node id, pid) of the other nodes' ranks that their own agents say ended (their last documents)."""
        out: set[tuple[str, int]] = set()
        for node_id in raygroup.remote_rank_nodes(state, self.node_ids):
            try:
                out.update((node_id, pid) for pid in self.peers.ray_gone(node_id))
            except Exception as exc:  # a bug there must not hold Ray's own word back
                log.error("peer's ranks: %s: %s", type(exc).__name__, exc)
        return frozenset(out)

    def _consequences(self, state: raygroup.RayState) -> frozenset[tuple[str, int]]:
        """Dead ranks of another node that its agent says it stopped as a group teardown, asked only for a group
        that shows more than one dead rank at once and has not been torn down here yet (Ray keeps no time of
        death: the peers tell the cause from the consequence)."""
        nodes: set[str] = set()
        for group in self.groups:
            dead = [a for a in group.ranks if a.state == "DEAD"]
            if len(dead) > 1 and group.group not in self._sent_at:
                nodes.update(a.node_id for a in dead if a.node_id not in self.node_ids)
        out: set[tuple[str, int]] = set()
        for node_id in nodes:
            try:
                out.update((node_id, pid) for pid in self.peers.torn_down(node_id))
            except Exception as exc:  # a bug there must not hold a teardown back
                log.error("peer teardowns: %s: %s", type(exc).__name__, exc)
        return frozenset(out)

    def _peer_word(self, death: raygroup.Death) -> str | None:
        """The peer's word on the first death (at most peerwatch.WORD_TIMEOUT_S: its guard records a kill ~0.1 s
        after the signal, and Ray's state shows the death about as soon), asked once per group; a failure is none."""
        if death.cause != raygroup.RANK_DIED:
            return None
        try:
            return self.peers.kill_word(death.node_id, death.pid)
        except Exception as exc:  # a bug there must not hold a teardown back
            log.error("peer word: %s: %s", type(exc).__name__, exc)
            return None

    def _remove(self, group: str, cluster: raygroup.Cluster, now: float) -> None:
        """Start the helper that removes a leaked placement group (see the module's docstring), as the cluster's own
        user, through one of its raylets."""
        raylet = next((r for r in self.raylets if r.pid in cluster.raylet_pids and r.python and r.gcs_address), None)
        if raylet is None:
            self.pg_remove_errors_total += 1
            log.error("placement group %s outlived its teardown; no local raylet names an interpreter", group[:12])
            return
        try:
            helper = start_remove_pg(raylet, group, self.proc_root)
        except OSError as exc:
            self.pg_remove_errors_total += 1
            log.error("placement group %s: not removed: %s", group[:12], exc.strerror or exc)
            return
        log.warning("placement group %s outlived its teardown by %.0f s: removing it", group[:12], raygroup.PG_GRACE_S)
        self._removing[group] = (helper, now)

    def _reap_helpers(self, now: float) -> None:
        for group, (helper, started) in list(self._removing.items()):
            rc = helper.poll()
            if rc is None and now - started < REMOVE_TIMEOUT_S:
                continue
            if rc is None:
                helper.kill()
                helper.wait()
            del self._removing[group]
            if rc == 0:
                self.pg_removed_total += 1
                log.info("placement group %s removed", group[:12])
            else:
                self.pg_remove_errors_total += 1
                log.error("placement group %s: its removal %s", group[:12], "timed out" if rc is None else f"exit {rc}")

    def _poll_state(self, now: float) -> raygroup.RayState | None:
        """Ray's state. Each poll the actors alone, without Ray's detail (a death shows there first); the nodes every
        FULL_EVERY_S (a dead node shows there); all four listings when an actor appears that the last full read
        did not have (a new engine: its group, its job), at every poll while a teardown is under way (the placement
        group's removal), and at least every FULL_MAX_S. A quiet cluster costs one small listing a poll."""
        try:
            state = self._state
            busy = bool(self._sent_at or self._torn_at or self._removing)
            if state is None or busy or now - self._full_at >= FULL_MAX_S:
                state = self._full(now)
            else:
                actors = self.source.poll_actors()
                seen = tuple((a.actor_id, a.state, a.pid, a.node_id) for a in actors)
                if seen != self._actors_seen:
                    # Without detail Ray leaves out each actor's placement group: the last full read's, by actor id.
                    placed = {a.actor_id: a.placement_group_id for a in state.actors}
                    if all(a.actor_id in placed for a in actors):
                        self._actors_seen = seen
                        moved = tuple(replace(a, placement_group_id=placed[a.actor_id]) for a in actors)
                        state = replace(state, actors=moved)
                    else:
                        state = self._full(now)
                if now - self._nodes_at >= FULL_EVERY_S:
                    self._nodes_at = now
                    nodes = self.source.poll_nodes()
                    if nodes != state.nodes:
                        state = replace(state, nodes=nodes)
        except RayStateError:
            if self.source.last_error != self._said:
                log.warning("Ray's state API: %s (group teardown waits for an answer)", self.source.last_error)
                self._said = self.source.last_error
            return None
        if self._said is not None:
            log.info("Ray's state API answers again")
            self._said = None
        self._state = state  # the same object while nothing changed: poll_once then decides nothing again
        return state

    def _full(self, now: float) -> raygroup.RayState:
        state = self.source.poll()
        self._full_at = self._nodes_at = now
        self._actors_seen = tuple((a.actor_id, a.state, a.pid, a.node_id) for a in state.actors)
        return state

    def relay(self) -> peerdoc.RayRelay | None:
        """Ray's state for the other nodes of this node's cluster, when this node is its head and read it from a
        dashboard proven its cluster's (telemetry.peerdoc.RayRelay, in the peer document): their only way to act on
        Ray's state of this host. Called from the metrics server's thread: it reads references the poll replaces."""
        cluster, state = self.cluster, self._state
        if self.remote or cluster is None or state is None:
            return None
        head = next((r for r in self.raylets if r.pid in cluster.raylet_pids and r.head and r.gcs_address), None)
        return None if head is None else peerdoc.relay(head.gcs_address, cluster.uid, state)

    def _relayed(self) -> raygroup.RayState | None:
        """Ray's state of the other host as its proven agent relays it, with the cluster it speaks for here (this
        node's raylets of that GCS and user); None when no proven peer relays it (then the other host's dashboard
        is read for display only, and `cluster` is None)."""
        gcs = frozenset(r.gcs_address for r in self.raylets if r.gcs_address)
        try:
            relay = self.peers.ray_state(gcs)
        except Exception as exc:  # a bug there must not stop the watch
            log.error("peer's Ray state: %s: %s", type(exc).__name__, exc)
            relay = None
        mine = () if relay is None else tuple(
            r for r in self.raylets if r.gcs_address == relay.gcs_address and r.uid == relay.uid
        )  # fmt: skip
        why = None if mine else "no proven peer relays it (docs/multinode.md)"
        if relay is not None and not mine:
            why = f"the relayed cluster is uid {relay.uid}'s, whose raylets do not run here"
        self._say_trust(self.settings.ray_dashboard_url, relay.uid if relay is not None else None, why)
        if relay is None or not mine:
            self.cluster = None
            return None
        self.cluster = _cluster_of(mine)
        state = relay.state
        self._state = self._state if state == self._state else state  # an unchanged answer decides nothing again
        return self._state

    def _say_trust(self, url: str, owner: int | None, why: str | None) -> None:
        if why != self.untrusted_why and self.raylets:
            if why is None:
                log.info("Ray's state at %s is the cluster of uid %s's raylets", url, owner)
            else:
                log.warning("Ray's state at %s is shown, never acted on: %s", url, why)
        self.untrusted_why = why

    def _trust(self, table: tuple[Proc, ...] = ()) -> None:
        """Which of this node's raylets the dashboard's state speaks for (core.kill.raygroup.Cluster), said in the log
        once per change. A dashboard on this node speaks for the user whose process holds its port (any user may
        bind it while Ray's is down), else that user's own dashboard on its own port is looked for. One on another
        host speaks for nothing (plain HTTP on the link): there the proven relay decides, at each poll (_relayed)."""
        url = self.settings.ray_dashboard_url
        if not self.raylets:  # no Ray here: nothing to tie, and nothing asked of the kernel (a quiet box stays quiet)
            self.cluster, self.remote = None, False
            return
        self.remote = not is_local_url(url)
        if self.remote:
            return  # the proven relay decides, each poll (_relayed)
        owner, why = cluster_owner(url, self.proc_root)
        if owner is None:  # nothing (of one user) on the configured port: the dashboard the raylets' user started
            for uid in sorted({r.uid for r in self.raylets}):
                found = local_dashboard_url(table, uid, self.proc_root)
                if found is not None and cluster_owner(found, self.proc_root)[0] == uid:
                    url, owner, why = found, uid, None
                    break
        if url != self.source.conn.base_url:
            self.source.close()
            self.source.conn = Connection(url, self.source.conn.timeout_s)
        mine = tuple(r for r in self.raylets if owner is not None and r.uid == owner)
        cluster = None
        if mine:
            cluster = _cluster_of(mine)
        elif self.raylets and why is None:
            why = f"the dashboard's port is held by uid {owner}, who runs no raylet here"
        self._say_trust(url, owner, why)
        self.cluster = cluster

    def _raylets_alive(self) -> bool:
        """Whether the raylets last found still run (one stat each): a raylet gone is looked for again at once."""
        return all((self.proc_root / str(r.pid)).exists() for r in self.raylets)

    def _local_procs(self, groups: tuple[raygroup.RayGroup, ...]) -> dict[int, Proc]:
        """The processes Ray names for these groups (ranks, drivers) and the drivers' parents, read one by one,
        kept only when they run in our network namespace (this node). A driver is kept only while it holds a
        connection to its cluster's GCS (the one this node's raylets name): a pid Ray's state names as a driver that
        is no driver of this cluster is no member."""
        wanted: list[int] = []
        drivers: set[int] = set()
        for g in groups:
            wanted += [a.pid for a in g.ranks if a.pid]
            if g.job is not None and g.job.driver_pid:
                wanted.append(g.job.driver_pid)
                drivers.add(g.job.driver_pid)
        gcs = {r.gcs_address for r in self.raylets if self.cluster is not None and r.pid in self.cluster.raylet_pids}
        out: dict[int, Proc] = {}
        for pid in wanted[:MAX_PIDS]:
            proc = self._read(pid)
            if proc is None or (pid in drivers and not any(self._gcs_client(pid, a) for a in gcs)):
                continue
            out[pid] = proc
            parent = self._read(proc.ppid) if proc.ppid > 1 else None
            if parent is not None:
                out[parent.pid] = parent
        return out

    def _gcs_client(self, pid: int, gcs_address: str) -> bool:
        host, _sep, port = gcs_address.rpartition(":")
        if not port.isdigit():
            return False
        return connected_to(self.proc_root, pid, host.strip("[]"), int(port))

    def _read(self, pid: int) -> Proc | None:
        try:
            proc = self.scanner.read_proc(pid)
        except (ProcParseError, ValueError):
            self.proc_errors_total += 1
            return None
        if proc is None or not same_netns(self.proc_root, pid):
            return None
        return proc
