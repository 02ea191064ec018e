"""`sparkwatch launch` for an engine over Ray holds the raylets on its node to what the ranks read (issue 30;
core.launch.rayletenv, cli.launch.raycheck): the ranks start with their raylet's environment, not the serve command's.

Pure: what is checked and the `ray start` line that fixes it, and the RoCEv2 GID index from a sysfs tree shaped as a
ConnectX-7's (the Spark's NIC: `rocep1s0f1`, types "IB/RoCE v1" and "RoCE v2", IPv4-mapped GIDs). Real: a two-node
Ray cluster in two network namespaces (tests/raycluster.py); node B's raylet started the way the test cluster starts
it (no MAX_JOBS, Ray's memory monitor on, memlock as the box has it) is refused by name with its fix; started again
with them it passes on those counts. A placement group held by a stopped (wedged) driver is refused as stale;
`--fix` removes it through Ray and the next engine gets its own group.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.core.kill.raygroup import RayActor, RayJob, RayNode, RayPlacementGroup, RayState
from sparkwatch.core.launch.rankboot import rank_view
from sparkwatch.core.launch.rayletenv import (
    UNLIMITED,
    RayletFacts,
    check,
    check_driver,
    fix_line,
    mine,
    roce_v2_gid_index,
    uses_ray,
)
from sparkwatch.core.launch.stalepg import stale_groups
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.sources.rayletfacts import gid_index, interface_of, local_facts, on_path, read_memlock
from tests.conftest import Spawner, wait_until
from tests.daemon import daemon_env, free_port, sparkwatch_run
from tests.raycluster import Engine, RayCluster, pg_state, required_cluster, sigstop

SPARK_FABRIC = "enP2p1s0f1np1"  # a Spark's ConnectX-7 port on the QSFP fabric between Sparks
GOOD = {
    "MAX_JOBS": "4",
    "RAY_memory_monitor_refresh_ms": "0",
    "NCCL_IB_GID_INDEX": "3",
    "VLLM_HOST_IP": "192.168.100.11",
    "GLOO_SOCKET_IFNAME": SPARK_FABRIC,
    "NCCL_SOCKET_IFNAME": SPARK_FABRIC,
}


def facts(env: dict[str, str] | None, **kw: object) -> RayletFacts:
    base: dict[str, object] = {
        "pid": 4242, "node": "192.168.100.11", "head": False, "gcs_address": "192.168.100.10:6379", "environ": env,
        "memlock_bytes": UNLIMITED, "tools": {"ninja": True, "nvcc": True}, "roce_v2_gid_index": 3,
        "fabric_ifname": SPARK_FABRIC,
    }  # fmt: skip
    base.update(kw)
    return RayletFacts(**base)  # type: ignore[arg-type]


def test_an_engine_over_ray_is_told_by_its_backend_or_its_ray_address() -> None:
    vllm = ("vllm", "serve", "m", "-tp", "2")
    assert uses_ray((*vllm, "--distributed-executor-backend", "ray"), {})
    assert uses_ray((*vllm, "--distributed_executor_backend=ray"), {})
    assert uses_ray(vllm, {"RAY_ADDRESS": "192.168.100.10:6379"})
    assert not uses_ray((*vllm, "--distributed-executor-backend", "mp"), {})
    assert not uses_ray(vllm, {"RAY_ADDRESS": ""})


def test_a_raylet_with_what_the_ranks_need_passes() -> None:
    assert check(facts(GOOD), jobs=4) == ()
    assert check(facts({**GOOD, "MAX_JOBS": "2"}), jobs=4) == ()  # fewer jobs than the memory holds: fine


@pytest.mark.parametrize(
    ("changed", "variable"),
    [
        ({"environ": {**GOOD, "MAX_JOBS": ""}}, "MAX_JOBS"),  # empty is unset
        ({"environ": {**GOOD, "MAX_JOBS": "20"}}, "MAX_JOBS"),  # more than this node's memory holds
        ({"environ": {**GOOD, "MAX_JOBS": "four"}}, "MAX_JOBS"),
        ({"environ": {k: v for k, v in GOOD.items() if k != "RAY_memory_monitor_refresh_ms"}},
         "RAY_memory_monitor_refresh_ms"),
        ({"environ": {**GOOD, "NCCL_IB_GID_INDEX": "6"}}, "NCCL_IB_GID_INDEX"),  # sysfs says 3 now
        ({"tools": {"ninja": True, "nvcc": False}}, "PATH (nvcc)"),
        ({"memlock_bytes": 8 << 20}, "memlock"),  # DGX OS's default
        ({"environ": {**GOOD, "VLLM_HOST_IP": ""}}, "VLLM_HOST_IP"),  # unset: the default route's address
        ({"environ": {**GOOD, "VLLM_HOST_IP": "10.0.0.11"}}, "VLLM_HOST_IP"),  # the LAN's, not the fabric's
        ({"environ": {k: v for k, v in GOOD.items() if k != "GLOO_SOCKET_IFNAME"}}, "GLOO_SOCKET_IFNAME"),
        ({"environ": {**GOOD, "GLOO_SOCKET_IFNAME": "enP7s7"}}, "GLOO_SOCKET_IFNAME"),  # the LAN port
        ({"environ": {**GOOD, "NCCL_SOCKET_IFNAME": "=enp1s0f1np1"}}, "NCCL_SOCKET_IFNAME"),  # exact, another port
        ({"environ": {**GOOD, "NCCL_SOCKET_IFNAME": "^docker,enP2"}}, "NCCL_SOCKET_IFNAME"),  # excludes it
    ],
)  # fmt: skip
def test_each_lack_is_named_with_its_node_and_fixed_by_one_ray_start(changed: dict[str, object], variable: str) -> None:
    raylet = facts(GOOD, **{k: v for k, v in changed.items() if k != "environ"})
    if "environ" in changed:
        raylet = facts(changed["environ"])  # type: ignore[arg-type]
    (problem,) = check(raylet, jobs=4)
    assert problem.variable == variable and problem.node == "192.168.100.11"
    assert problem.line().startswith(f"raylet on 192.168.100.11: {variable} is ")
    fix = fix_line(raylet, (problem,), jobs=4)
    assert fix.startswith("on 192.168.100.11: ray stop && ") and fix.endswith("ray start --address=192.168.100.10:6379")
    want = {
        "MAX_JOBS": "MAX_JOBS=4 ",
        "RAY_memory_monitor_refresh_ms": "RAY_memory_monitor_refresh_ms=0 ",
        "NCCL_IB_GID_INDEX": "NCCL_IB_GID_INDEX=3 ",
        "PATH (nvcc)": "PATH=",
        "memlock": "ulimit -l unlimited && ",
        "VLLM_HOST_IP": "VLLM_HOST_IP=192.168.100.11 ",
        "GLOO_SOCKET_IFNAME": f"GLOO_SOCKET_IFNAME={SPARK_FABRIC} ",
        "NCCL_SOCKET_IFNAME": f"NCCL_SOCKET_IFNAME={SPARK_FABRIC} ",
    }[variable]
    assert want in fix


def test_the_head_is_fixed_with_ray_start_head_and_an_unreadable_environment_is_not_a_lack() -> None:
    head = facts({}, head=True, node="192.168.100.10")
    fix = fix_line(head, check(head, jobs=6), jobs=6)
    assert fix.endswith(
        "MAX_JOBS=6 RAY_memory_monitor_refresh_ms=0 VLLM_HOST_IP=192.168.100.10 "
        f"GLOO_SOCKET_IFNAME={SPARK_FABRIC} NCCL_SOCKET_IFNAME={SPARK_FABRIC} ray start --head"
    )
    assert check(facts(None, tools={}), jobs=4) == ()  # another user's raylet: said, never guessed at


def test_only_the_launching_user_s_raylets_are_held_to_the_checks() -> None:
    own, other = facts({}, uid=1000), facts({}, uid=65534, node="10.9.9.9")
    assert mine([own, other], 1000) == [own]
    assert peerdoc.raylet_facts(peerdoc.peer_raylet(other)).uid == 65534  # the uid crosses to the peers


def test_another_user_s_process_named_raylet_never_refuses_the_launch(spawner: Spawner, tmp_path: Path) -> None:
    """Any user can start a process named `raylet` with any node address. nobody does, here, in launch's own network
    namespace: launch (as root, which can read its environment) does not hold it to the checks nor list it."""
    bin_dir = Path(tempfile.mkdtemp(prefix="sw-raylet-"))
    try:
        bin_dir.chmod(0o755)
        # at Ray's own path (a raylet is Ray's executable: telemetry.sources.raystate), its cluster nobody's
        fake = bin_dir / "ray" / "core" / "src" / "ray" / "raylet" / "raylet"
        fake.parent.mkdir(parents=True, mode=0o755)
        shutil.copy("/bin/sh", fake)
        fake.chmod(0o755)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        spawner.popen([*as_nobody, str(fake), "-c", "sleep 60; :", "raylet", "--node_id=" + "ab" * 28,
                       "--node_ip_address=10.9.9.9", "--gcs-address=10.9.9.1:6379"])  # fmt: skip
        found = lambda: any(  # noqa: E731
            r.node == "10.9.9.9" for r in local_facts(Path("/proc"), Path("/"))
        )
        assert wait_until(found, 10, 0.05)  # it is there, and looks like a raylet of this node
        argv = [sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0", "--plan", "--json", "--",
                "vllm", "serve", "Qwen/Qwen3-0.6B", "--distributed-executor-backend", "ray"]  # fmt: skip
        out = subprocess.run(argv, env=daemon_env(tmp_path, free_port()), capture_output=True, text=True, timeout=120)
        assert out.stdout, out.stderr
        assert not [r for r in json.loads(out.stdout)["raylets"] if r["node"] == "10.9.9.9"]
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)


def write_port(port: Path, entries: dict[int, tuple[str, str]]) -> None:
    for index, (kind, gid) in entries.items():
        for sub, text in (("gid_attrs/types", kind), ("gids", gid)):
            (port / sub).mkdir(parents=True, exist_ok=True)
            (port / sub / str(index)).write_text(text + "\n")


V4 = "0000:0000:0000:0000:0000:ffff:c0a8:640b"  # ::ffff:192.168.100.11
LINK = "fe80:0000:0000:0000:5a54:c2ff:fe01:0203"


def test_the_roce_v2_gid_index_is_read_from_sysfs_now(tmp_path: Path) -> None:
    """A ConnectX-7 port as sysfs shows it: link-local GIDs at 0 and 1 (v1, v2), the IPv4-mapped ones at 2 (v1) and
    3 (v2). The index NCCL needs is 3 today; after a reboot that reordered them, 5."""
    base = tmp_path / "sys" / "class" / "infiniband"
    write_port(base / "rocep1s0f1" / "ports" / "1", {0: ("IB/RoCE v1", LINK), 1: ("RoCE v2", LINK),
                                                     2: ("IB/RoCE v1", V4), 3: ("RoCE v2", V4)})  # fmt: skip
    assert gid_index(tmp_path, "") == 3
    assert gid_index(tmp_path, "=rocep1s0f1:1") == 3  # NCCL_IB_HCA's exact-match form
    assert gid_index(tmp_path, "mlx5_0") is None  # a device that is not there
    write_port(base / "rocep1s0f1" / "ports" / "1", {3: ("IB/RoCE v1", V4), 5: ("RoCE v2", V4)})
    assert gid_index(tmp_path, "") == 5
    assert roce_v2_gid_index({0: "RoCE v2"}, {0: LINK}) is None  # no IPv4 address on it
    assert gid_index(tmp_path / "none", "") is None


def test_limits_and_path_are_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    assert read_memlock(Path("/proc"), os.getpid()) is not None
    pid_dir = tmp_path / "7"
    pid_dir.mkdir()
    (pid_dir / "limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        "Max locked memory         8388608              8388608              bytes     \n"
    )
    assert read_memlock(tmp_path, 7) == 8 << 20
    (pid_dir / "limits").write_text("Max locked memory         unlimited            unlimited            bytes\n")
    assert read_memlock(tmp_path, 7) == UNLIMITED
    assert on_path(f"/nonexistent:{Path(sys.executable).parent}", Path(sys.executable).name)
    assert not on_path("/nonexistent", "nvcc")


def test_a_group_is_stale_only_when_its_driver_is_stopped_or_its_job_over() -> None:
    def state(pg_state: str, running: bool) -> RayState:
        return RayState(
            nodes=(),
            jobs=(RayJob("01000000", 100, "192.168.100.10", running),),
            actors=(),
            placement_groups=(RayPlacementGroup("a1" * 14, "01000000", pg_state, ()),),
        )

    (held,) = stale_groups(state("CREATED", True), stopped_drivers={100})
    assert held.why == "its driver is stopped (wedged)" and held.driver_pid == 100
    assert "driver pid 100 on 192.168.100.10" in held.line()
    assert stale_groups(state("CREATED", True), stopped_drivers=()) == ()  # another engine's, running
    assert stale_groups(state("PENDING", False), ())[0].why == "its job has ended"
    assert stale_groups(state("REMOVED", False), {100}) == ()


# --- a real raylet


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with required_cluster() as c:
        yield c


def launch_in(
    cluster: RayCluster, ns: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0", *args, "--",
            "vllm", "serve", "Qwen/Qwen3-0.6B", "-pp", "2", "--distributed-executor-backend", "ray"]  # fmt: skip
    full_env = {**daemon_env(tmp_path, free_port()), **(env or {})}
    return subprocess.run(cluster.in_ns(ns, argv), env=full_env, capture_output=True, text=True, timeout=120)


def launch_in_b(cluster: RayCluster, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return launch_in(cluster, cluster.ns_b, tmp_path, *args)


def test_node_b_s_raylet_is_refused_by_name_then_passes_once_started_right(cluster: RayCluster, tmp_path: Path) -> None:
    plan = launch_in_b(cluster, tmp_path, "--plan", "--json")
    assert plan.returncode == 1, plan.stderr
    (raylet,) = json.loads(plan.stdout)["raylets"]  # node B's only: A's runs in another network namespace
    assert raylet["node"] == cluster.ip_b and raylet["head"] is False and raylet["environment_read"]
    lacks = {p["variable"] for p in raylet["problems"]}
    assert {"MAX_JOBS", "RAY_memory_monitor_refresh_ms", "memlock"} <= lacks
    assert {"VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} <= lacks  # the fabric: B's veth here
    assert raylet["fix"].startswith(f"on {cluster.ip_b}: ray stop && ulimit -l unlimited && MAX_JOBS=")
    fabric = raylet["fix"].split(f"VLLM_HOST_IP={cluster.ip_b} GLOO_SOCKET_IFNAME=", 1)[1].split()[0]
    assert fabric.startswith("sw") and f"NCCL_SOCKET_IFNAME={fabric} " in raylet["fix"]  # the veth that holds ip_b
    serve = json.loads(plan.stdout)["serve_command"]  # launch's own environment lacks them too
    assert {p["variable"] for p in serve["problems"]} == {"VLLM_HOST_IP", "GLOO_SOCKET_IFNAME"}
    assert (
        serve["fix"]
        == f"on {cluster.ip_b}: VLLM_HOST_IP={cluster.ip_b} GLOO_SOCKET_IFNAME={fabric} sparkwatch launch …"
    )
    assert f"ray start --address={cluster.address}" in raylet["fix"]
    # without --plan: one line per lack, the fix, and nothing started (exit 78)
    refused = launch_in_b(cluster, tmp_path)
    assert refused.returncode == 78, refused.stderr
    assert f"sparkwatch: raylet on {cluster.ip_b}: MAX_JOBS is not set" in refused.stderr
    assert f"sparkwatch: fix: on {cluster.ip_b}: ray stop" in refused.stderr
    print(refused.stderr)
    try:
        net = {"VLLM_HOST_IP": cluster.ip_b, "GLOO_SOCKET_IFNAME": fabric, "NCCL_SOCKET_IFNAME": fabric}
        cluster.restart_b({"MAX_JOBS": "1", "RAY_memory_monitor_refresh_ms": "0", **net})
        again = launch_in(cluster, cluster.ns_b, tmp_path, "--plan", "--json", env=net)
        (raylet,) = json.loads(again.stdout)["raylets"]
        lacks = {p["variable"] for p in raylet["problems"]}
        assert not lacks & {"MAX_JOBS", "RAY_memory_monitor_refresh_ms", *net}, raylet
        assert json.loads(again.stdout)["serve_command"] == {"problems": [], "fix": None}
        # the rest as this box gives it (a container may not raise memlock: no CAP_SYS_RESOURCE here)
        assert ("memlock" in lacks) == (read_memlock(Path("/proc"), os.getpid()) != UNLIMITED)
        path = os.environ.get("PATH", "")
        assert ("PATH (nvcc)" in lacks) == (shutil.which("nvcc", path=path) is None)
    finally:
        cluster.restart_b()


def test_a_group_held_by_a_wedged_driver_is_refused_and_fix_removes_it_so_the_next_engine_starts(
    cluster: RayCluster, tmp_path: Path
) -> None:
    """An engine's driver on node A wedged (SIGSTOP): its placement group holds both nodes' CPU (one each here), and
    the next engine would wait behind it forever. launch names it stale; with `--fix` it removes it through Ray and
    the next engine, started under that same launch, gets its own group."""
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = Engine(cluster, tmp_path / "first", "a")
    second: Engine | None = None
    try:
        sigstop(*first.keys["driver"])
        plan = launch_in(cluster, cluster.ns_a, tmp_path, "--plan", "--json")
        assert plan.returncode == 1, plan.stderr
        (held,) = json.loads(plan.stdout)["stale_placement_groups"]
        assert (held["group"], held["driver_pid"]) == (first.placement_group, first.pid["driver"])
        assert held["why"] == "its driver is stopped (wedged)"
        second = Engine(
            cluster, tmp_path / "second", "a", launch_env=daemon_env(tmp_path / "second", free_port()),
            launch_args=("--settle-timeout", "0", "--fix", "--force"), args=("--distributed-executor-backend", "ray"),
        )  # fmt: skip
        said = second.launch_stderr.read_text()
        assert f"sparkwatch: fix: placement group {first.placement_group[:12]} removed" in said, said
        # the boot across nodes: each rank's node and state, from Ray, on launch's own lines
        ranks = f"sparkwatch: ranks: 2 of 2 alive ({cluster.ip_a} ALIVE, {cluster.ip_b} ALIVE)"
        assert wait_until(lambda: ranks in second.launch_stderr.read_text(), 20), second.launch_stderr.read_text()
        assert pg_state(cluster, first.placement_group) == ["REMOVED"]
        assert pg_state(cluster, second.placement_group) == ["CREATED"]
    finally:
        if second is not None:
            second.close()
        first.close()


def test_a_launch_on_the_head_checks_node_b_s_raylet_through_b_s_agent(cluster: RayCluster, tmp_path: Path) -> None:
    """The ranks on node B start with B's raylet's environment, which node A cannot read: B's agent tells it
    (its peer document, the checked variables only), and a launch on A with B among its `peers` names B's lacks
    with B's fix, beside its own raylet's."""
    listen_b = f"{cluster.ip_b}:{cluster.free_port(cluster.ns_b)}"
    (tmp_path / "b").mkdir()
    env_b = {"SPARKWATCH_LISTEN": listen_b, "SPARKWATCH_RAY_DASHBOARD_URL": cluster.dashboard_b}
    with sparkwatch_run(tmp_path / "b", prefix=cluster.in_ns(cluster.ns_b, []), env=env_b):
        url = f"http://{listen_b}/peer/v1/state"
        assert wait_until(lambda: b'"raylets":[{' in cluster.get_in_a(url).stdout.encode(), 20, 0.5)
        doc = json.loads(cluster.get_in_a(url).stdout)
        (told,) = doc["raylets"]
        assert told["node"] == cluster.ip_b and told["environment_read"] and told["max_jobs"] is None
        assert "PATH" not in json.dumps(doc) and "RAY_USAGE_STATS_ENABLED" not in json.dumps(doc)  # nothing else of it
        plan = launch_in(
            cluster, cluster.ns_a, tmp_path, "--plan", "--json", env={"SPARKWATCH_PEERS": f'["{listen_b}"]'}
        )
        assert plan.returncode == 1, plan.stderr
        by_node = {r["node"]: r for r in json.loads(plan.stdout)["raylets"]}
        assert set(by_node) == {cluster.ip_a, cluster.ip_b}
        assert by_node[cluster.ip_a]["head"] and not by_node[cluster.ip_b]["head"]
        b = by_node[cluster.ip_b]
        assert "MAX_JOBS" in {p["variable"] for p in b["problems"]}
        assert b["fix"].startswith(f"on {cluster.ip_b}: ray stop && ") and f"--address={cluster.address}" in b["fix"]
        # B's pool from B's agent, held above B's own floor (the agent's default here)
        head, worker = json.loads(plan.stdout)["nodes"]
        assert (head["role"], worker["role"], worker["source"]) == ("head", "worker", "sparkwatch")
        assert worker["needs_bytes"] > 0 and worker["available_bytes"] is not None


def test_without_b_s_agent_b_s_pool_comes_from_ray_s_view_and_says_so(cluster: RayCluster, tmp_path: Path) -> None:
    """-pp 2 over Ray spans both nodes. No agent answers for B: its pool is read from Ray's dashboard (its reporter's
    MemAvailable, /nodes?view=summary), and the node is marked `ray`."""
    plan = launch_in(cluster, cluster.ns_a, tmp_path, "--plan", "--json")
    doc = json.loads(plan.stdout)
    head, worker = doc["nodes"]
    assert (head["role"], head["source"]) == ("head", "this node")
    assert (worker["node"], worker["role"], worker["source"]) == (cluster.ip_b, "worker", "ray")
    with open("/proc/meminfo") as fh:  # both namespaces share this kernel's pool
        available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    floor_and_margin = doc["memory"]["floor_bytes"] + doc["memory"]["margin_bytes"]  # this node's, standing in
    assert abs(worker["available_bytes"] + floor_and_margin - available) < 4 << 30, (worker, available)
    assert {"ray_worker"} <= {t["name"] for t in worker["terms"]}


def test_nccl_and_gloo_name_the_fabric_interface_as_each_library_reads_its_variable() -> None:
    for value in (SPARK_FABRIC, "enP2", f"={SPARK_FABRIC}", "^docker,lo", f"enp1s0f1np1,{SPARK_FABRIC}"):
        assert check(facts({**GOOD, "NCCL_SOCKET_IFNAME": value}), jobs=4) == (), value  # NCCL: prefixes, = and ^
    assert check(facts({**GOOD, "GLOO_SOCKET_IFNAME": f"enp1s0f1np1,{SPARK_FABRIC}"}), jobs=4) == ()
    lacking = {k: v for k, v in GOOD.items() if k not in ("VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    found = check(facts(lacking), jobs=4)
    assert {p.variable for p in found} == {"VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}
    fix = fix_line(facts(lacking), found, jobs=4)
    assert (f"VLLM_HOST_IP=192.168.100.11 GLOO_SOCKET_IFNAME={SPARK_FABRIC} NCCL_SOCKET_IFNAME={SPARK_FABRIC} "
            "ray start --address=192.168.100.10:6379") in fix  # fmt: skip
    # a node known by its id only (no address): nothing to hold the fabric to
    assert check(facts(lacking, node="3f2a9c41d0b7"), jobs=4) == ()
    # the serve command: its engine core joins over Gloo from this node's address
    serve = check_driver({"VLLM_HOST_IP": "192.168.100.11"}, facts(GOOD))
    assert [(p.variable, p.where) for p in serve] == [("GLOO_SOCKET_IFNAME", "serve command")]
    assert serve[0].line().startswith("serve command on 192.168.100.11: GLOO_SOCKET_IFNAME is not set, needs ")


def test_the_interface_holding_an_address_is_read_from_this_network_namespace() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: held by no interface here


def test_the_ranks_of_the_launched_engine_are_told_by_node_and_state() -> None:
    nodes = (RayNode("n" * 56, "10.0.0.1", True), RayNode("m" * 56, "10.0.0.2", True))
    job = RayJob("01000000", 4242, "10.0.0.1", True)
    ranks = (RayActor("a1", "RayWorkerWrapper", "ALIVE", "01000000", "n" * 56, 5001, "pg1"),
             RayActor("a2", "RayWorkerWrapper", "PENDING_CREATION", "01000000", "m" * 56, None, "pg1"))  # fmt: skip
    state = RayState(nodes, (job,), ranks, (RayPlacementGroup("pg1", "01000000", "CREATED", ("n" * 56, "m" * 56)),))
    view = rank_view(state, {4100, 4242})  # the API server, its engine core (the driver)
    assert view is not None and view.line() == "ranks: 1 of 2 alive (10.0.0.1 ALIVE, 10.0.0.2 PENDING_CREATION)"
    assert rank_view(state, {4100}) is None  # another engine's group
