"""A real two-node Ray cluster on this machine, for the group tests (issue 29): each node in a network namespace of
the test's own, joined by a veth pair, with the Ray the tests install (`ray[default]`: the dashboard's state API is
what telemetry reads).

- namespaces `sw<pid>a` / `sw<pid>b`, lo up, a veth pair 10.<k>.<m>.1 / .2 (k, m from this pytest's pid): another
  suite running at the same time gets other names and addresses;
- node A: `ray start --head` (GCS, raylet, dashboard on :8265 inside A, reached from B over the veth pair: only the
  test's namespaces see it); node B: `ray start --address`;
  one CPU and a 100 MB object store each, no usage stats, no auth token written;
- teardown: every process in the two namespaces (`ip netns pids`: only what this fixture started lives there, and
  Ray's daemons leave the test's process tree) gets SIGTERM through a pidfd taken with its start time checked, then
  SIGKILL after 1 s; then the namespaces are deleted. Not `ray stop`: it finds Ray's processes by name across the
  whole machine and would stop another suite's cluster too.

Measured on the 2-core CI box: start 10.5 s (head 6.3 s, worker 4.2 s), stop under 1 s.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkwatch.common import syscalls
from sparkwatch.common.sources.procs import read_start_ticks
from tests.conftest import alive, require, wait_until
from tests.daemon import free_port

RAY = Path(sys.executable).parent / "ray"
OBJECT_STORE_BYTES = 100_000_000  # Ray's floor is 75 MB
DASHBOARD_PORT = 8265
GCS_PORT = 6379
# SIGTERM, then SIGKILL after this: node B's processes end within it, node A's GCS, raylet and autoscaler monitor
# were still up 1.5 s after SIGTERM (measured), and nothing of theirs outlives the namespaces (their files are ours).
STOP_GRACE_S = 1.0
GONE_WAIT_S = 5.0


def ray_env(tmp: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the cluster's own Ray settings over it, whatever it holds:
    an in-process `ray.init` elsewhere in the suite leaves RAY_AUTH_MODE=token in os.environ (measured), and a
    driver given it against this cluster, which has no token, had its ranks' creation cancelled ("The actor never
    ran": the GCS's calls to the driver refused)."""
    return {
        **(os.environ if base is None else base),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",  # no token written under ~/.ray
        "RAY_TMPDIR": str(tmp),
        "RAY_DEDUP_LOGS": "0",
    }


