"""Engine groups that span nodes over Ray, and when one must be torn down: pure decisions over Ray's own state.

A group is what Ray's GCS says one engine is (issue 29): its driver (the job's driver process, vLLM's
`VLLM::EngineCore`), its placement group, and its ranks (the actors placed in that group, `ray::RayWorkerWrapper`),
each with its node. Telemetry reads that state from the dashboard's state API (telemetry.sources.raystate) and hands
it here as frozen records; this module decides, with no I/O:
- which groups have a member on this node (`local_members`), from the node ids this node's raylet serves;
- whether a group has lost a member (`first_death`): a rank DEAD, or on a node Ray marks DEAD, or a rank Ray still
  lists ALIVE whose own node's agent saw its process end (`gone_per_agents`: Ray learns of it only from that node's
  raylet, and a raylet that died first tells Ray nothing until its health check fails, about 15 s);
- what this node must stop (`teardowns`): its own ranks, the driver when it runs here, and the driver's parent when
  that is the `vllm serve` API server. Only processes in this node's process table with the same start time.

A cluster belongs to a user (`Cluster`): the uid of the raylets that serve it here, found by their executable, and
whose Ray state is believed only from a dashboard that user's process listens for (telemetry.sources.raystate).
Its members are that user's processes only: a rank is a worker one of those raylets started (its parent), the driver
and the API server that user's. Another user's `vllm serve` is never a member, whatever Ray's state names.

The guard checks every member again itself (`member_shape`, the pid and start time, its own node) before any signal:
Ray's word is a reason to look, never a reason to kill.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from sparkwatch.core.model import Proc

# Roles of a group's local members, as the guard checks their shape (member_shape).
RANK = "rank"
DRIVER = "driver"
API = "api"

# Causes of a teardown (the event's `cause` field).
RANK_DIED = "rank_died"
NODE_DEAD = "node_dead"


@dataclass(frozen=True, slots=True)
class RayNode:
    node_id: str
    node_ip: str
    alive: bool


@dataclass(frozen=True, slots=True)
class RayJob:
    job_id: str
    driver_pid: int | None
    driver_ip: str
    running: bool


@dataclass(frozen=True, slots=True)
class RayActor:
    actor_id: str
    class_name: str
    state: str  # ALIVE, DEAD, RESTARTING, PENDING_CREATION, DEPENDENCIES_UNREADY
    job_id: str
    node_id: str
    pid: int | None
    placement_group_id: str | None


@dataclass(frozen=True, slots=True)
class RayPlacementGroup:
    placement_group_id: str
    creator_job_id: str
    state: str  # CREATED, PENDING, REMOVED, RESCHEDULING
    node_ids: tuple[str, ...]  # each bundle's node


@dataclass(frozen=True, slots=True)
class RayState:
    nodes: tuple[RayNode, ...]
    jobs: tuple[RayJob, ...]
    actors: tuple[RayActor, ...]
    placement_groups: tuple[RayPlacementGroup, ...]


@dataclass(frozen=True, slots=True)
class RayGroup:
    """One engine over Ray: a live placement group, the job that made it, and the actors placed in it."""

    group: str  # the placement group's id
    job: RayJob | None
    driver_node_id: str | None
    ranks: tuple[RayActor, ...]


@dataclass(frozen=True, slots=True)
class Death:
    cause: str
    node_id: str
    node_ip: str
    pid: int | None


@dataclass(frozen=True, slots=True)
class Member:
    pid: int
    start_ticks: int
    role: str


@dataclass(frozen=True, slots=True)
class Cluster:
    """This node's part of one user's Ray cluster: the node ids its raylets serve, their pids (a rank is a worker one
    of them started), and the user they run as (every member is that user's process)."""

    node_ids: frozenset[str]
    uid: int
    raylet_pids: frozenset[int]


@dataclass(frozen=True, slots=True)
class Teardown:
    """What this node must stop for one group, and why."""

    group: str
    job_id: str
    death: Death
    members: tuple[Member, ...]


def groups(state: RayState) -> tuple[RayGroup, ...]:
    """Every live placement group (CREATED or RESCHEDULING) with its job and the actors placed in it."""
    jobs = {j.job_id: j for j in state.jobs}
    # Ray keeps a dead node's record when the node comes back under a new id at the same address: the live one wins
    by_ip = {n.node_ip: n.node_id for n in sorted(state.nodes, key=lambda n: n.alive)}
    out = []
    for pg in state.placement_groups:
        if pg.state not in ("CREATED", "RESCHEDULING"):
            continue
        job = jobs.get(pg.creator_job_id)
        ranks = tuple(a for a in state.actors if a.placement_group_id == pg.placement_group_id)
        out.append(RayGroup(pg.placement_group_id, job, by_ip.get(job.driver_ip) if job else None, ranks))
    return tuple(out)


def local_ranks(state: RayState, local_node_ids: frozenset[str]) -> frozenset[tuple[str, int]]:
    """(node id, pid) of the ranks Ray lists ALIVE on this node in a live group: what this node's agent tells its
    peers of when one's process ends (telemetry.raywatch)."""
    return frozenset(
        (a.node_id, a.pid)
        for g in groups(state)
        for a in g.ranks
        if a.state == "ALIVE" and a.pid and a.node_id in local_node_ids
    )


def remote_rank_nodes(state: RayState, local_node_ids: frozenset[str]) -> frozenset[str]:
    """The other nodes that run an ALIVE rank of a live group: the ones whose agents' word on their ranks matters."""
    return frozenset(
        a.node_id for g in groups(state) for a in g.ranks if a.state == "ALIVE" and a.node_id not in local_node_ids
    )


def gone_per_agents(state: RayState, gone: frozenset[tuple[str, int]]) -> RayState:
    """Ray's state with the ranks that their own node's agent saw end (`gone`: (node id, pid)) marked DEAD, for the
    decisions only. Only an actor Ray places on that very node with that pid is marked: a peer names its own node's
    processes, never another node's."""
    if not gone:
        return state
    actors = tuple(
        replace(a, state="DEAD") if a.state == "ALIVE" and (a.node_id, a.pid) in gone else a for a in state.actors
    )
    return replace(state, actors=actors)


def first_death(
    group: RayGroup, state: RayState, consequences: frozenset[tuple[str, int]] = frozenset()
) -> Death | None:
    """The member whose loss ends the group, or None while every member lives. A rank DEAD in Ray's state (its
    worker process gone: killed, OOM-killed, crashed), or a rank or the driver on a node Ray marks DEAD.

    Ray keeps no time of death: when several ranks are dead at first sight, those a node's agent says it stopped
    as a group teardown (`consequences`: (node id, pid), from the peers) are the consequence, never the cause; the
    others come first, in Ray's order."""
    nodes = {n.node_id: n for n in state.nodes}
    ranks = sorted(group.ranks, key=lambda a: (a.node_id, a.pid or 0) in consequences)
    for actor in ranks:
        node = nodes.get(actor.node_id)
        ip = node.node_ip if node is not None else ""
        if actor.state == "DEAD":
            return Death(RANK_DIED, actor.node_id, ip, actor.pid)
        if node is not None and not node.alive:
            return Death(NODE_DEAD, actor.node_id, ip, actor.pid)
    driver_node = nodes.get(group.driver_node_id or "")
    if driver_node is not None and not driver_node.alive and group.job is not None:
        return Death(NODE_DEAD, driver_node.node_id, driver_node.node_ip, group.job.driver_pid)
    return None


def local_members(group: RayGroup, cluster: Cluster, procs: Mapping[int, Proc]) -> tuple[Member, ...]:
    """The group's members that run on this node, as this node's process table shows them (`procs`: pid -> Proc of
    the processes on this node): its ranks still alive there that the cluster's raylets started, the driver when its
    node is this one, and the driver's parent when it is shaped like vLLM's API server; each the cluster's user's
    process. A pid missing from the table is left out."""
    out: list[Member] = []
    for actor in group.ranks:
        proc = procs.get(actor.pid or 0)
        if (
            actor.node_id in cluster.node_ids
            and proc is not None
            and proc.uid == cluster.uid
            and proc.ppid in cluster.raylet_pids
            and member_shape(RANK, proc.argv)
        ):
            out.append(Member(proc.pid, proc.start_ticks, RANK))
    if group.job is not None and group.driver_node_id in cluster.node_ids:
        driver = procs.get(group.job.driver_pid or 0)
        if driver is not None and driver.uid == cluster.uid:
            out.append(Member(driver.pid, driver.start_ticks, DRIVER))
            api = procs.get(driver.ppid)
            if api is not None and api.uid == cluster.uid and member_shape(API, api.argv):
                out.append(Member(api.pid, api.start_ticks, API))
    return tuple(out)


def teardowns(
    state: RayState,
    cluster: Cluster,
    procs: Mapping[int, Proc],
    done: Iterable[str] = (),
    consequences: frozenset[tuple[str, int]] = frozenset(),
) -> tuple[Teardown, ...]:
    """The groups with a dead member and a live member on this node, with what this node must stop. `done`: groups
    already torn down here whose members are all gone (never asked again); `consequences`: see first_death."""
    skip = frozenset(done)
    out = []
    for group in groups(state):
        if group.group in skip:
            continue
        death = first_death(group, state, consequences)
        if death is None:
            continue
        members = local_members(group, cluster, procs)
        if members:
            out.append(Teardown(group.group, group.job.job_id if group.job else "", death, members))
    return tuple(out)


def member_shape(role: str, argv: tuple[str, ...]) -> bool:
    """Whether a process looks like what its role says, by the title the engine and Ray give it: a rank is a Ray
    worker running an actor (`ray::ClassName...`, never `ray::IDLE` or Ray's own agents), a driver is vLLM's engine
    core (`VLLM::EngineCore`, `VLLM::EngineCore_DP0`), the API server runs `vllm serve`."""
    if not argv:
        return False
    head = argv[0]
    if role == RANK:
        return (
            head.startswith("ray::")
            and not head.startswith(("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent"))
            and len(head) > len("ray::")
        )
    if role == DRIVER:
        return head.split(" ", 1)[0].startswith("VLLM::EngineCore")
    if role == API:
        for i, arg in enumerate(argv[:3]):
            if arg.rsplit("/", 1)[-1] == "vllm" and argv[i + 1 : i + 2] == ("serve",):
                return True
        return False
    return False


# The driver's death removes its placement group within 0.2 s (measured on the two-node test cluster); one still
# there this long after this node's teardown is held by a driver that did not die (wedged, or on a node whose agent
# did not act), and the next launch would wait on it. Long enough for the driver's own node's agent to act first (it
# reads Ray's state every ray_poll_s, 2 s): once the group is removed, that agent no longer sees it, and a wedged
# driver there would be left running. 3 s was too short on a loaded 2-core box (one run of a fresh-clone suite).
PG_GRACE_S = 10.0


def leaked_groups(live: Iterable[RayGroup], torn_at: Mapping[str, float], now: float) -> tuple[str, ...]:
    """Groups this node tore down at least PG_GRACE_S ago (`torn_at`: group -> monotonic time of its teardown) whose
    placement group Ray still holds: to be removed."""
    return tuple(g.group for g in live if g.group in torn_at and now - torn_at[g.group] >= PG_GRACE_S)


# --- what `sparkwatch engines` shows of each group


@dataclass(frozen=True, slots=True)
class GroupMemberRow:
    role: str  # RANK or DRIVER
    name: str  # the actor's class (a rank), "driver" (the job's driver)
    node_id: str
    node_ip: str
    pid: int | None
    state: str  # a rank's actor state (ALIVE, DEAD, …); the driver's job RUNNING or ENDED
    local: bool  # on this node (a node id this node's raylets serve)


@dataclass(frozen=True, slots=True)
class GroupRow:
    group: str
    job_id: str
    members: tuple[GroupMemberRow, ...]  # the driver first, then the ranks in Ray's order
    death: Death | None  # the member whose loss ends the group, None while all live

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.node_ip or m.node_id for m in self.members))


