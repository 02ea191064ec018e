"""`sparkwatch doctor`'s checks of the pair (issue 37; docs/multinode.md): whether the peers' word is proven, and
whether this node's agent port is its agent's. Pure: the facts come from the command."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparkwatch.core.enums import CheckStatus
from sparkwatch.core.model import Check
from sparkwatch.core.units import format_size
from sparkwatch.core.words import plural

PROOF_WORDS = {"key": "proven (peer_key_file)", "mtls": "proven (mutual TLS)", None: "display-only"}


@dataclass(frozen=True, slots=True)
class PeerView:
    """One peer as a command read it (cli.peerread): `status`'s PEERS section and `doctor`'s peers check."""

    label: str  # as configured
    proof: str | None  # how its word is proven: "key" (peer_key_file), "mtls"; None: display-only (moves nothing)
    error: str | None = None  # why its last read took no document; None: it answered
    node: str | None = None  # the name its last document gave (None: no document yet)
    age_s: float | None = None  # since its last document was taken (None: never)
    mem_available_bytes: int | None = None
    engines: int = 0
    groups: tuple[str, ...] | None = ()  # its members of engine groups ("rendezvous rank N"); None: unknown
    ray_nodes: int = 0  # the Ray nodes its raylets serve


def peer_line(v: PeerView) -> str:
    """`spark-b (10.0.0.2:9101): proven (peer_key_file), answered 0.0 s ago, MemAvailable 52.0 GiB, 1 engine tree,
    groups: 10.0.0.1:29500 rank 1`; `10.0.0.3:9101: no answer (refused: …)`."""
    name = v.label if v.node is None else f"{v.node} ({v.label})"
    trust = PROOF_WORDS.get(v.proof, "display-only")
    if v.node is None:
        return f"{name}: no answer ({v.error}), {trust}"
    mem = (
        "MemAvailable unknown"
        if v.mem_available_bytes is None
        else f"MemAvailable {format_size(v.mem_available_bytes)}"
    )
    groups = (
        "groups unknown" if v.groups is None else ("no groups" if not v.groups else "groups: " + ", ".join(v.groups))
    )
    ray = f", Ray: {plural(v.ray_nodes, 'node')}" if v.ray_nodes else ""
    age = "?" if v.age_s is None else f"{max(v.age_s, 0.0):.1f} s"
    facts = f"{mem}, {plural(v.engines, 'engine tree')}, {groups}{ray}"
    if v.error is not None:
        return f"{name}: no answer ({v.error}); its last answer {age} ago, {trust}: {facts}"
    return f"{name}: {trust}, answered {age} ago, {facts}"


def peers_check(line: str | None, display_only: bool, peers: Sequence[PeerView] = ()) -> Check:
    """One line on the peers (common.peerproof.peers_line), then each peer's state as read now (peer_line); skip
    without peers. Warn: a display-only peer (its word moves nothing), or one that gave no document."""
    if line is None:
        return Check("peers", CheckStatus.SKIP, "no peers configured")
    summary = "; ".join([line, *(peer_line(v) for v in peers)])
    silent = [v.label for v in peers if v.error is not None]
    fixes = []
    if display_only:
        fixes += [
            "sparkwatch peer-key write /etc/sparkwatch/peer.key   # on one node; scp it to the other",
            'peer_key_file = "/etc/sparkwatch/peer.key"   # in both configs, then restart sparkwatch',
        ]
    if silent:
        fixes.append(
            f"on {', '.join(silent)}: systemctl status sparkwatch   # its agent must run and listen on an address "
            "this node reaches (`listen`, docs/multinode.md)"
        )
    if fixes:
        return Check("peers", CheckStatus.WARN, summary, fix="\n".join(fixes))
    return Check("peers", CheckStatus.OK, summary)


def listen_skipped(listen: str) -> Check:
    return Check("listen", CheckStatus.SKIP, f"{listen}: not this machine's port under --root")


def listen_check(listen: str, listening: bool, holders: str, agent: bool | None, agent_running: bool) -> Check:
    """The agent's port. `listening`: something listens on it; `holders`: who (portholder.describe); `agent`: whether
    that is this node's agent (None: not known, the holder not visible); `agent_running`: a guard of ours runs."""
    if not listening:
        if agent_running:
            return Check("listen", CheckStatus.WARN, f"{listen}: nothing listens there; the agent binds it every 5 s")
        return Check("listen", CheckStatus.OK, f"{listen}: free for the agent")
    if agent:
        return Check("listen", CheckStatus.OK, f"{listen}: served by this node's agent ({holders})")
    fix = "stop that program or move it off the port; the agent binds the port again every 5 s"
    return Check(
        "listen",
        CheckStatus.FAIL,
        f"{listen} is held by {holders}, not this node's agent: it answers as this node to its peers and to Prometheus",
        fix=fix,
    )