@dataclass
class RayCluster:
    ns_a: str
    ns_b: str
    ip_a: str
    ip_b: str
    tmp: Path
    start_s: float = 0.0
    stop_s: float = 0.0
    node_ids: dict[str, str] = field(default_factory=dict)  # ip -> node id

    @property
    def address(self) -> str:
        return f"{self.ip_a}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        """As node A reads it (its loopback); node B reads it at `dashboard_b`."""
        return f"http://127.0.0.1:{DASHBOARD_PORT}"

    @property
    def dashboard_b(self) -> str:
        return f"http://{self.ip_a}:{DASHBOARD_PORT}"

    def in_ns(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def free_port(self, ns: str) -> int:
        """A port free in namespace `ns`, picked there: a port free in the test's own namespace may be held by one of
        that node's Ray processes (tests.daemon.free_port)."""
        return free_port(self.in_ns(ns, []))

    def get_in_a(self, url: str, timeout_s: float = 10) -> subprocess.CompletedProcess[str]:
        """One HTTP GET from inside node A (its loopback, or over the veth pair): the body on stdout."""
        code = (
            "import sys, urllib.request; "
            f"sys.stdout.write(urllib.request.urlopen({url!r}, timeout={timeout_s}).read().decode())"
        )
        return subprocess.run(
            self.in_ns(self.ns_a, [sys.executable, "-c", code]), capture_output=True, text=True, timeout=30
        )

    def state(self, path: str) -> list[dict[str, Any]]:
        """One state API listing (`actors`, `placement_groups`, ...), read from inside node A."""
        out = self.get_in_a(f"{self.dashboard}/api/v0/{path}?limit=1000&detail=true")
        out.check_returncode()
        rows: list[dict[str, Any]] = json.loads(out.stdout)["data"]["result"]["result"]
        return rows

    def wait_nodes(self, timeout_s: float = 60) -> None:
        """Until both nodes are ALIVE in Ray's node table; `node_ids` then maps each address to its live node."""
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = [n for n in self.state("nodes") if n["state"] == "ALIVE"]
            if len(nodes) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.node_ids = {n["node_ip"]: n["node_id"] for n in nodes}
        if set(self.node_ids) != {self.ip_a, self.ip_b}:
            raise RuntimeError(f"the cluster has nodes {self.node_ids}, not {self.ip_a} and {self.ip_b}")

    def restart_b(self, env: Mapping[str, str] | None = None) -> None:
        """Node B anew (after a test killed part of it): every process in its namespace stopped, `ray start` again,
        with `env` over the cluster's."""
        left = _stop_namespace(self, self.ns_b)
        if left:
            raise AssertionError(f"processes left in {self.ns_b} after SIGKILL: {left}")
        argv = [str(RAY), "start", "--address", self.address, "--node-ip-address", self.ip_b, *COMMON]
        _ray_start(self, self.ns_b, self.tmp / "b", argv, env)
        self.wait_nodes()

    def netns_pids(self, ns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
        return [int(x) for x in out.stdout.split()]


COMMON = ["--num-cpus", "1", "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]


def _ray_start(
    cluster: RayCluster, ns: str, node_tmp: Path, argv: list[str], env: Mapping[str, str] | None = None
) -> None:
    done = subprocess.run(
        cluster.in_ns(ns, argv),
        env={**ray_env(node_tmp), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} in {ns} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=10)


def netns_permitted() -> str | None:
    """None if this process may make network namespaces, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"swprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return f"`ip netns add` is not permitted here: {err.decode(errors='replace').strip() or exc}"
    _ip("netns", "del", name)
    return None


def _stop_namespace(cluster: RayCluster, ns: str) -> list[int]:
    """SIGTERM, then SIGKILL, every process in a namespace this fixture made, each pinned with its start time.
    Returns the pids still there after all that (none, or the fixture has a bug)."""
    pinned: list[int] = []
    for pid in cluster.netns_pids(ns):
        ticks = read_start_ticks("/proc", pid)
        try:
            fd = syscalls.pidfd_open(pid)
        except OSError:
            continue
        if ticks is None or read_start_ticks("/proc", pid) != ticks:
            os.close(fd)
            continue
        pinned.append(fd)
    try:
        for fd in pinned:
            try:
                syscalls.pidfd_send_signal(fd, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while cluster.netns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        for fd in pinned:
            try:
                syscalls.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        for fd in pinned:
            os.close(fd)
    # Processes forked meanwhile (a worker the raylet was starting) live in the namespace too: the same, once more.
    deadline = time.monotonic() + GONE_WAIT_S
    while cluster.netns_pids(ns) and time.monotonic() < deadline:
        for pid in cluster.netns_pids(ns):
            ticks = read_start_ticks("/proc", pid)
            try:
                fd = syscalls.pidfd_open(pid)
            except OSError:
                continue
            try:
                if read_start_ticks("/proc", pid) == ticks:
                    syscalls.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.05)
    return cluster.netns_pids(ns)


@contextmanager
def ray_cluster() -> Iterator[RayCluster]:
    """The cluster, up; torn down on exit. Its files go to a short directory of its own under /tmp (Ray's socket
    paths must stay under 107 bytes), removed after."""
    tmp = Path(tempfile.mkdtemp(prefix="swray", dir="/tmp"))
    pid = os.getpid()
    k, m = 200 + (pid >> 8) % 50, pid % 256
    cluster = RayCluster(f"sw{pid}a", f"sw{pid}b", f"10.{k}.{m}.1", f"10.{k}.{m}.2", tmp)
    veth_a, veth_b = f"sw{pid}va", f"sw{pid}vb"
    made: list[str] = []
    t0 = time.monotonic()
    try:
        for ns in (cluster.ns_a, cluster.ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", cluster.ns_a)
        _ip("link", "set", veth_b, "netns", cluster.ns_b)
        for ns, veth, ip in ((cluster.ns_a, veth_a, cluster.ip_a), (cluster.ns_b, veth_b, cluster.ip_b)):
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", veth, "up")
        for ns, node_tmp, argv in (
            (
                cluster.ns_a,
                tmp / "a",
                [
                    str(RAY), "start", "--head", "--node-ip-address", cluster.ip_a, "--port", str(GCS_PORT),
                    "--include-dashboard", "true", "--dashboard-host", "0.0.0.0",
                    "--dashboard-port", str(DASHBOARD_PORT), "--temp-dir", str(tmp / "a"), *COMMON,
                ],
            ),
            (
                cluster.ns_b,
                tmp / "b",
                [str(RAY), "start", "--address", cluster.address, "--node-ip-address", cluster.ip_b, *COMMON],
            ),
        ):  # fmt: skip
            node_tmp.mkdir()
            _ray_start(cluster, ns, node_tmp, argv)
        cluster.wait_nodes()
        cluster.start_s = time.monotonic() - t0
        yield cluster
    finally:
        t1 = time.monotonic()
        left = {ns: pids for ns in reversed(made) if (pids := _stop_namespace(cluster, ns))}
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
        cluster.stop_s = time.monotonic() - t1
        print(f"ray cluster: start {cluster.start_s:.1f} s, stop {cluster.stop_s:.1f} s", file=sys.stderr)
        if left:
            raise AssertionError(f"processes left in the cluster's namespaces after SIGKILL: {left}")


# --- a vLLM-shaped engine on it (tests/helpers/ray_engine.py)

ENGINE = Path(__file__).resolve().parent / "helpers" / "ray_engine.py"


@contextmanager
def required_cluster() -> Iterator[RayCluster]:
    """The cluster for a test module, or the module skipped (failed under SPARKWATCH_TEST_REQUIRE_TOOLS) where network
    namespaces or Ray are missing."""
    why = netns_permitted()
    require(why is None, why or "")
    require(shutil.which("ray", path=str(Path(sys.executable).parent)) is not None, "ray is not installed")
    with ray_cluster() as c:
        yield c


def netns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise AssertionError(f"the engine printed nothing in {timeout_s} s")
    return proc.stdout.readline()


def sigkill(pid: int, start_ticks: int) -> None:
    """SIGKILL that very process (pinned by a pidfd, its start time checked)."""
    _signal(pid, start_ticks, signal.SIGKILL)


def sigstop(pid: int, start_ticks: int) -> None:
    """SIGSTOP that very process: a wedged driver (a stopped process dies of SIGKILL all the same)."""
    _signal(pid, start_ticks, signal.SIGSTOP)


def _signal(pid: int, start_ticks: int, sig: int) -> None:
    fd = syscalls.pidfd_open(pid)
    try:
        if read_start_ticks("/proc", pid) == start_ticks:
            syscalls.pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


class Engine:
    """A vLLM-shaped engine on the cluster (tests/helpers/ray_engine.py), its API server and driver on `node`
    ("a" or "b"); (pid, start ticks) of each member in `keys`: api, driver, rank_a, rank_b."""

    def __init__(
        self,
        cluster: RayCluster,
        tmp_path: Path,
        node: str,
        *,
        remote_rank_mib: int = 0,
        launch_env: dict[str, str] | None = None,
        launch_args: tuple[str, ...] = ("--force",),
        args: tuple[str, ...] = (),
    ) -> None:
        """`remote_rank_mib`: memory the ranks on the other node take (tests/helpers/ray_engine.py). `launch_env`:
        start the API server under `sparkwatch launch --force` with this environment (its declaration, the guard's
        word) and `launch_args`; `self.api` is then the launch process, and `keys["api"]` its child, the API server.
        `args`: more of the serve command's arguments (`--distributed-executor-backend ray`)."""
        ns, ip = (cluster.ns_a, cluster.ip_a) if node == "a" else (cluster.ns_b, cluster.ip_b)
        vllm = tmp_path / f"bin-{node}" / "vllm"
        vllm.parent.mkdir(exist_ok=True)
        shutil.copy(ENGINE, vllm)
        env = {
            # under launch: its environment (the declaration, the guard's word), the cluster's Ray settings over it
            **ray_env(cluster.tmp / node, launch_env),
            "RAY_ENGINE_ADDRESS": cluster.address,
            "RAY_ENGINE_NODE_IP": ip,
            "RAY_ENGINE_REMOTE_RANK_MIB": str(remote_rank_mib),
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        }
        argv = [sys.executable, str(vllm), "serve", "tiny-model", "--tensor-parallel-size", "2", *args]
        if launch_env is not None:
            argv = [sys.executable, "-m", "sparkwatch", "launch", *launch_args, "--", *argv]
        # its stderr (launch's lines and the engine's own) goes to a file: a pipe nobody reads while the engine runs
        # could fill and stall it
        self.launch_stderr = tmp_path / f"launch-{node}.stderr"
        with open(self.launch_stderr, "w") as err:
            self.api = subprocess.Popen(cluster.in_ns(ns, argv), stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.keys: dict[str, tuple[int, int]] = {}
        try:
            line = read_line(self.api, 120)
            if not line.startswith("{"):
                said = self.launch_stderr.read_text()[-3000:]
                raise AssertionError(f"the engine printed {line!r}, not its JSON line (exit {self.api.poll()}){said}")
            info = json.loads(line)
            assert info["api"] == self.api.pid or launch_env is not None
            by_node = {r["node_id"]: r["pid"] for r in info["ranks"]}
            pids = {
                "api": info["api"],
                "driver": info["driver"],
                "rank_a": by_node[cluster.node_ids[cluster.ip_a]],
                "rank_b": by_node[cluster.node_ids[cluster.ip_b]],
            }
            self.keys = {role: key_of(pid, role) for role, pid in pids.items()}
        except BaseException:
            self.close()
            raise
        self.placement_group: str = info["placement_group"]
        self.pid = {role: key[0] for role, key in self.keys.items()}
        assert netns(self.pid["rank_a"]) != netns(self.pid["rank_b"])  # each rank on its own node

    def close(self) -> None:
        """SIGKILL what is left of it (only its own processes, each by pid and start time) and reap the API server."""
        for role in ("api", "driver", "rank_a", "rank_b"):
            if role in self.keys and alive(*self.keys[role]) and self.keys[role][0] != self.api.pid:
                sigkill(*self.keys[role])
        if self.api.poll() is None:
            self.api.kill()
        self.api.wait(10)
        if self.api.stdout is not None:
            self.api.stdout.close()
        ranks = [self.keys[r] for r in ("rank_a", "rank_b") if r in self.keys]
        assert wait_until(lambda: not any(alive(*k) for k in ranks), timeout_s=10)


def key_of(pid: int, role: str) -> tuple[int, int]:
    """A test's own process as its (pid, start ticks): what the test signals it by."""
    ticks = read_start_ticks("/proc", pid)
    assert ticks is not None, f"{role} (pid {pid}) is gone"
    return pid, ticks


def pg_state(cluster: RayCluster, pg: str) -> list[str]:
    return [g["state"] for g in cluster.state("placement_groups") if g["placement_group_id"] == pg]


def gone_within(keys: list[tuple[int, int]], since: float) -> float:
    """Seconds from `since` until the last of these processes was gone (fails after 30 s)."""
    assert wait_until(lambda: not any(alive(*k) for k in keys), timeout_s=30, step_s=0.01), [
        k for k in keys if alive(*k)
    ]
    return time.monotonic() - since
