"""What one node's agent tells its peers (`GET /peer/v1/state` on its metrics endpoint), and what it makes of theirs.

Two Sparks running one engine each run sparkwatch; each lists the other in `peers` (docs/multinode.md). A peer's
document says what a node's agent knows that the other cannot see from its own /proc or from Ray:
- the node's name, and the Ray node ids its raylets serve (how a death in Ray's state is tied to a peer);
- its MemAvailable and its engine trees (root pid, kind, RSS), as of telemetry's last cycle, and the pool as a launch
  on another node plans its share of an engine spanning both (core.launch.nodeplan): total, free, page cache, its
  floor and CPU count, and whether it is still being handed back (Shmem, engine processes exiting);
- its guard's recent kills, as the guard remembered them at the signal: trigger, the reason, the pids signalled;
- its members of engine groups without Ray (core.kill.mpgroup): the rendezvous, the node rank, the tree's root pid;
- its Ray ranks that Ray still lists ALIVE and whose process it saw end (node id, pid: telemetry.raywatch), which
  Ray learns of late when the node's raylet died first;
- the worker budgets its launches gave engines over Ray (`--budget worker=SIZE`): the placement group, the size, the
  launching user;
- its raylets as `sparkwatch launch` on another node checks them (telemetry.sources.rayletfacts): the node's address,
  the checked variables of each raylet's environment (MAX_JOBS, RAY_memory_monitor_refresh_ms, NCCL_IB_GID_INDEX,
  VLLM_HOST_IP, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: never the rest of it), its memlock limit, ninja and nvcc on
  its PATH, the RoCEv2 GID index, the interface that holds the node's address.

Never more: no command line, no path, of an environment only the variables launch checks, nothing a kill
summary does not already say on the node's own journal (summaries are redacted again here). A peer's document is a
reason to write a better line, and for groups without Ray a reason to look at this node's own members of a group
(telemetry.mpwatch): never a reason to signal a process the guard cannot tie to that group on its own.

Plain JSON, parsed strictly (common.wiretypes): a document of another shape is refused whole and counted. Bounded
(issue 37): at most MAX_DOC_BYTES, and each list at most its count in CAPS, a document past either refused whole
before it is converted. Refused, not cut: an honest agent never sends more (`build` holds its own lists to the caps,
and leaves `groups` unknown rather than cut), and a cut list of members would read as members gone, which ends
groups. The caps are tens of times what a Spark runs, and a document at its caps parses in a few milliseconds
(bench/RESULTS-peerdoc.md: ≤ 20 ms at MAX_DOC_BYTES, where 13,000 budgets in 1 MiB took 154 ms).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace

from sparkwatch.common.stats import RecentKill
from sparkwatch.common.wiretypes import from_json, to_json
from sparkwatch.core.kill.raygroup import RayActor, RayJob, RayNode, RayPlacementGroup, RayState
from sparkwatch.core.launch.rayletenv import RayletFacts
from sparkwatch.core.model import EngineTree, MemInfo
from sparkwatch.core.redact import redact
from sparkwatch.core.timestamps import rfc3339

PATH = "/peer/v1/state"
VERSION = 1
# A few KiB in practice (16 kills and a handful of trees); a document at every cap below is under 100 KiB. 1 MiB
# took json.loads alone 17 ms for small objects (bench/RESULTS-peerdoc.md).
MAX_DOC_BYTES = 256 << 10
KILLS_SHOWN = 16
# The most of each list a document may carry (a document past one is refused whole: the module's docstring). Each is
# tens of times what a node holds: a Spark runs one or two engines; a raylet per Ray cluster it joins; a rank per GPU.
CAPS = {
    "ray_node_ids": 16,
    "engines": 64,
    "kills": KILLS_SHOWN,
    "groups": 256,  # members of groups without Ray: one per engine tree and rendezvous (an rpc-server: per head)
    "ray_gone": 256,
    "raylets": 16,
    "budgets": 64,  # one per engine launched here with a worker budget
}
PIDS_PER_KILL = 256  # the processes one kill signalled: a vLLM tree with its workers and compilers is tens
SUMMARY_MAX = 240  # a kill's summary as a peer repeats it, cut (it reaches events and launch's line)


@dataclass(frozen=True, slots=True)
class PeerEngine:
    root_pid: int
    engine: str
    rss_bytes: int


@dataclass(frozen=True, slots=True)
class PeerKill:
    ts: str  # the event's own timestamp (RFC 3339, the node's clock)
    kind: str  # kill or group_teardown
    trigger: str
    summary: str
    pids: tuple[int, ...]  # the processes the guard signalled


@dataclass(frozen=True, slots=True)
class PeerMember:
    """A member of an engine group keyed by its rendezvous (telemetry.mpwatch): the engine tree's root."""

    key: str  # "addr:port", as the engine's command line names it
    node_rank: int
    pid: int
    uid: int  # the user running it: a group is one user's (core.kill.mpgroup)


