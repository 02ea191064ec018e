"""The raylets on this node: Ray's own raylet executable in our network namespace, read from the process table and
/proc/PID/exe (a few readlinks, for processes named raylet only). Apart from Ray's state API client
(telemetry.sources.raystate), so that a command on a node without Ray (`engines`) looks for raylets without loading
the state API's records.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sparkwatch.common.sources.procs import same_netns
from sparkwatch.core.model import Proc

RAYLET_COMM = "raylet"
# Ray's own raylet executable, as every Ray wheel installs it (site-packages/ray/core/src/ray/raylet/raylet): a process
# that only calls itself `raylet` (its comm, which any user sets with prctl or by naming a script) is not one.
RAYLET_EXE_SUFFIX = "/ray/core/src/ray/raylet/raylet"
DELETED = " (deleted)"  # the kernel's mark on an executable replaced since (a pip upgrade under a running raylet)


@dataclass(frozen=True, slots=True)
class LocalRaylet:
    """A raylet in our network namespace, from its command line: the node it serves, its cluster's GCS, and the
    interpreter its Python workers run (the engine's own: Ray runs every worker with the driver's environment). Its
    `uid` owns the cluster it serves on this node (core.kill.raygroup.Cluster): only that user's processes are its
    members, and only that user's interpreter is ever run for it (start_remove_pg)."""

    pid: int
    node_id: str
    gcs_address: str
    python: str
    node_ip: str = ""  # --node_ip_address
    head: bool = False  # started by `ray start --head`
    uid: int = -1  # the user it runs as


def flag(argv: tuple[str, ...], name: str) -> str:
    prefix = f"--{name}="
    return next((a[len(prefix) :] for a in argv if a.startswith(prefix)), "")


def is_raylet_exe(proc_root: Path | str, pid: int) -> bool:
    """Whether `pid` runs Ray's own raylet executable (/proc/PID/exe, which the kernel sets at exec)."""
    try:
        exe = os.readlink(f"{proc_root}/{pid}/exe")
    except OSError:
        return False
    return exe.removesuffix(DELETED).endswith(RAYLET_EXE_SUFFIX)


def raylets_named(procs: Iterable[Proc]) -> frozenset[tuple[int, int]]:
    """The processes that call themselves raylet, by (pid, start ticks): a comparison of names and no read, for the
    telemetry loop to tell the group watch when they change (local_raylets then decides which are raylets)."""
    return frozenset(p.key for p in procs if p.comm == RAYLET_COMM)


def local_raylets(procs: Iterable[Proc], proc_root: Path) -> tuple[LocalRaylet, ...]:
    """The raylets in our own network namespace: Ray's raylet executable, not a name (a few readlinks: processes
    named raylet only)."""
    out = []
    for p in procs:
        if p.comm != RAYLET_COMM:
            continue
        node_id = flag(p.argv, "node_id")
        if not node_id or not same_netns(proc_root, p.pid) or not is_raylet_exe(proc_root, p.pid):
            continue
        worker = flag(p.argv, "python_worker_command").split(" ", 1)[0]
        node_ip = flag(p.argv, "node_ip_address")
        out.append(LocalRaylet(p.pid, node_id, flag(p.argv, "gcs-address"), worker, node_ip, "--head" in p.argv, p.uid))
    return tuple(out)
