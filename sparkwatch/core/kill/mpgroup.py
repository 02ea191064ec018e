"""Engine groups that span nodes without Ray, keyed by the engine's own rendezvous: pure decisions (issue 29).

With vLLM's multiprocessing backend across nodes (`vllm serve … --nnodes 2 --node-rank 0 --master-addr A
--master-port P`, the other node with `--node-rank 1 --headless`) or SGLang's (`--nnodes 2 --node-rank 1
--dist-init-addr A:P`), each node runs one engine process tree, and nothing but the collective ties them: the head
"blocks forever on the next collective" when its peer dies, and a headless node never exits after its head died.

A group here is every engine tree whose command line names the same rendezvous (`A:P`), run by the same user (uid):
a process of another user naming that rendezvous is never taken for the owner's member, so starting and stopping one
cannot end the owner's engine on another node. Each node's agent lists its own members in its peer document
(telemetry.peerdoc); an agent that sees a peer's member of a group it also runs
vanish, or the peer itself lost, stops its own members (`teardowns`). The guard checks each member again itself
(`member_of`: the pid and start time, its own network namespace, the same rendezvous on its own command line).
llama.cpp's RPC backend is the other shape: the head (`llama-server --rpc 10.0.0.2:50052,…`) connects to an
`rpc-server` on each other node. Each endpoint the head names is a group's key (`rpc_endpoints`); the rpc-server
that serves it lists the same key (its address on that connection and its port: telemetry.mpwatch), as a worker
(`RPC_WORKER`): when it ends, or its node is lost, the head that would block on it forever is stopped. A head that
ends stops nothing there: an rpc-server frees a client's buffers when it disconnects and waits for the next.
A member that dies on this node leaves its children behind, reparented and out of any group's tree; the agent stops
those it saw in the member's tree (`MP_ORPHAN`), and the guard only those still of an engine's shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MP_RANK = "mp_rank"  # the role of a member (an engine tree's root) in a GroupTeardownMsg
# the role of a process a dead member of this node left behind (its engine core, its workers: reparented, no longer
# in the member's tree): tied to the group only by the tree telemetry saw while the member lived
MP_ORPHAN = "mp_orphan"
PEER_LOST = "peer_lost"  # a cause: the peer's agent stopped answering (its node is gone, or wedged)
RANK_GONE = "rank_died"  # a cause, as Ray's groups say it: the peer's member is no longer in its table

RPC_WORKER = -1  # the node rank an rpc-server is listed with: a worker of the head's group, never stopped for it
RPC_PORT = 50052  # rpc-server's default port (llama.cpp tools/rpc/rpc-server.cpp)

# vLLM's defaults (vllm/config/parallel.py: master_addr "127.0.0.1", master_port 29501)
VLLM_MASTER_ADDR = "127.0.0.1"
VLLM_MASTER_PORT = 29501


@dataclass(frozen=True, slots=True)
class Rendezvous:
    key: str  # "addr:port": what every member of one group names
    nnodes: int
    node_rank: int


@dataclass(frozen=True, slots=True)
class Member:
    """One node's member of a group: the root of its engine tree."""

    key: str
    node_rank: int
    pid: int
    start_ticks: int
    uid: int

    @property
    def group(self) -> GroupId:
        return self.key, self.uid


# A group: its rendezvous and the user that runs its members; a member as a peer lists it: (rendezvous, uid, pid)
GroupId = tuple[str, int]
Listed = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class Loss:
    """What ended a group, as seen from this node: which peer (as configured), its node's name, the member it lost
    (None: the peer itself is lost), and why."""

    key: str
    uid: int
    cause: str
    peer: str
    node: str
    pid: int | None


@dataclass(frozen=True, slots=True)
class Teardown:
    loss: Loss
    members: tuple[Member, ...]  # this node's members of the group


def _options(argv: tuple[str, ...]) -> dict[str, str]:
    """`--flag value` and `--flag=value`, the last one winning as argparse does; underscores as dashes (vLLM
    accepts both spellings)."""
    out: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")
        if eq:
            out[name] = value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[name] = argv[i + 1]
        else:
            out[name] = ""
    return out