def group_rows(state: RayState, local_node_ids: frozenset[str]) -> tuple[GroupRow, ...]:
    """Each live group as `sparkwatch engines` lists it: its nodes, its driver's node and pid, its ranks, which of
    them run on this node, and its first death if it has one."""
    nodes = {n.node_id: n for n in state.nodes}

    def ip(node_id: str) -> str:
        node = nodes.get(node_id)
        return node.node_ip if node is not None else ""

    out = []
    for group in groups(state):
        members: list[GroupMemberRow] = []
        if group.job is not None:
            node_id = group.driver_node_id or ""
            members.append(
                GroupMemberRow(
                    DRIVER,
                    "driver",
                    node_id,
                    group.job.driver_ip or ip(node_id),
                    group.job.driver_pid,
                    "RUNNING" if group.job.running else "ENDED",
                    node_id in local_node_ids,
                )
            )
        for actor in group.ranks:
            members.append(
                GroupMemberRow(
                    RANK,
                    actor.class_name,
                    actor.node_id,
                    ip(actor.node_id),
                    actor.pid,
                    actor.state,
                    actor.node_id in local_node_ids,
                )
            )
        out.append(
            GroupRow(group.group, group.job.job_id if group.job else "", tuple(members), first_death(group, state))
        )
    return tuple(out)
