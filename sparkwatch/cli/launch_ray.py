"""What `sparkwatch launch` checks of a Ray cluster before an engine over it starts (issue 30; docs/launch.md):

- the raylets on this node, held to what the engine's ranks need (core.launch.rayletenv): each one's environment
  (/proc/PID/environ), its locked-memory limit (/proc/PID/limits), ninja and nvcc on its PATH, and the RoCEv2 GID
  index sysfs shows now (<root>/sys/class/infiniband). Only raylets in launch's own network namespace: this node's;
- the placement groups the new engine would wait behind (core.launch.stalepg), from Ray's state API
  (`ray_dashboard_url`), and with `--fix` their removal through Ray (the helper the group watch uses).
Read once, before the start.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sparkwatch.common.sources.procs import ProcParseError, ProcScanner
from sparkwatch.core.launch.rayletenv import UNLIMITED, Problem, RayletFacts, check, fix_line, roce_v2_gid_index
from sparkwatch.core.launch.stalepg import StaleGroup, stale_groups
from sparkwatch.telemetry.sources.raystate import (
    LocalRaylet,
    RayStateError,
    RayStateSource,
    local_raylets,
    start_remove_pg,
)

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings

ENVIRON_MAX_BYTES = 1 << 20
REMOVE_TIMEOUT_S = 30.0  # the helper connects as a Ray driver: 2-3 s on the 2-core test box
GONE_WAIT_S = 10.0  # after the removal, how long Ray may take to list the group REMOVED
TOOLS = ("ninja", "nvcc")


def raylets(settings: Settings) -> list[RayletFacts]:
    proc_root = Path(settings.proc_root)
    out = []
    for raylet in local_raylets(ProcScanner(proc_root).scan().procs, proc_root):
        env = read_environ(proc_root, raylet.pid)
        out.append(
            RayletFacts(
                pid=raylet.pid,
                node=raylet.node_ip or raylet.node_id[:12],
                head=raylet.head,
                gcs_address=raylet.gcs_address,
                environ=env,
                memlock_bytes=read_memlock(proc_root, raylet.pid),
                tools={} if env is None else {t: on_path(env.get("PATH", ""), t) for t in TOOLS},
                roce_v2_gid_index=None if env is None else gid_index(Path(settings.root), env.get("NCCL_IB_HCA", "")),
            )
        )
    return out


def problems(settings: Settings, jobs: int) -> list[tuple[RayletFacts, tuple[Problem, ...], str | None]]:
    """Each raylet here, what it lacks for an engine that may run `jobs` compile jobs, and the line that fixes it."""
    out = []
    for raylet in raylets(settings):
        found = check(raylet, jobs)
        out.append((raylet, found, fix_line(raylet, found, jobs) if found else None))
    return out


def read_environ(proc_root: Path, pid: int) -> dict[str, str] | None:
    """A process's environment as it started (None: not ours to read, or gone)."""
    try:
        with open(proc_root / str(pid) / "environ", "rb") as fh:
            data = fh.read(ENVIRON_MAX_BYTES)
    except OSError:
        return None
    out = {}
    for item in data.split(b"\0"):
        name, eq, value = item.decode(errors="replace").partition("=")
        if eq and name:
            out[name] = value
    return out


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


def stale(settings: Settings) -> tuple[tuple[StaleGroup, ...], str | None]:
    """The placement groups a new engine would wait behind, and None; or () and why Ray's state could not be read
    (no dashboard: not checked, said once, never a refusal)."""
    source = RayStateSource(settings.ray_dashboard_url)
    try:
        state = source.poll()
    except RayStateError as exc:
        return (), f"Ray's state API at {settings.ray_dashboard_url}: {exc.kind}: {exc}"
    finally:
        source.close()
    scanner = ProcScanner(Path(settings.proc_root))
    stopped = set()
    for job in state.jobs:
        if job.driver_pid is None:
            continue
        try:
            proc = scanner.read_proc(job.driver_pid)
        except (ProcParseError, ValueError):
            continue
        if proc is not None and proc.state in ("T", "t"):
            stopped.add(job.driver_pid)
    return stale_groups(state, stopped), None


def remove(settings: Settings, groups: tuple[StaleGroup, ...]) -> list[str]:
    """Remove these groups through Ray (a helper in the local raylet's interpreter, one at a time, each at most
    REMOVE_TIMEOUT_S), then wait until Ray no longer lists them held; one line per group."""
    proc_root = Path(settings.proc_root)
    raylet: LocalRaylet | None = next(
        (r for r in local_raylets(ProcScanner(proc_root).scan().procs, proc_root) if r.python and r.gcs_address), None
    )
    if raylet is None:
        return [f"{g.group[:12]}: not removed: no raylet on this node names an interpreter" for g in groups]
    out = []
    for group in groups:
        try:
            helper = start_remove_pg(raylet, group.group)
        except OSError as exc:
            out.append(f"{group.group[:12]}: not removed: {raylet.python}: {exc.strerror}")
            continue
        try:
            rc = helper.wait(REMOVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()
            rc = None
        failed = "timed out" if rc is None else f"exited {rc}"
        out.append(
            f"placement group {group.group[:12]} removed" if rc == 0 else f"{group.group[:12]}: not removed: {failed}"
        )
    deadline = time.monotonic() + GONE_WAIT_S
    while time.monotonic() < deadline:
        left, _why = stale(settings)
        if not {g.group for g in left} & {g.group for g in groups}:
            break
        time.sleep(0.2)
    return out