@dataclass(frozen=True, slots=True)
class PeerRank:
    """A Ray rank on the peer's own node (a node id its raylet served) that Ray lists ALIVE and whose process ended."""

    node_id: str
    pid: int


@dataclass(frozen=True, slots=True)
class PeerRaylet:
    """A raylet on the peer's node, as launch checks it (core.launch.rayletenv.RayletFacts on the wire)."""

    node: str
    pid: int
    head: bool
    gcs_address: str
    environment_read: bool
    max_jobs: str | None
    memory_monitor_refresh_ms: str | None
    nccl_ib_gid_index: str | None
    memlock_bytes: int | None
    ninja: bool | None
    nvcc: bool | None
    roce_v2_gid_index: int | None
    uid: int = -1  # the user it runs as (the same owner's uid on every Spark, as groups without Ray assume)
    # the fabric: the variables (absent from an older agent: then unknown, never a lack) and the node's interface
    vllm_host_ip: str | None = None
    gloo_socket_ifname: str | None = None
    nccl_socket_ifname: str | None = None
    fabric_ifname: str | None = None


_WIRE_VARS = (("max_jobs", "MAX_JOBS"), ("memory_monitor_refresh_ms", "RAY_memory_monitor_refresh_ms"),
              ("nccl_ib_gid_index", "NCCL_IB_GID_INDEX"), ("vllm_host_ip", "VLLM_HOST_IP"),
              ("gloo_socket_ifname", "GLOO_SOCKET_IFNAME"), ("nccl_socket_ifname", "NCCL_SOCKET_IFNAME"))  # fmt: skip


def peer_raylet(f: RayletFacts) -> PeerRaylet:
    env = f.environ or {}
    values = {field: env.get(var) for field, var in _WIRE_VARS}
    return PeerRaylet(
        node=f.node, pid=f.pid, head=f.head, gcs_address=f.gcs_address, environment_read=f.environ is not None,
        max_jobs=values["max_jobs"], memory_monitor_refresh_ms=values["memory_monitor_refresh_ms"],
        nccl_ib_gid_index=values["nccl_ib_gid_index"], memlock_bytes=f.memlock_bytes, ninja=f.tools.get("ninja"),
        nvcc=f.tools.get("nvcc"), roce_v2_gid_index=f.roce_v2_gid_index, uid=f.uid,
        vllm_host_ip=values["vllm_host_ip"], gloo_socket_ifname=values["gloo_socket_ifname"],
        nccl_socket_ifname=values["nccl_socket_ifname"], fabric_ifname=f.fabric_ifname,
    )  # fmt: skip