def rendezvous(argv: tuple[str, ...]) -> Rendezvous | None:
    """The rendezvous an engine's command line names when it spans nodes (`--nnodes` over 1), else None. vLLM:
    `--master-addr`/`--master-port` (defaults as vLLM's); SGLang: `--dist-init-addr host:port`. A value that does not
    parse is None: a parse error never makes a member."""
    opts = _options(argv)
    try:
        nnodes = int(opts.get("--nnodes", "1"))
        rank = int(opts.get("--node-rank", "0"))
        if "--dist-init-addr" in opts:
            host, sep, port_s = opts["--dist-init-addr"].rpartition(":")
            if not sep:
                return None
            port = int(port_s)
        else:
            host = opts.get("--master-addr", VLLM_MASTER_ADDR)
            port = int(opts.get("--master-port", str(VLLM_MASTER_PORT)))
    except ValueError:
        return None
    if nnodes < 2 or not 0 <= rank < nnodes or not host or not 0 < port < 65536:
        return None
    return Rendezvous(f"{host}:{port}", nnodes, rank)


def rpc_endpoints(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The rpc-servers a llama.cpp head names (`--rpc host:port,host:port`): one group key each. An entry that does
    not parse is left out."""
    out = []
    for item in _options(argv).get("--rpc", "").split(","):
        host, sep, port_s = item.strip().rpartition(":")
        try:
            port = int(port_s)
        except ValueError:
            continue
        if sep and host and 0 < port < 65536:
            out.append(f"{host}:{port}")
    return tuple(out)


def rpc_server_port(argv: tuple[str, ...]) -> int | None:
    """The port an `rpc-server` listens on (`-p`/`--port`, else 50052); None for any other process or a port that
    does not parse."""
    if not argv or argv[0].rsplit("/", 1)[-1] != "rpc-server":
        return None
    port_s = str(RPC_PORT)
    for i, arg in enumerate(argv):
        if arg in ("-p", "--port") and i + 1 < len(argv):
            port_s = argv[i + 1]
        elif arg.startswith("--port="):
            port_s = arg.partition("=")[2]
    try:
        port = int(port_s)
    except ValueError:
        return None
    return port if 0 < port < 65536 else None


def group_keys(argv: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """The groups an engine's root takes part in as a member that may be stopped for them, with its node rank: its
    rendezvous (`--nnodes`), or each rpc-server it names (a llama.cpp head, node rank 0)."""
    r = rendezvous(argv)
    if r is not None:
        return ((r.key, r.node_rank),)
    return tuple((key, 0) for key in rpc_endpoints(argv))


def member_role(member: Member) -> str:
    """What a member is to its group, as `sparkwatch engines` says it."""
    return "rpc-server" if member.node_rank == RPC_WORKER else "member"


def member_of(key: str, argv: tuple[str, ...]) -> bool:
    """The guard's own check of a member telemetry named: its command line names this group's rendezvous, or (a
    llama.cpp head) this rpc-server."""
    return any(k == key for k, _rank in group_keys(argv))


def teardowns(
    local: Iterable[Member],
    peers_then: Mapping[str, tuple[str, frozenset[Listed]]],
    peers_now: Mapping[str, tuple[str, frozenset[Listed]] | None],
    done: Iterable[GroupId] = (),
) -> tuple[Teardown, ...]:
    """The groups this node must stop its members of. `peers_then`/`peers_now`: per peer, its node's name and the
    members it listed (rendezvous, uid, pid) at its previous and at its latest answer; None now: the peer is lost; a
    peer missing from `peers_now` decides nothing. A group ends here when a peer that listed a member of it no longer
    does (that rank ended, however), or when the peer that held one is lost. `done`: groups already handed to the
    guard (never asked again)."""
    mine: dict[GroupId, list[Member]] = {}
    for m in local:
        mine.setdefault(m.group, []).append(m)
    skip = frozenset(done)
    losses: dict[GroupId, Loss] = {}
    for peer, then in peers_then.items():
        node, before = then
        if peer not in peers_now:  # no answer that says (not read yet, or its groups unknown): nothing decided
            continue
        now = peers_now[peer]
        for key, uid, pid in sorted(before):
            group = (key, uid)
            if group not in mine or group in skip or group in losses:
                continue
            if now is None:
                losses[group] = Loss(key, uid, PEER_LOST, peer, node, None)
            elif (key, uid, pid) not in now[1]:
                losses[group] = Loss(key, uid, RANK_GONE, peer, node, pid)
    return tuple(Teardown(loss, tuple(mine[group])) for group, loss in losses.items())
