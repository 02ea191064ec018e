"""Ray's own state, read from the GCS through the dashboard's state API: nodes, jobs, actors, placement groups.

Plain HTTP on one kept-alive connection (telemetry.sources.httpget), no Ray import: GETs of `/api/v0/{nodes,jobs,actors,
placement_groups}`, each bounded in time (`TIMEOUT_S`) and size (`MAX_BODY_BYTES`): 0.6 ms of CPU and 4-9 ms of
wall time a listing on the two-node test cluster. The source is polled only while a raylet runs on this node (a box
without Ray costs nothing), and every failure (refused, timeout, HTTP status, not JSON, a field of the wrong type)
is counted by kind and said once in `last_error`; a failed poll leaves the groups unknown, never decides anything.

Which node is this one: the raylets in this node's network namespace (the same `/proc/PID/ns/net` as ours) name
their node, their cluster's GCS and the interpreter of their Python workers on their command line (`--node_id=`,
`--gcs-address=`, `--python_worker_command=`). On a Spark every process shares the host's namespace; in the two-node
test each node is a namespace of its own.

What follows from the state (which groups have a dead member, which local processes are theirs) is decided in
core.kill.raygroup; telemetry.raywatch hands the guard what to stop.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sparkwatch.common.sources.procs import same_netns
from sparkwatch.core.kill.raygroup import RayActor, RayJob, RayNode, RayPlacementGroup, RayState
from sparkwatch.core.model import Proc
from sparkwatch.core.redact import safe_text

if TYPE_CHECKING:
    import ssl

    from sparkwatch.telemetry.sources.httpget import HttpGet

T = TypeVar("T")
TIMEOUT_S = 1.0  # one GET; the four measured 0.14 s together on a 2-core box with a two-node cluster
MAX_BODY_BYTES = 8 << 20  # a cluster with thousands of actors answers a few MiB
LIMIT = 2000  # rows a call: ranks are a handful per engine; the state API's default is 100
PATHS = ("nodes", "jobs", "actors", "placement_groups")
ERROR_KINDS = ("unreachable", "timeout", "http", "too_big", "bad_answer", "bad_url", "internal")


class RayStateError(Exception):
    """The state API did not give a usable answer; `kind` is the counter it is counted under."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Connection:
    """One kept-alive HTTP connection to the dashboard (telemetry.sources.httpget): a poll reuses it rather than
    connecting and building urllib's opener each time (measured: 0.87 ms of CPU a listing through urllib). Any
    failure closes it; the next request connects again."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url
        parts = urllib.parse.urlsplit(base_url)
        try:
            port = parts.port
        except ValueError:
            port = None
            self.bad: str | None = "ray_dashboard_url: not a port"
        else:
            self.bad = None if parts.scheme in ("http", "https") and parts.hostname else "ray_dashboard_url: no host"
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.client: HttpGet | None = None

    def get_json(self, path: str) -> Any:
        if self.bad is not None:
            raise RayStateError("bad_url", self.bad)
        # Imported at the first request, on a box with a raylet: telemetry without Ray or peers loads no HTTP client
        from sparkwatch.telemetry.sources.httpget import HttpGet, HttpGetError  # noqa: PLC0415

        if self.client is None:
            tls = _default_tls if self.https else None
            self.client = HttpGet(self.host, self.port, tls=tls, keep_alive=True)
        try:
            status, body, cut = self.client.get(self.prefix + path, self.timeout_s, MAX_BODY_BYTES)
        except HttpGetError as exc:
            kind = {"timeout": "timeout", "broken": "bad_answer"}.get(exc.kind, "unreachable")
            raise RayStateError(kind, str(exc)) from None
        if status != 200:
            raise RayStateError("http", f"HTTP {status}")
        if cut:
            raise RayStateError("too_big", f"answer over {MAX_BODY_BYTES >> 20} MiB")
        try:
            return json.loads(body)
        except ValueError:
            raise RayStateError("bad_answer", "not JSON") from None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def _default_tls() -> ssl.SSLContext:
    import ssl  # noqa: PLC0415  (an https:// dashboard only)

    return ssl.create_default_context()


def _rows(doc: Any, path: str) -> list[dict[str, Any]]:
    try:
        rows = doc["data"]["result"]["result"]
    except (KeyError, TypeError):
        raise RayStateError("bad_answer", f"{path}: no data.result.result") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise RayStateError("bad_answer", f"{path}: result is not a list of objects")
    return rows


def _str(row: dict[str, Any], key: str, path: str) -> str:
    """A string field, its control characters cut (core.redact.safe_text) as it enters: an actor's class name or a
    node id is whatever the cluster's users (or whoever answers on the dashboard's port) wrote, and it reaches
    `sparkwatch engines`, the events and the log."""
    value = row.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RayStateError("bad_answer", f"{path}: {key} is not a string")
    return safe_text(value)


def _pid(value: object, path: str) -> int | None:
    """Ray sends pids as numbers (actors) or strings (a job's driver_info)."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RayStateError("bad_answer", f"{path}: pid is not a number")
    try:
        pid = int(value)
    except ValueError:
        raise RayStateError("bad_answer", f"{path}: pid is not a number") from None
    return pid if pid > 0 else None


def parse_nodes(doc: Any) -> tuple[RayNode, ...]:
    return tuple(
        RayNode(_str(r, "node_id", "nodes"), _str(r, "node_ip", "nodes"), _str(r, "state", "nodes") == "ALIVE")
        for r in _rows(doc, "nodes")
    )


def parse_state(docs: dict[str, Any]) -> RayState:
    """The four answers as core.kill.raygroup records. Raises RayStateError on a field of the wrong type."""
    nodes = parse_nodes(docs["nodes"])
    jobs = []
    for r in _rows(docs["jobs"], "jobs"):
        info = r.get("driver_info") or {}
        if not isinstance(info, dict):
            raise RayStateError("bad_answer", "jobs: driver_info is not an object")
        jobs.append(
            RayJob(
                job_id=_str(r, "job_id", "jobs"),
                driver_pid=_pid(info.get("pid"), "jobs"),
                driver_ip=_str(info, "node_ip_address", "jobs"),
                running=_str(r, "status", "jobs") == "RUNNING",
            )
        )
    actors = parse_actors(docs["actors"])
    pgs = []
    for r in _rows(docs["placement_groups"], "placement_groups"):
        bundles = r.get("bundles") or []
        if not isinstance(bundles, list):
            raise RayStateError("bad_answer", "placement_groups: bundles is not a list")
        pgs.append(
            RayPlacementGroup(
                placement_group_id=_str(r, "placement_group_id", "placement_groups"),
                creator_job_id=_str(r, "creator_job_id", "placement_groups"),
                state=_str(r, "state", "placement_groups"),
                node_ids=tuple(safe_text(str(b.get("node_id") or "")) for b in bundles if isinstance(b, dict)),
            )
        )
    return RayState(nodes, tuple(jobs), actors, tuple(pgs))


def parse_actors(doc: Any) -> tuple[RayActor, ...]:
    return tuple(
        RayActor(
            actor_id=_str(r, "actor_id", "actors"),
            class_name=_str(r, "class_name", "actors"),
            state=_str(r, "state", "actors"),
            job_id=_str(r, "job_id", "actors"),
            node_id=_str(r, "node_id", "actors"),
            pid=_pid(r.get("pid"), "actors"),
            placement_group_id=_str(r, "placement_group_id", "actors") or None,
        )
        for r in _rows(doc, "actors")
    )


@dataclass(frozen=True, slots=True)
class RayNodeMemory:
    """A node's memory as Ray's dashboard last heard from its reporter agent (psutil: `available` is MemAvailable)."""

    node_ip: str
    hostname: str
    total_bytes: int
    available_bytes: int
    cpus: int


def parse_node_memory(doc: Any) -> tuple[RayNodeMemory, ...]:
    """The dashboard's `/nodes?view=summary`: each node's `mem` [total, available, percent, used] and `cpus`
    [logical, physical]. Raises RayStateError on another shape."""
    try:
        rows = doc["data"]["summary"]
    except (KeyError, TypeError):
        raise RayStateError("bad_answer", "nodes summary: no data.summary") from None
    if not isinstance(rows, list):
        raise RayStateError("bad_answer", "nodes summary: not a list")
    out = []
    for row in rows:
        mem = row.get("mem") if isinstance(row, dict) else None
        cpus = row.get("cpus") if isinstance(row, dict) else None
        if not (isinstance(mem, list) and len(mem) >= 2 and all(isinstance(v, int) and v >= 0 for v in mem[:2])):
            raise RayStateError("bad_answer", "nodes summary: mem is not [total, available, …]")
        logical = cpus[0] if isinstance(cpus, list) and cpus and isinstance(cpus[0], int) else 1
        out.append(RayNodeMemory(_str(row, "ip", "nodes summary"), _str(row, "hostname", "nodes summary"),
                                 mem[0], mem[1], max(logical, 1)))  # fmt: skip
    return tuple(out)


class RayStateSource:
    """Polls the state API at `base_url` (e.g. http://127.0.0.1:8265); `poll()` returns a RayState or raises
    RayStateError, counted in `errors` by kind."""

    def __init__(self, base_url: str, timeout_s: float = TIMEOUT_S) -> None:
        self.conn = Connection(base_url, timeout_s)
        # Every kind a failed poll is counted under, exported from the start (a counter that appears only after
        # its first error hides the zero before it).
        self.errors: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        self.polls_total = 0
        self.last_error: str | None = None

    def poll(self) -> RayState:
        """All four listings."""
        return self._counted(lambda: parse_state({path: self._get(path) for path in PATHS}))

    def poll_actors(self) -> tuple[RayActor, ...]:
        """The actors only (one listing, without Ray's detail: no placement group, no death cause, a tenth of the
        bytes once dead actors pile up): between full polls, a death shows here first."""
        return self._counted(lambda: parse_actors(self._get("actors", detail=False)))

    def poll_nodes(self) -> tuple[RayNode, ...]:
        """The nodes only (a dead node shows here, after Ray's own health check)."""
        return self._counted(lambda: parse_nodes(self._get("nodes")))

    def poll_node_memory(self) -> tuple[RayNodeMemory, ...]:
        """Each node's memory as the dashboard has it (not the state API: the dashboard's own node summary)."""
        return self._counted(lambda: parse_node_memory(self.conn.get_json("/nodes?view=summary")))

    def _get(self, path: str, detail: bool = True) -> Any:
        return self.conn.get_json(f"/api/v0/{path}?limit={LIMIT}" + ("&detail=true" if detail else ""))

    def close(self) -> None:
        self.conn.close()

    def _counted(self, fn: Callable[[], T]) -> T:
        self.polls_total += 1
        try:
            value = fn()
        except RayStateError as exc:
            self.errors[exc.kind] = self.errors.get(exc.kind, 0) + 1
            self.last_error = f"{exc.kind}: {exc}"
            raise
        self.last_error = None
        return value


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


def _flag(argv: tuple[str, ...], name: str) -> str:
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
        node_id = _flag(p.argv, "node_id")
        if not node_id or not same_netns(proc_root, p.pid) or not is_raylet_exe(proc_root, p.pid):
            continue
        worker = _flag(p.argv, "python_worker_command").split(" ", 1)[0]
        node_ip = _flag(p.argv, "node_ip_address")
        out.append(
            LocalRaylet(p.pid, node_id, _flag(p.argv, "gcs-address"), worker, node_ip, "--head" in p.argv, p.uid)
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DashboardOwner:
    """Whose Ray state a dashboard URL serves: the uid whose process holds its listening socket on this node (the
    kernel's record of the socket's maker, /proc/net/tcp's uid column), else None and why."""

    uid: int | None
    why: str = ""


def dashboard_owner(url: str, proc_root: Path | str) -> DashboardOwner:
    """A dashboard on this node is believed as the cluster of the user whose process listens on its port: any user may
    bind 8265 while no Ray dashboard runs (an unprivileged port), and then its answers are that user's word. One on
    another host is not this node's to prove: plain HTTP from there is display-only (docs/security.md)."""
    from sparkwatch.telemetry.sources.listeners import listeners  # noqa: PLC0415  (a node with a raylet)

    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return DashboardOwner(None, "ray_dashboard_url: not a port")
    host = parts.hostname or ""
    address = _local_address(host)
    if address is None:
        return DashboardOwner(None, f"{host} is not an address of this node: its answers are display-only")
    wildcard = "::" if ":" in address else "0.0.0.0"
    rows = [
        lst
        for lst in listeners(proc_root, os.getpid())
        if lst.port == port and lst.address in (address, wildcard, "::")
    ]
    if not rows:
        return DashboardOwner(None, f"nothing listens on {host}:{port}")
    uids = {lst.uid for lst in rows}
    if len(uids) != 1 or -1 in uids:
        return DashboardOwner(None, f"{host}:{port} is held by several users")
    return DashboardOwner(uids.pop())


def _local_address(host: str) -> str | None:
    """`host` as a literal address when it is one of this node's own (loopback, or the route to it is local: the
    kernel then picks it as the source of a datagram socket connected to it), else None. No name is resolved."""
    import ipaddress  # noqa: PLC0415
    import socket  # noqa: PLC0415

    if host == "localhost":
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback:
        return str(ip)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((str(ip), 9))  # a route lookup: nothing is sent
            local = probe.getsockname()[0]
    except OSError:
        return None
    return str(ip) if local == str(ip) else None


def is_local_url(url: str) -> bool:
    """Whether the URL's host is one of this node's own addresses (no name resolved but localhost)."""
    return _local_address(urllib.parse.urlsplit(url).hostname or "") is not None


def cluster_owner(url: str, proc_root: Path | str) -> tuple[int | None, str | None]:
    """The user whose cluster the dashboard at `url` serves to this node, and None; or None and why none is.

    On this node: the user holding its port (dashboard_owner). On another host: none. Its answers are plain HTTP on
    the link, which any host there can give: display-only, and a worker node acts on the state the head's agent
    relays in its proven document instead (telemetry.raywatch)."""
    if not is_local_url(url):
        return None, f"{urllib.parse.urlsplit(url).hostname} is another host: its answers are display-only"
    owner = dashboard_owner(url, proc_root)
    return owner.uid, None if owner.uid is not None else owner.why


DASHBOARD_SCRIPT = "/ray/dashboard/dashboard.py"  # ray._private.services.start_api_server: `--host=H --port=N`


def local_dashboard_url(procs: Iterable[Proc], uid: int, proc_root: Path | str) -> str | None:
    """The dashboard that user's own Ray started on this node (its process: Ray's dashboard.py, `--port=N`, in our
    network namespace), as a URL this node reaches it at: `ray start --head --dashboard-port` needs no
    `ray_dashboard_url` then. None when that user runs none here."""
    for p in procs:
        if p.uid != uid or not any(a.endswith(DASHBOARD_SCRIPT) for a in p.argv[:4]):
            continue
        port, host = _flag(p.argv, "port"), _flag(p.argv, "host")
        if not port.isdigit() or not same_netns(proc_root, p.pid):
            continue
        host = "127.0.0.1" if host in ("", "0.0.0.0", "localhost") else host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return None


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a helper runs as: a raylet's own user, its groups (/proc/PID/status)."""

    uid: int
    gid: int
    groups: tuple[int, ...]


def raylet_identity(raylet: LocalRaylet, proc_root: Path | str) -> Identity:
    """The raylet's real uid, gid and supplementary groups, read from its status now; raises OSError when it is gone
    or is no longer that user's."""
    uid = gid = -1
    groups: tuple[int, ...] = ()
    with open(f"{proc_root}/{raylet.pid}/status", encoding="ascii", errors="replace") as fh:
        for line in fh.read(1 << 16).splitlines():
            key, _sep, value = line.partition(":")
            try:
                if key == "Uid":
                    uid = int(value.split()[0])
                elif key == "Gid":
                    gid = int(value.split()[0])
                elif key == "Groups":
                    groups = tuple(int(g) for g in value.split())
            except (ValueError, IndexError):
                raise OSError(f"raylet {raylet.pid}: unreadable {key}") from None
    if uid != raylet.uid or uid < 0 or gid < 0:
        raise OSError(f"raylet {raylet.pid} is no longer the user {raylet.uid}'s")
    return Identity(uid, gid, groups)


# Removing a placement group: Ray offers no REST call for it, and sparkwatch never imports Ray. A short-lived helper
# in the engine's own interpreter (the one the local raylet starts its Python workers with) connects to the GCS the
# raylet names as a driver and removes it: 2-3 s on the 2-core test box. argv[1] the GCS address, argv[2] the
# placement group's id (hex). Used by the group watch (telemetry.raywatch) and `sparkwatch launch --fix`.
REMOVE_PG = """
import sys
import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, remove_placement_group
ray.init(address=sys.argv[1], logging_level=40, log_to_driver=False)
remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(sys.argv[2]))))
ray.shutdown()
"""
HELPER_PATH = "/usr/local/bin:/usr/bin:/bin"  # the helper's whole PATH: nothing of the agent's environment


def start_remove_pg(raylet: LocalRaylet, group: str, proc_root: Path | str = "/proc") -> subprocess.Popen[bytes]:
    """Start the helper that removes placement group `group` through `raylet`'s cluster; raises OSError (and
    PermissionError when it may not run).

    The interpreter comes from the raylet's command line, so it is that user's code: it runs as the raylet's own
    uid, gid and groups (never the agent's root), from a clean environment and `/`, and only from an interpreter that
    user or root owns (another user's writable file would be a third user's code). An agent that is not root runs it
    only for its own user's raylet."""
    who = raylet_identity(raylet, proc_root)
    python = raylet.python
    if not python.startswith("/"):
        raise PermissionError(f"{python!r} is not an absolute path")
    st = os.stat(python)  # the file the link leads to (a venv's python is a link to the system's)
    if st.st_uid not in (who.uid, 0):
        raise PermissionError(f"{python} belongs to uid {st.st_uid}, neither the raylet's user {who.uid} nor root")
    env = {"PATH": HELPER_PATH, "HOME": _home(who.uid), "LC_ALL": "C.UTF-8", "RAY_USAGE_STATS_ENABLED": "0"}
    drop: dict[str, Any] = {}
    if who.uid != os.geteuid():
        if os.geteuid() != 0:
            raise PermissionError(f"the raylet runs as uid {who.uid}: only its user or root may act for it")
        drop = {"user": who.uid, "group": who.gid, "extra_groups": list(who.groups)}
    return subprocess.Popen(
        [python, "-c", REMOVE_PG, raylet.gcs_address, group],
        env=env,
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **drop,
    )


def _home(uid: int) -> str:
    import pwd  # noqa: PLC0415

    try:
        return pwd.getpwuid(uid).pw_dir or "/"
    except KeyError:
        return "/"