def raylet_facts(r: PeerRaylet) -> RayletFacts:
    """A peer's raylet as the checks take it (its words cleaned: they reach launch's lines)."""
    env = None
    if r.environment_read:
        env = {var: clean(v) for field, var in _WIRE_VARS if (v := getattr(r, field)) is not None}
    tools = {name: have for name, have in (("ninja", r.ninja), ("nvcc", r.nvcc)) if have is not None}
    return RayletFacts(
        pid=r.pid, node=clean(r.node), head=r.head, gcs_address=clean(r.gcs_address), environ=env,
        memlock_bytes=r.memlock_bytes, tools=tools, roce_v2_gid_index=r.roce_v2_gid_index, uid=r.uid,
        fabric_ifname=None if r.fabric_ifname is None else clean(r.fabric_ifname),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class PeerMemory:
    """The node's pool as launch's plan reads it (core.launch.plan.MemoryView less launch's own margin)."""

    total_bytes: int
    available_bytes: int
    free_bytes: int
    cached_bytes: int
    floor_bytes: int  # the node's own guard floor: its share is held above it
    cpus: int
    # whether the pool is still being handed back (core.launch.settle: a launch waits for every node of its engine)
    shmem_bytes: int = 0  # a torn-down engine's NCCL and IPC segments fall here
    letting_go: int = 0  # engine processes exiting, and orphaned workers holding the GPU


@dataclass(frozen=True, slots=True)
class PeerBudget:
    """An engine over Ray that this node's `sparkwatch launch` started with `--budget worker=SIZE`: the budget of its
    ranks on the other nodes, which Ray starts there (their guards hold them to it: telemetry.raywatch)."""

    group: str  # its placement group's id
    budget_bytes: int
    uid: int  # the launching user's


@dataclass(frozen=True, slots=True)
class WorkerBudget:
    """A peer's word as the group watch takes it: a PeerBudget with the Ray nodes that peer serves (the group's
    driver must run on one of them)."""

    group: str
    budget_bytes: int
    uid: int
    node_ids: frozenset[str]


# The relayed Ray state's lists (RayRelay): the live groups of a node's engines, each a handful of ranks.
RELAY_CAPS = {"nodes": 16, "jobs": 64, "actors": 256, "placement_groups": 64}


@dataclass(frozen=True, slots=True)
class RayRelay:
    """Ray's state as the head node's agent read it from a dashboard it proved its cluster's (the port held by the
    raylets' own user: telemetry.sources.raystate), for the other nodes of that cluster: Ray's state of another host
    moves their guards only this way, inside a proven document (telemetry.raywatch); plain HTTP from the head's
    dashboard is display-only. Only what the group decisions read: the nodes, and the live placement groups with
    their jobs and actors."""

    gcs_address: str  # the cluster's GCS, as its raylets name it: a node takes the relay of its own raylets' cluster
    uid: int  # the cluster's user (the same owner's uid on every Spark, as the worker budgets assume)
    nodes: tuple[RayNode, ...]
    jobs: tuple[RayJob, ...]
    actors: tuple[RayActor, ...]
    placement_groups: tuple[RayPlacementGroup, ...]

    @property
    def state(self) -> RayState:
        return RayState(self.nodes, self.jobs, self.actors, self.placement_groups)


def relay(gcs_address: str, uid: int, state: RayState) -> RayRelay | None:
    """The part of `state` a relay carries: every placement group not removed, the jobs that made them and the actors
    placed in them (dead ones too: a death is what the other nodes act on). None when it would pass a cap (then the
    other nodes' groups fall back to display-only, never to a cut list that would read as members gone)."""
    pgs = tuple(g for g in state.placement_groups if g.state != "REMOVED")
    live = {g.placement_group_id for g in pgs}
    makers = {g.creator_job_id for g in pgs}
    out = RayRelay(
        gcs_address,
        uid,
        state.nodes,
        tuple(j for j in state.jobs if j.job_id in makers),
        tuple(a for a in state.actors if a.placement_group_id in live),
        pgs,
    )
    if any(len(getattr(out, name)) > cap for name, cap in RELAY_CAPS.items()):
        return None
    return out


@dataclass(frozen=True, slots=True)
class PeerDoc:
    version: int
    node: str
    ray_node_ids: tuple[str, ...]
    mem_available_bytes: int | None
    engines: tuple[PeerEngine, ...]
    kills: tuple[PeerKill, ...]  # oldest first
    # None: unknown (before the agent's first cycle, or an agent from before groups without Ray): never a loss
    groups: tuple[PeerMember, ...] | None = None
    ray_gone: tuple[PeerRank, ...] = ()  # absent from an agent older than it: nothing ended that it knows of
    raylets: tuple[PeerRaylet, ...] = ()
    memory: PeerMemory | None = None  # absent from an older agent, and before the first cycle
    budgets: tuple[PeerBudget, ...] = ()
    ray: RayRelay | None = None  # absent from an older agent, and from any node that is not its cluster's head


def kills_from_guard(recent: Iterable[RecentKill]) -> tuple[PeerKill, ...]:
    """The guard's last kills, as it remembered them at the signal (common.stats.RecentKill, in its state messages):
    the peers learn of a kill at once, not after the reap and settle that its event waits for."""
    return tuple(
        PeerKill(
            ts=rfc3339(k.ts),
            kind="group_teardown" if k.trigger == "group_teardown" else "kill",
            trigger=k.trigger,
            summary=clean(k.reason),
            pids=k.pids,
        )
        for k in list(recent)[-KILLS_SHOWN:]
    )


def build(
    node: str,
    ray_node_ids: Iterable[str],
    mem: MemInfo | None,
    engines: Iterable[EngineTree],
    kills: tuple[PeerKill, ...],
    *,
    groups: tuple[PeerMember, ...] | None = None,
    ray_gone: Iterable[tuple[str, int]] = (),
    raylets: Iterable[RayletFacts] = (),
    floor_bytes: int | None = None,
    cpus: int = 1,
    letting_go: int = 0,
    budgets: Iterable[PeerBudget] = (),
    ray: RayRelay | None = None,
) -> bytes:
    memory = None
    if mem is not None and floor_bytes is not None:
        memory = PeerMemory(mem.total_bytes, mem.available_bytes, mem.free_bytes, mem.cached_bytes, floor_bytes,
                            max(cpus, 1), mem.shmem_bytes, letting_go)  # fmt: skip
    if groups is not None and len(groups) > CAPS["groups"]:
        groups = None  # unknown, never cut: a member missing from the list would read as gone (the docstring)
    doc = PeerDoc(
        version=VERSION,
        node=node,
        ray_node_ids=tuple(sorted(ray_node_ids))[: CAPS["ray_node_ids"]],
        mem_available_bytes=None if mem is None else mem.available_bytes,
        engines=tuple(PeerEngine(t.root.pid, t.kind, t.rss_bytes) for t in engines)[: CAPS["engines"]],
        kills=tuple(replace(k, pids=k.pids[:PIDS_PER_KILL]) for k in kills[-CAPS["kills"] :]),
        groups=groups,
        ray_gone=tuple(PeerRank(node_id, pid) for node_id, pid in ray_gone)[: CAPS["ray_gone"]],
        raylets=tuple(peer_raylet(r) for r in raylets)[: CAPS["raylets"]],
        memory=memory,
        budgets=tuple(budgets)[: CAPS["budgets"]],
        ray=ray,
    )
    return json.dumps(to_json(doc), separators=(",", ":")).encode()


def parse(body: bytes) -> PeerDoc:
    """A peer's document; raises ValueError (WireError names the field) on anything else."""
    if len(body) > MAX_DOC_BYTES:
        raise ValueError(f"larger than {MAX_DOC_BYTES} bytes")
    try:
        raw = json.loads(body)
    except RecursionError:  # nesting deeper than the interpreter's stack: not a document
        raise ValueError("peer state: nested too deep") from None
    if isinstance(raw, dict):
        for name, cap in CAPS.items():
            value = raw.get(name)
            if isinstance(value, list) and len(value) > cap:
                raise ValueError(f"peer state: {len(value)} {name}, at most {cap}")
        ray = raw.get("ray")
        ray = ray if isinstance(ray, dict) else {}
        for name, cap in RELAY_CAPS.items():
            value = ray.get(name)
            if isinstance(value, list) and len(value) > cap:
                raise ValueError(f"peer state: ray: {len(value)} {name}, at most {cap}")
        kills = raw.get("kills")
        for kill in kills if isinstance(kills, list) else ():
            pids = kill.get("pids") if isinstance(kill, dict) else None
            if isinstance(pids, list) and len(pids) > PIDS_PER_KILL:
                raise ValueError(f"peer state: a kill of {len(pids)} pids, at most {PIDS_PER_KILL}")
    doc: PeerDoc = from_json(PeerDoc, raw, "peer state")
    if doc.version != VERSION:
        raise ValueError(f"peer state: version {doc.version}, this agent reads {VERSION}")
    return doc


def clean(text: str) -> str:
    """A peer's words as they may reach our events and launch's line: redacted, printable, bounded."""
    text = "".join(c if c.isprintable() else " " for c in redact(text))
    return text if len(text) <= SUMMARY_MAX else text[: SUMMARY_MAX - 1] + "…"


def ray_gone(doc: PeerDoc, node_id: str) -> frozenset[int]:
    """The pids of the ranks on `node_id` that the peer says ended, when the peer serves that node (it names it)."""
    if node_id not in doc.ray_node_ids:
        return frozenset()
    return frozenset(r.pid for r in doc.ray_gone if r.node_id == node_id)


def kill_word(doc: PeerDoc, pid: int | None) -> str | None:
    """The peer guard's word on `pid`, when its guard signalled it: "killed by sparkwatch on spark-b: budget: …"."""
    if pid is None:
        return None
    for kill in reversed(doc.kills):
        if pid in kill.pids:
            return clean(f"killed by sparkwatch on {doc.node}: {kill.trigger}: {kill.summary}")
    return None
