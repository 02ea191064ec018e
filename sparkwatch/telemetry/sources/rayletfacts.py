"""What a raylet on this node gives the ranks it starts (issue 30; core.launch.rayletenv): the variables of its
environment that are checked (/proc/PID/environ, nothing else of it kept), its locked-memory limit
(/proc/PID/limits), ninja and nvcc on its PATH, and the RoCEv2 GID index sysfs shows now
(<root>/sys/class/infiniband), and the network interface that holds the node's address (the fabric the ranks' Gloo
and NCCL sockets must use). Read by `sparkwatch launch` for this node's raylets, and by the agent for its peers
(telemetry.peerdoc: a launch on another node holds this node's raylets to the same checks).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from sparkwatch.common.sources.environ import read_environ
from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.core.launch.rayletenv import CHECKED_VARS, UNLIMITED, RayletFacts, roce_v2_gid_index
from sparkwatch.telemetry.sources.raylets import LocalRaylet, local_raylets

TOOLS = ("ninja", "nvcc")


def local_facts(proc_root: Path, root: Path, raylets: Iterable[LocalRaylet] | None = None) -> list[RayletFacts]:
    """The facts of each raylet in our network namespace (`raylets`, else found in a scan of /proc)."""
    if raylets is None:
        raylets = local_raylets(ProcScanner(proc_root).scan().procs, proc_root)
    return [facts(raylet, proc_root, root) for raylet in raylets]


def facts(raylet: LocalRaylet, proc_root: Path, root: Path) -> RayletFacts:
    """One raylet's facts: of its environment only the variables checked (never the rest: it may hold tokens)."""
    env = read_environ(proc_root, raylet.pid)
    return RayletFacts(
        pid=raylet.pid,
        node=raylet.node_ip or raylet.node_id[:12],
        head=raylet.head,
        gcs_address=raylet.gcs_address,
        environ=None if env is None else {k: env[k] for k in CHECKED_VARS if k in env},
        memlock_bytes=read_memlock(proc_root, raylet.pid),
        tools={} if env is None else {t: on_path(env.get("PATH", ""), t) for t in TOOLS},
        roce_v2_gid_index=None if env is None else gid_index(root, env.get("NCCL_IB_HCA", "")),
        uid=raylet.uid,
        fabric_ifname=interface_of(raylet.node_ip) if raylet.node_ip else None,
    )


SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The interface of this network namespace whose IPv4 address is `address` (its primary address, as SIOCGIFADDR
    gives it); None when none holds it."""
    try:
        names = socket.if_nameindex()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    except OSError:
        return None
    with sock:
        for _index, name in names:
            try:
                answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def read_memlock(proc_root: Path, pid: int) -> int | None:
    """The soft "Max locked memory" limit in bytes, UNLIMITED, or None when unreadable."""
    try:
        text = (proc_root / str(pid) / "limits").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Max locked memory"):
            soft = line[len("Max locked memory") :].split()[0]
            return UNLIMITED if soft == "unlimited" else int(soft) if soft.isdigit() else None
    return None


def on_path(path: str, tool: str) -> bool:
    return any(os.access(os.path.join(d, tool), os.X_OK) for d in path.split(":") if d)


def gid_index(root: Path, hca: str) -> int | None:
    """The RoCEv2 GID index of the first port of the device NCCL_IB_HCA names (its first entry; any device when
    unset), as sysfs shows it now; None without RoCE."""
    base = root / "sys" / "class" / "infiniband"
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return None
    wanted = hca.split(",", maxsplit=1)[0].lstrip("=^").split(":")[0]
    for device in devices:
        if wanted and device != wanted:
            continue
        ports = base / device / "ports"
        try:
            port_names = sorted(os.listdir(ports), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            continue
        for port in port_names:
            types, gids = _table(ports / port / "gid_attrs" / "types"), _table(ports / port / "gids")
            index = roce_v2_gid_index(types, gids)
            if index is not None:
                return index
    return None


def _table(path: Path) -> Mapping[int, str]:
    """A sysfs directory of small files named by index: {index: text}; unreadable entries left out (the kernel
    answers EINVAL for a GID type of an empty slot)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            out[int(name)] = (path / name).read_text(errors="replace").strip()
        except OSError:
            continue
    return out
