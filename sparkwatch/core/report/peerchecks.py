"""`sparkwatch doctor`'s checks of the pair (issue 37; docs/multinode.md): whether the peers' word is proven, and
whether this node's agent port is its agent's. Pure: the facts come from the command."""

from __future__ import annotations

from sparkwatch.core.enums import CheckStatus
from sparkwatch.core.model import Check


def peers_check(line: str | None, display_only: bool) -> Check:
    """One line on the peers (common.peerproof.peers_line); skip without peers."""
    if line is None:
        return Check("peers", CheckStatus.SKIP, "no peers configured")
    if display_only:
        fix = (
            "sparkwatch peer-key write /etc/sparkwatch/peer.key   # on one node; scp it to the other\n"
            'peer_key_file = "/etc/sparkwatch/peer.key"   # in both configs, then restart sparkwatch'
        )
        return Check("peers", CheckStatus.WARN, line, fix=fix)
    return Check("peers", CheckStatus.OK, line)


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
