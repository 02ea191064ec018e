"""Who holds a TCP port in LISTEN (issue 37): the agent's own port, taken by another program at start, answers as
this node to its peers and to Prometheus. `sparkwatch doctor` and the metrics endpoint's bind retry name the holder.

The listening sockets on the port in this network namespace (telemetry.sources.listeners: sock_diag, else
/proc/PID/net/tcp and tcp6), each tied to the processes holding its inode open (/proc/PID/fd/* -> `socket:[INODE]`).
A process whose fd directory this user cannot read (another user's, under a non-root agent) is not named: the
socket is then "held by a process this user cannot see".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sparkwatch.common.sources.procs import ProcParseError, ProcScanner
from sparkwatch.telemetry.sources.listeners import listeners, socket_inodes

PROCS_MAX = 65536


@dataclass(frozen=True, slots=True)
class Holder:
    pid: int
    ppid: int
    uid: int
    comm: str


def port_listeners(proc_root: Path | str, port: int) -> set[int]:
    """The inodes of the LISTEN sockets on `port` (any address) in this process's network namespace."""
    return {lst.inode for lst in listeners(proc_root, os.getpid()) if lst.port == port}


def port_holders(proc_root: Path | str, port: int) -> tuple[bool, tuple[Holder, ...]]:
    """Whether anything listens on `port`, and the processes holding it (those this user can see)."""
    inodes = port_listeners(proc_root, port)
    if not inodes:
        return False, ()
    scanner = ProcScanner(Path(proc_root))
    holders = []
    try:
        pids = [int(name) for name in os.listdir(proc_root) if name.isdigit()][:PROCS_MAX]
    except OSError:
        return True, ()
    for pid in pids:
        if not inodes & socket_inodes(proc_root, [pid]):
            continue
        try:
            proc = scanner.read_proc(pid)
        except (ProcParseError, ValueError):
            proc = None
        if proc is not None:
            holders.append(Holder(proc.pid, proc.ppid, proc.uid, proc.comm))
    return True, tuple(holders)


def describe(holders: tuple[Holder, ...]) -> str:
    """`pid 4242 (nc, uid 65534)`, or that the holder is not visible to this user."""
    if not holders:
        return "a process this user cannot see (run as root to name it)"
    return ", ".join(f"pid {h.pid} ({h.comm}, uid {h.uid})" for h in holders)
