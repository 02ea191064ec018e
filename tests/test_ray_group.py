"""Two Sparks, one engine (issue 29): a rank dies on node B and node A's agent stops its own half of the group.

A real two-node Ray cluster (tests/raycluster.py: two network namespaces, `ray start --head` / `--address`), a
vLLM-shaped engine on it (tests/helpers/ray_engine.py: `vllm serve` -> `VLLM::EngineCore` as the Ray driver, a
STRICT_SPREAD placement group, one `RayWorkerWrapper` actor per node), and a real `sparkwatch run` in node A's
namespace. The rank on node B is SIGKILLed; node A's telemetry learns it from Ray's state API and hands the guard
A's members, which the guard checks and kills: every one gone within 5 s, the placement group gone, and a
`group_teardown` event saying why. The pure decisions and the guard's own checks are tested here too, without Ray.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common.enginerules import engine_rules, engine_scope
from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.common.messages import GroupTeardownMsg, PeerBudgetMsg, decode, encode
from sparkwatch.common.sources.procs import ProcScanner, read_start_ticks
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings
from sparkwatch.core.kill import mpgroup, raygroup
from sparkwatch.core.kill.budget import BudgetParams
from sparkwatch.core.kill.killrecord import GroupLoss, KillFacts, kill_reason, kill_summary
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import MemInfo, Proc
from sparkwatch.guard.budgets import BudgetWatch
from sparkwatch.guard.groupwatch import GroupWatch
from sparkwatch.guard.poolwatch import PoolWatch
from sparkwatch.guard.process import GuardProcess
from sparkwatch.telemetry import peerdoc, raywatch
from sparkwatch.telemetry.mpwatch import ORPHAN_GRACE_S
from sparkwatch.telemetry.peerwatch import PEER_LOST_AFTER, PEER_TIMEOUT_S
from sparkwatch.telemetry.raywatch import RayWatch
from sparkwatch.telemetry.sources.raylets import RAYLET_COMM, RAYLET_EXE_SUFFIX
from sparkwatch.telemetry.sources.raystate import RayStateError, RayStateSource
from tests.conftest import Spawner, alive, pids_in, require, wait_until, wakeups
from tests.daemon import RunningDaemon, daemon_env, free_port, sparkwatch_run, wait_for_event
from tests.helpers.peerkey import key_env, key_file
from tests.raycluster import (
    Engine,
    RayCluster,
    gone_within,
    key_of,
    netns,
    netns_permitted,
    pg_state,
    read_line,
    required_cluster,
    sigkill,
    sigstop,
)

SHAPE = Path(__file__).resolve().parent / "helpers" / "shape_proc.py"
TEARDOWN_GOAL_S = 5.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with required_cluster() as c:
        yield c


def pair_key(tmp_path: Path) -> dict[str, str]:
    """The pair's key (peer_key_file), one file both agents name: an honest pair is authenticated (issue 37)."""
    return key_env(key_file(tmp_path / "pair-key"))


def test_rank_death_on_b_stops_node_a_members(cluster: RayCluster, tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path, prefix=cluster.in_ns(cluster.ns_a, [])) as daemon:
        engine = Engine(cluster, tmp_path, "a")
        try:
            pid = engine.pid
            assert netns(pid["api"]) == netns(pid["rank_a"])
            assert pg_state(cluster, engine.placement_group) == ["CREATED"]
            _engines_shows_the_group(cluster, tmp_path, engine)
            group = f'group="{engine.placement_group}"'
            rows = [
                f'sparkwatch_group_members{{{group},node="{cluster.ip_a}",role="driver"}}',
                f'sparkwatch_group_members{{{group},node="{cluster.ip_a}",role="rank"}}',
                f'sparkwatch_group_members{{{group},node="{cluster.ip_b}",role="rank"}}',
                f'sparkwatch_ray_node_up{{node="{cluster.ip_b}"}}',
            ]
            before: dict[str, float] = {}
            # the group's members on each node, as node A's agent exports them (telemetry.exporter.groupmetric): a
            # scrape may come between Ray's listings of a group still being made (a rank not placed yet)
            assert wait_until(
                lambda: (
                    bool(before.update(_scrape(cluster, f"127.0.0.1:{daemon.port}"))) or all(r in before for r in rows)
                ),
                15,
            ), before
            assert [before[r] for r in rows] == [1, 1, 1, 1]

            died_at = time.monotonic()
            sigkill(*engine.keys["rank_b"])
            took_s = gone_within([engine.keys["api"], engine.keys["driver"], engine.keys["rank_a"]], died_at)
            print(f"group teardown on node A: last member gone {took_s:.2f} s after the rank on B died")
            assert took_s <= TEARDOWN_GOAL_S

            event = wait_for_event(daemon.events_path, "group_teardown", timeout_s=10)
            assert event["group"] == engine.placement_group
            assert event["cause"] == raygroup.RANK_DIED
            assert event["first_node"] == cluster.ip_b
            assert event["first_pid"] == pid["rank_b"]
            members = event["members"]
            assert isinstance(members, list)
            assert {(m["pid"], m["role"]) for m in members} == {
                (pid["api"], raygroup.API),
                (pid["driver"], raygroup.DRIVER),
                (pid["rank_a"], raygroup.RANK),
            }
            # The driver's death ended its job, and Ray removed the placement group with it.
            assert wait_until(lambda: pg_state(cluster, engine.placement_group) == ["REMOVED"], 10, 0.2)
            assert sum(1 for e in read_events(daemon.events_path) if e["kind"] == "group_teardown") == 1
            after = _scrape(cluster, f"127.0.0.1:{daemon.port}")
            assert after["sparkwatch_guard_group_teardown_duration_seconds_count"] == 1
            assert after['sparkwatch_guard_group_teardown_duration_seconds_bucket{le="5.0"}'] == 1  # the goal
            assert after["sparkwatch_group_teardown_requests_total"] >= 1
            assert after['sparkwatch_guard_kills_total{trigger="group_teardown"}'] == 1
        finally:
            engine.close()


def test_wedged_driver_on_b_its_placement_group_is_removed_from_a(cluster: RayCluster, tmp_path: Path) -> None:
    """The driver runs on node B and is wedged (SIGSTOP), then B's rank dies: A's agent stops A's rank, and since the
    wedged driver holds the placement group, removes it through Ray; a new launch then gets its group."""
    with sparkwatch_run(tmp_path, prefix=cluster.in_ns(cluster.ns_a, [])) as daemon:
        engine = Engine(cluster, tmp_path, "b")
        try:
            assert netns(engine.pid["api"]) == netns(engine.pid["rank_b"])
            sigstop(*engine.keys["driver"])
            died_at = time.monotonic()
            sigkill(*engine.keys["rank_b"])
            took_s = gone_within([engine.keys["rank_a"]], died_at)
            print(f"group teardown on node A (driver wedged on B): rank gone {took_s:.2f} s after B's rank died")
            assert took_s <= TEARDOWN_GOAL_S
            event = wait_for_event(daemon.events_path, "group_teardown", timeout_s=10)
            assert event["members"] == [{"pid": engine.pid["rank_a"], "role": raygroup.RANK}]
            assert alive(*engine.keys["driver"]) and alive(*engine.keys["api"])  # node B's: never touched from A

            assert wait_until(lambda: pg_state(cluster, engine.placement_group) == ["REMOVED"], 30, 0.2)
            removed_s = time.monotonic() - died_at
            print(f"leaked placement group removed {removed_s:.1f} s after B's rank died")
            again = Engine(cluster, tmp_path, "a")  # a new launch is not blocked on the old group
            again.close()
        finally:
            engine.close()


def test_a_budget_kill_on_b_is_named_in_node_a_teardown_by_b_s_own_agent(cluster: RayCluster, tmp_path: Path) -> None:
    """Node B runs its own agent, with a budget its rank goes over: B's guard kills the rank (trigger `budget`). Node
    A's agent, with B among its `peers`, stops A's members and its `group_teardown` event carries B's guard's own
    word, read from B's agent (telemetry.peerwatch): the cause on the other machine, said on the head."""
    port_b = cluster.free_port(cluster.ns_b)
    listen_b = f"{cluster.ip_b}:{port_b}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    raylet_b = _ns_child(cluster, cluster.ns_b, "raylet")
    env_b = {
        "SPARKWATCH_LISTEN": listen_b,
        **pair_key(tmp_path),
        # B's engines are the ranks its raylet runs (the raylet itself is infrastructure, never touched)
        "SPARKWATCH_ANCESTOR_PID": str(raylet_b),
        "SPARKWATCH_ENGINE_BUDGETS": json.dumps(["64MiB=RayWorkerWrapper"]),
    }
    env_a = {"SPARKWATCH_PEERS": json.dumps([listen_b]), "SPARKWATCH_PEER_POLL_S": "0.5", **pair_key(tmp_path)}
    with (
        sparkwatch_run(tmp_path / "b", prefix=cluster.in_ns(cluster.ns_b, []), env=env_b) as daemon_b,
        sparkwatch_run(tmp_path / "a", prefix=cluster.in_ns(cluster.ns_a, []), env=env_a) as daemon_a,
    ):
        # B's agent names its node once its telemetry found its raylet (what ties a death in Ray's state to it)
        assert wait_until(lambda: bool(_peer_doc(cluster, listen_b).get("ray_node_ids")), 20, 0.5)
        # The engine started with `sparkwatch launch` on the head; B's rank takes 512 MiB: over 64 MiB + margin.
        launch_env = daemon_env(tmp_path / "a", daemon_a.port)
        engine = Engine(cluster, tmp_path, "a", remote_rank_mib=512, launch_env=launch_env)
        try:
            kill = wait_for_event(daemon_b.events_path, "kill", timeout_s=20)
            assert kill["trigger"] == "budget"
            victims = kill["victims"]
            assert isinstance(victims, list) and [v["pid"] for v in victims] == [engine.pid["rank_b"]]
            gone_within([engine.keys["api"], engine.keys["driver"], engine.keys["rank_a"]], time.monotonic())
            event = wait_for_event(daemon_a.events_path, "group_teardown", timeout_s=10)
            assert event["first_pid"] == engine.pid["rank_b"] and event["first_node"] == cluster.ip_b
            word = event["peer_word"]
            assert isinstance(word, str) and word.startswith("killed by sparkwatch on ") and ": budget: " in word
            assert "over its budget 64.0 MiB" in word
            assert word in str(event["summary"])  # the line the owner reads on the head
            # launch, on the head, says it in one line and exits 137
            assert engine.api.wait(20) == 137
            said = [line for line in engine.launch_stderr.read_text().splitlines() if "the guard killed" in line]
            assert len(said) == 1 and "trigger group_teardown" in said[0] and word in said[0], said
            print(f"launch on node A: {said[0]}")
        finally:
            engine.close()


def test_a_worker_budget_given_on_the_head_is_held_by_b_s_guard(cluster: RayCluster, tmp_path: Path) -> None:
    """`sparkwatch launch --budget worker=64MiB` on node A, no budget configured on B: A's agent tells B's (its peer
    document's `budgets`, by placement group), B's telemetry names B's rank of that group to B's guard
    (PeerBudgetMsg), and B's guard kills it when it goes over (trigger `budget`), as a budget of its own."""
    listen_a, listen_b = (
        f"{cluster.ip_a}:{cluster.free_port(cluster.ns_a)}",
        f"{cluster.ip_b}:{cluster.free_port(cluster.ns_b)}",
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    raylet_b = _ns_child(cluster, cluster.ns_b, "raylet")
    env_b = {"SPARKWATCH_LISTEN": listen_b, "SPARKWATCH_ANCESTOR_PID": str(raylet_b),
             "SPARKWATCH_PEERS": json.dumps([listen_a]), "SPARKWATCH_PEER_POLL_S": "0.5", **pair_key(tmp_path),
             "SPARKWATCH_RAY_DASHBOARD_URL": cluster.dashboard_b}  # fmt: skip
    env_a = {"SPARKWATCH_LISTEN": listen_a, "SPARKWATCH_PEERS": json.dumps([listen_b]), **pair_key(tmp_path)}
    with (
        sparkwatch_run(tmp_path / "b", prefix=cluster.in_ns(cluster.ns_b, []), env=env_b) as daemon_b,
        sparkwatch_run(tmp_path / "a", prefix=cluster.in_ns(cluster.ns_a, []), env=env_a) as daemon_a,
    ):
        assert wait_until(lambda: bool(_peer_doc(cluster, listen_b).get("ray_node_ids")), 20, 0.5)
        assert wait_until(lambda: bool(_peer_doc(cluster, listen_a).get("ray_node_ids")), 20, 0.5)
        launch_env = {**daemon_env(tmp_path / "a", daemon_a.port), "SPARKWATCH_LISTEN": listen_a}
        engine = Engine(cluster, tmp_path, "a", remote_rank_mib=512, launch_env=launch_env,
                        launch_args=("--force", "--budget", "worker=64MiB"),
                        args=("--distributed-executor-backend", "ray"))  # fmt: skip
        try:
            assert wait_until(lambda: bool(_peer_doc(cluster, listen_a).get("budgets")), 20, 0.5)
            (told,) = _peer_doc(cluster, listen_a)["budgets"]
            assert (told["group"], told["budget_bytes"]) == (engine.placement_group, 64 << 20)
            kill = wait_for_event(daemon_b.events_path, "kill", timeout_s=30)
            assert (kill["trigger"], kill["budget_source"], kill["budget_bytes"]) == ("budget", "peer", 64 << 20)
            victims = kill["victims"]
            assert isinstance(victims, list) and [v["pid"] for v in victims] == [engine.pid["rank_b"]]
            started = [line for line in engine.launch_stderr.read_text().splitlines() if "started vllm" in line]
            assert started and "its ranks on the other nodes 64.0 MiB each" in started[0], started
        finally:
            engine.close()


def _pair_envs(cluster: RayCluster, tmp_path: Path, listen_a: str, listen_b: str) -> tuple[dict[str, str], ...]:
    """The two agents of an authenticated pair, each naming the other (reads every 0.5 s); B reads the head's
    dashboard over the link (display-only) and acts on what A's agent relays."""
    key = pair_key(tmp_path)
    env_a = {"SPARKWATCH_LISTEN": listen_a, "SPARKWATCH_PEERS": json.dumps([listen_b]), "SPARKWATCH_PEER_POLL_S": "0.5"}
    env_b = {"SPARKWATCH_LISTEN": listen_b, "SPARKWATCH_PEERS": json.dumps([listen_a]), "SPARKWATCH_PEER_POLL_S": "0.5",
             "SPARKWATCH_RAY_DASHBOARD_URL": cluster.dashboard_b}  # fmt: skip
    return {**env_a, **key}, {**env_b, **key}


def _relayed_pids(cluster: RayCluster, listen: str) -> set[int]:
    """The actors' pids in the Ray state that agent relays in its document (telemetry.peerdoc.RayRelay)."""
    relay = _peer_doc(cluster, listen).get("ray") or {}
    return {a["pid"] for a in relay.get("actors", []) if a.get("pid")}


def _peer_doc(cluster: RayCluster, listen: str) -> dict[str, Any]:
    """A peer's /peer/v1/state as node A reads it (over the veth pair)."""
    out = cluster.get_in_a(f"http://{listen}/peer/v1/state", timeout_s=5)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def test_both_agents_a_wedged_driver_on_b_then_its_rank_dies(cluster: RayCluster, tmp_path: Path) -> None:
    """Each node runs its agent (B reads the head's dashboard, A has B among its peers). The driver on B is wedged
    (SIGSTOP), then B's rank dies: A stops its own rank and B its wedged driver and API server (a stopped process
    dies of SIGKILL all the same), each within 5 s; the driver's death removes the placement group; each agent's
    event says why. Then B's agent stops, and A records `peer_lost` with what B last said."""
    port_b = cluster.free_port(cluster.ns_b)
    listen_b = f"{cluster.ip_b}:{port_b}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    listen_a = f"{cluster.ip_a}:{cluster.free_port(cluster.ns_a)}"
    # Each lists the other: B learns from A that A's rank died of A's own teardown (Ray keeps no time of death, and
    # B may see both ranks dead at once), so B names the true first death too.
    env_a, env_b = _pair_envs(cluster, tmp_path, listen_a, listen_b)
    with ExitStack() as agents:
        daemon_a = agents.enter_context(
            sparkwatch_run(tmp_path / "a", prefix=cluster.in_ns(cluster.ns_a, []), env=env_a)
        )
        agent_b = ExitStack()
        daemon_b = agent_b.enter_context(
            sparkwatch_run(tmp_path / "b", prefix=cluster.in_ns(cluster.ns_b, []), env=env_b)
        )
        agents.push(agent_b)
        assert wait_until(lambda: bool(_peer_doc(cluster, listen_b).get("ray_node_ids")), 20, 0.5)
        engine = Engine(cluster, tmp_path, "b")
        try:
            sigstop(*engine.keys["driver"])
            died_at = time.monotonic()
            sigkill(*engine.keys["rank_b"])
            a_s = gone_within([engine.keys["rank_a"]], died_at)
            b_s = gone_within([engine.keys["driver"], engine.keys["api"]], died_at)
            print(f"both agents, driver wedged on B: A's rank gone {a_s:.2f} s, B's driver and API {b_s:.2f} s")
            assert a_s <= TEARDOWN_GOAL_S and b_s <= TEARDOWN_GOAL_S
            assert wait_until(lambda: pg_state(cluster, engine.placement_group) == ["REMOVED"], 10, 0.2)
            on_b = wait_for_event(daemon_b.events_path, "group_teardown", timeout_s=10)
            # A stops its rank itself, unless B's agent stopped the driver first: Ray then ends the job's actors, A's
            # rank with them, before A's next read of Ray's state (every ray_poll_s), and A has nothing left to stop.
            on_a = [e for e in read_events(daemon_a.events_path) if e["kind"] == "group_teardown"]
            print(f"node A recorded {len(on_a)} group_teardown event(s)")
            for event in (*on_a, on_b):
                assert (event["group"], event["cause"]) == (engine.placement_group, raygroup.RANK_DIED)
                assert (event["first_node"], event["first_pid"]) == (cluster.ip_b, engine.pid["rank_b"])
            assert all(e["members"] == [{"pid": engine.pid["rank_a"], "role": raygroup.RANK}] for e in on_a)
            members_b = on_b["members"]
            assert isinstance(members_b, list)
            assert {(m["pid"], m["role"]) for m in members_b} == {
                (engine.pid["api"], raygroup.API),
                (engine.pid["driver"], raygroup.DRIVER),
            }
            assert all(e["peer_word"] is None for e in on_a)  # the rank died of a SIGKILL no guard sent: no word
        finally:
            engine.close()
        with daemon_b.paused():  # B's agent goes silent (a wedged node): A notices after PEER_LOST_AFTER reads
            stopped_at = time.monotonic()
            lost = wait_for_event(daemon_a.events_path, "peer_lost", timeout_s=15)
            print(
                f"peer_lost on A {time.monotonic() - stopped_at:.1f} s after B's agent went silent: {lost['summary']}"
            )
        assert lost["peer"] == listen_b and lost["mem_available_bytes"]
        assert isinstance(lost["last_kill"], dict) and lost["last_kill"]["trigger"] == "group_teardown"


def test_node_b_lost_raylet_killed_stops_node_a_members(cluster: RayCluster, tmp_path: Path) -> None:
    """Node B's raylet SIGKILLed (a lost node): B's rank exits within a second (each Ray worker watches its raylet),
    while Ray marks the node and the rank dead only after its GCS health check gives up, about 15 s later. B's agent
    sees its rank end and says so in its peer document (`ray_gone`); A's agent, with B among its peers, stops its
    half within the goal, from the raylet's death. Ray's own word, later, is the same group already torn down."""
    listen_b = f"{cluster.ip_b}:{cluster.free_port(cluster.ns_b)}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    listen_a = f"{cluster.ip_a}:{cluster.free_port(cluster.ns_a)}"
    # B reads Ray's state as A's agent relays it (proven): the head's dashboard over plain HTTP moves nothing on B
    env_a, env_b = _pair_envs(cluster, tmp_path, listen_a, listen_b)
    with (
        sparkwatch_run(tmp_path / "b", prefix=cluster.in_ns(cluster.ns_b, []), env=env_b),
        sparkwatch_run(tmp_path / "a", prefix=cluster.in_ns(cluster.ns_a, []), env=env_a) as daemon,
    ):
        assert wait_until(lambda: bool(_peer_doc(cluster, listen_b).get("ray_node_ids")), 20, 0.5)
        engine = Engine(cluster, tmp_path, "a")
        try:
            raylet_b = key_of(_ns_child(cluster, cluster.ns_b, "raylet"), "node B's raylet")
            # B's agent has listed its rank (Ray's state as A relays it, read every ray_poll_s): what it tells of
            # when the rank ends
            relayed = lambda: any(  # noqa: E731
                a["pid"] == engine.pid["rank_b"]
                for a in (_peer_doc(cluster, listen_a).get("ray") or {}).get("actors", [])
            )
            assert wait_until(relayed, 20, 0.5)
            time.sleep(2.5)
            died_at, died_wall = time.monotonic(), time.time()
            sigkill(*raylet_b)
            rank_b_s = gone_within([engine.keys["rank_b"]], died_at)
            took_s = gone_within([engine.keys["api"], engine.keys["driver"], engine.keys["rank_a"]], died_at)
            print(
                f"group teardown on node A after B's raylet died: B's rank exited {rank_b_s:.2f} s later, "
                f"A's last member gone {took_s:.2f} s later"
            )
            assert took_s <= TEARDOWN_GOAL_S
            event = wait_for_event(daemon.events_path, "group_teardown", timeout_s=10)
            detected_ts = event["detected_ts"]
            assert isinstance(detected_ts, float)
            print(f"node A decided {detected_ts - died_wall:.2f} s after the raylet died")
            assert event["group"] == engine.placement_group
            assert (event["cause"], event["first_node"]) == (raygroup.RANK_DIED, cluster.ip_b)
            assert event["first_pid"] == engine.pid["rank_b"]
            assert wait_until(lambda: pg_state(cluster, engine.placement_group) == ["REMOVED"], 30, 0.2)
        finally:
            engine.close()
            cluster.restart_b()  # the next test gets two nodes again


def test_node_b_lost_raylet_without_its_agent_waits_for_ray(cluster: RayCluster, tmp_path: Path) -> None:
    """The same loss with no agent on node B: only Ray can say it, after its health check (about 15 s); A stops its
    half within the goal of Ray's word. (With B's agent, above, within the goal of the death.)"""
    with sparkwatch_run(tmp_path, prefix=cluster.in_ns(cluster.ns_a, [])) as daemon:
        engine = Engine(cluster, tmp_path, "a")
        try:
            raylet_b = key_of(_ns_child(cluster, cluster.ns_b, "raylet"), "node B's raylet")
            died_at = time.monotonic()
            sigkill(*raylet_b)
            took_s = gone_within([engine.keys["api"], engine.keys["driver"], engine.keys["rank_a"]], died_at)
            gone_ts = time.time()
            event = wait_for_event(daemon.events_path, "group_teardown", timeout_s=10)
            detected_ts = event["detected_ts"]
            assert isinstance(detected_ts, float)
            print(
                f"group teardown on node A after B's raylet died, no agent on B: last member gone {took_s:.2f} s "
                f"later, {gone_ts - detected_ts:.2f} s after Ray's state said so"
            )
            assert gone_ts - detected_ts <= TEARDOWN_GOAL_S
            assert took_s <= 30  # Ray's own detection, measured 15.7 s
            assert event["group"] == engine.placement_group
            assert event["cause"] in (raygroup.RANK_DIED, raygroup.NODE_DEAD)
            assert event["first_node"] == cluster.ip_b
            assert wait_until(lambda: pg_state(cluster, engine.placement_group) == ["REMOVED"], 10, 0.2)
        finally:
            engine.close()
            cluster.restart_b()


def _scrape(cluster: RayCluster, listen: str) -> dict[str, float]:
    """Node A's agent's /metrics (where it listens, from inside node A), as {'name{labels}': value}."""
    out = cluster.get_in_a(f"http://{listen}/metrics")
    assert out.returncode == 0, out.stderr
    samples = {}
    for line in out.stdout.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def _engines_shows_the_group(cluster: RayCluster, tmp_path: Path, engine: Engine) -> None:
    """`sparkwatch engines --json` on node A lists the group as Ray has it: both nodes, the driver here with its pid,
    one rank on each node, A's marked local and B's not; the text view names the group too."""
    env = daemon_env(tmp_path, free_port())
    argv = [sys.executable, "-m", "sparkwatch", "engines", "--window", "0"]
    out = subprocess.run(
        cluster.in_ns(cluster.ns_a, [*argv, "--json"]), env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["groups_note"] is None
    (group,) = [g for g in doc["groups"] if g["group"] == engine.placement_group]
    assert group["first_death"] is None
    assert sorted(group["nodes"]) == sorted([cluster.ip_a, cluster.ip_b])
    driver = [m for m in group["members"] if m["role"] == raygroup.DRIVER]
    assert [(m["pid"], m["node_ip"], m["local"]) for m in driver] == [(engine.pid["driver"], cluster.ip_a, True)]
    ranks = {(m["pid"], m["node_ip"], m["local"], m["state"]) for m in group["members"] if m["role"] == raygroup.RANK}
    assert ranks == {
        (engine.pid["rank_a"], cluster.ip_a, True, "ALIVE"),
        (engine.pid["rank_b"], cluster.ip_b, False, "ALIVE"),
    }
    text = subprocess.run(cluster.in_ns(cluster.ns_a, argv), env=env, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert f"group {engine.placement_group[:12]}" in text.stdout and cluster.ip_b in text.stdout


# --- the pure decisions (core.kill.raygroup), over Ray's records


NODE_A, NODE_B = "a" * 56, "b" * 56


def _state(rank_b_state: str = "ALIVE", node_b_alive: bool = True) -> raygroup.RayState:
    return raygroup.RayState(
        nodes=(raygroup.RayNode(NODE_A, "10.0.0.1", True), raygroup.RayNode(NODE_B, "10.0.0.2", node_b_alive)),
        jobs=(raygroup.RayJob("01000000", 100, "10.0.0.1", True),),
        actors=(
            raygroup.RayActor("x1", "RayWorkerWrapper", "ALIVE", "01000000", NODE_A, 200, "pg1"),
            raygroup.RayActor("x2", "RayWorkerWrapper", rank_b_state, "01000000", NODE_B, 300, "pg1"),
        ),
        placement_groups=(raygroup.RayPlacementGroup("pg1", "01000000", "CREATED", (NODE_A, NODE_B)),),
    )


def _proc(pid: int, ppid: int, argv: tuple[str, ...], ticks: int = 7) -> Proc:
    return Proc(pid, ppid, 0, argv[0][:15], "S", ticks, 0, argv)


RAYLET = 50  # the raylet that started the ranks (their parent)


def _cluster(node_id: str, uid: int = 0) -> raygroup.Cluster:
    return raygroup.Cluster(frozenset({node_id}), uid, frozenset({RAYLET}))


PROCS = {
    99: _proc(99, 1, ("/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m")),
    100: _proc(100, 99, ("VLLM::EngineCore",)),
    200: _proc(200, 50, ("ray::RayWorkerWrapper.execute_method",)),
}


def test_group_rows_say_where_each_member_runs_and_what_ended_the_group() -> None:
    (row,) = raygroup.group_rows(_state(), frozenset({NODE_A}))
    assert row.group == "pg1" and row.job_id == "01000000" and row.death is None
    assert row.nodes == ("10.0.0.1", "10.0.0.2")
    assert [(m.role, m.pid, m.node_ip, m.state, m.local) for m in row.members] == [
        (raygroup.DRIVER, 100, "10.0.0.1", "RUNNING", True),
        (raygroup.RANK, 200, "10.0.0.1", "ALIVE", True),
        (raygroup.RANK, 300, "10.0.0.2", "ALIVE", False),
    ]
    (dead,) = raygroup.group_rows(_state(rank_b_state="DEAD"), frozenset({NODE_B}))
    assert dead.death == raygroup.Death(raygroup.RANK_DIED, NODE_B, "10.0.0.2", 300)
    assert [m.local for m in dead.members] == [False, False, True]


def test_a_rank_a_peer_stopped_as_a_teardown_is_never_the_first_death() -> None:
    """Both ranks dead at first sight (Ray keeps no time of death): the one node A's agent says it stopped as a
    group teardown is the consequence; B's own rank is the cause. Without that word, Ray's order decides."""
    state = _state(rank_b_state="DEAD")
    state = raygroup.RayState(
        state.nodes,
        state.jobs,
        tuple(replace(a, state="DEAD", placement_group_id="pg1") for a in state.actors),
        state.placement_groups,
    )
    (group,) = raygroup.groups(state)
    assert raygroup.first_death(group, state) == raygroup.Death(raygroup.RANK_DIED, NODE_A, "10.0.0.1", 200)
    told = frozenset({(NODE_A, 200)})
    assert raygroup.first_death(group, state, told) == raygroup.Death(raygroup.RANK_DIED, NODE_B, "10.0.0.2", 300)


def test_a_rank_its_own_node_s_agent_saw_end_is_dead_for_the_decisions() -> None:
    """B's raylet died first: Ray still lists B's rank ALIVE, B's agent says its process ended. A tears down its half
    with B's rank as the first death. A peer's word on another node's pid, or on a pid Ray does not place on that
    node, marks nothing."""
    state = _state()
    assert raygroup.local_ranks(state, frozenset({NODE_B})) == {(NODE_B, 300)}
    assert raygroup.remote_rank_nodes(state, frozenset({NODE_A})) == {NODE_B}
    for wrong in ({(NODE_A, 300)}, {(NODE_B, 200)}, {(NODE_B, 999)}):
        assert raygroup.gone_per_agents(state, frozenset(wrong)) == state
        assert raygroup.teardowns(raygroup.gone_per_agents(state, frozenset(wrong)), _cluster(NODE_A), PROCS) == ()
    marked = raygroup.gone_per_agents(state, frozenset({(NODE_B, 300)}))
    (teardown,) = raygroup.teardowns(marked, _cluster(NODE_A), PROCS)
    assert teardown.death == raygroup.Death(raygroup.RANK_DIED, NODE_B, "10.0.0.2", 300)
    assert {m.role for m in teardown.members} == {raygroup.RANK, raygroup.DRIVER, raygroup.API}
    assert raygroup.local_ranks(marked, frozenset({NODE_B})) == frozenset()  # told of once Ray, or we, say so


def test_this_node_tells_of_its_ranks_that_ended_and_never_of_one_it_never_saw(tmp_path: Path) -> None:
    """Node B's side: the ranks Ray lists ALIVE here are told of in the peer document once their process ends (a
    zombie has ended), kept after the raylet went; a pid never seen running here (another pid namespace) never."""
    settings = load_settings(
        None, {"state_dir": tmp_path, "ray_dashboard_url": "http://127.0.0.1:9"}, check_memory=False
    )
    watch = RayWatch(settings, lambda msg: None)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        never = rank.pid + 100000  # past any pid this box hands out now
        state = raygroup.RayState(
            nodes=(raygroup.RayNode(NODE_B, "10.0.0.2", True),),
            jobs=(raygroup.RayJob("01000000", 100, "10.0.0.1", True),),
            actors=(
                raygroup.RayActor("x1", "RayWorkerWrapper", "ALIVE", "01000000", NODE_B, rank.pid, "pg1"),
                raygroup.RayActor("x2", "RayWorkerWrapper", "ALIVE", "01000000", NODE_B, never, "pg1"),
            ),
            placement_groups=(raygroup.RayPlacementGroup("pg1", "01000000", "CREATED", (NODE_B, NODE_B)),),
        )
        watch.node_ids = frozenset({NODE_B})
        watch._keep_ranks(state, _cluster(NODE_B), time.monotonic())
        assert watch.gone_ranks() == () and watch.published_node_ids() == {NODE_B}
        rank.kill()
        assert wait_until(lambda: watch.gone_ranks() == ((NODE_B, rank.pid),), 5, 0.05)  # a zombie until reaped
        rank.wait()
        watch.node_ids = frozenset()  # the raylet went: still told of, the node still named
        assert watch.gone_ranks() == ((NODE_B, rank.pid),) and watch.published_node_ids() == {NODE_B}
        body = peerdoc.build("spark-b", watch.published_node_ids(), None, (), (), ray_gone=watch.gone_ranks())
        doc = peerdoc.parse(body)
        assert peerdoc.ray_gone(doc, NODE_B) == {rank.pid}
        assert peerdoc.ray_gone(doc, NODE_A) == frozenset()  # a node it does not serve: nothing said of it
        assert peerdoc.parse(body.replace(b',"ray_gone":[{"node_id":"' + NODE_B.encode() + b'","pid":'
                                          + str(rank.pid).encode() + b"}]", b"")).ray_gone == ()  # fmt: skip
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_the_driver_is_on_the_live_node_of_its_address_when_ray_keeps_a_dead_one() -> None:
    """Node B came back (its raylet restarted): Ray lists its old record DEAD and a new one ALIVE at the same address.
    The driver on that address is on the live node, in whatever order Ray lists them."""
    old_b = "c" * 56
    base = _state()
    for nodes in (
        (raygroup.RayNode(old_b, "10.0.0.1", False), *base.nodes),
        (*base.nodes, raygroup.RayNode(old_b, "10.0.0.1", False)),
    ):
        state = replace(base, nodes=nodes)
        (group,) = raygroup.groups(state)
        assert group.driver_node_id == NODE_A
        (teardown,) = raygroup.teardowns(
            replace(state, actors=tuple(replace(a, state="DEAD") if a.node_id == NODE_B else a for a in state.actors)),
            _cluster(NODE_A),
            PROCS,
        )
        assert {m.role for m in teardown.members} == {raygroup.API, raygroup.DRIVER, raygroup.RANK}


def test_no_teardown_while_every_member_lives() -> None:
    assert raygroup.teardowns(_state(), _cluster(NODE_A), PROCS) == ()


@pytest.mark.parametrize(
    ("state", "cause"),
    [(_state(rank_b_state="DEAD"), raygroup.RANK_DIED), (_state(node_b_alive=False), raygroup.NODE_DEAD)],
)
def test_a_dead_rank_or_node_tears_down_the_local_half(state: raygroup.RayState, cause: str) -> None:
    (teardown,) = raygroup.teardowns(state, _cluster(NODE_A), PROCS)
    assert teardown.group == "pg1"
    assert teardown.death == raygroup.Death(cause, NODE_B, "10.0.0.2", 300)
    assert {(m.pid, m.role) for m in teardown.members} == {
        (99, raygroup.API),
        (100, raygroup.DRIVER),
        (200, raygroup.RANK),
    }


def test_only_this_nodes_members_and_their_shapes() -> None:
    state = _state(rank_b_state="DEAD")
    # Node B's view: its rank is dead, the driver and the other rank run elsewhere: nothing of its own to stop.
    assert raygroup.teardowns(state, _cluster(NODE_B), PROCS) == ()
    # A pid Ray names that this node's table shows as something else (not a Ray worker) is never a member.
    procs = {**PROCS, 200: _proc(200, 50, ("sshd",))}
    (teardown,) = raygroup.teardowns(state, _cluster(NODE_A), procs)
    assert 200 not in {m.pid for m in teardown.members}
    # A removed placement group is no group.
    gone = raygroup.RayState(
        state.nodes, state.jobs, state.actors, (raygroup.RayPlacementGroup("pg1", "01000000", "REMOVED", ()),)
    )
    assert raygroup.teardowns(gone, _cluster(NODE_A), PROCS) == ()


def test_only_the_cluster_owner_s_processes_are_members() -> None:
    """A cluster belongs to the user its raylets run as: Ray's state naming another user's `vllm serve` and engine
    core (a forged answer, or another user's process at a pid Ray names) makes them no members, and a `ray::` worker
    that the cluster's raylet did not start (any user can set that title) is no rank."""
    state = _state(rank_b_state="DEAD")
    (teardown,) = raygroup.teardowns(state, _cluster(NODE_A), PROCS)
    assert {m.pid for m in teardown.members} == {99, 100, 200}
    assert raygroup.teardowns(state, _cluster(NODE_A, uid=1000), PROCS) == ()  # the cluster is uid 1000's
    theirs = {pid: replace(p, uid=65534) for pid, p in PROCS.items()}
    assert raygroup.teardowns(state, _cluster(NODE_A), theirs) == ()
    api_theirs = {**PROCS, 99: replace(PROCS[99], uid=65534)}
    (teardown,) = raygroup.teardowns(state, _cluster(NODE_A), api_theirs)
    assert {m.pid for m in teardown.members} == {100, 200}
    titled = {**PROCS, 200: replace(PROCS[200], ppid=4242)}  # a ray::RayWorkerWrapper title under another parent
    (teardown,) = raygroup.teardowns(state, _cluster(NODE_A), titled)
    assert {m.pid for m in teardown.members} == {99, 100}


def test_member_shapes() -> None:
    assert raygroup.member_shape(raygroup.RANK, ("ray::RayWorkerWrapper",))
    assert not raygroup.member_shape(raygroup.RANK, ("ray::IDLE",))
    assert not raygroup.member_shape(raygroup.RANK, ("ray::DashboardAgent",))
    assert raygroup.member_shape(raygroup.DRIVER, ("VLLM::EngineCore_DP0",))
    assert not raygroup.member_shape(raygroup.DRIVER, ("python3", "engine.py"))
    assert raygroup.member_shape(raygroup.API, ("/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m"))
    assert raygroup.member_shape(raygroup.API, ("/usr/local/bin/vllm", "serve"))
    assert not raygroup.member_shape(raygroup.API, ("python3", "vllm", "bench"))


@pytest.mark.parametrize(
    ("node", "pid", "peer_word", "said"),
    [
        ("10.0.0.2", 300, None, "rank_died on 10.0.0.2 (pid 300)"),
        ("10.0.0.2", 300, "killed by sparkwatch on b: budget: x", "pid 300 on 10.0.0.2 was killed by sparkwatch on b"),
        # Ray cancelled the rank's creation (its state: DEAD, no node, no pid): seen on a loaded CI box, where the
        # summary once read "rank_died on  (pid None)"
        ("", None, None, "rank_died: a rank died before Ray placed it (its start failed)"),
    ],
)
def test_a_group_loss_is_said_one_way_in_the_line_the_summary_and_the_reasons(
    node: str, pid: int | None, peer_word: str | None, said: str
) -> None:
    loss = GroupLoss("pg0123456789ab", raygroup.RANK_DIED, node, pid, ((1, "driver"),), 0.0, peer_word)
    assert said in loss.death
    proc = Proc(1, 0, 0, "VLLM::EngineCore", "S", 7, 1 << 20, ("VLLM::EngineCore",))
    facts = KillFacts(
        Trigger.GROUP_TEARDOWN,
        MemInfo(1 << 34, 1 << 33, 0, 0, 0, 0, 0),
        1 << 30,
        0.0,
        False,
        (),
        ((proc, "vllm"),),
        group=loss,
    )
    assert loss.death in kill_reason(facts)
    assert loss.death in kill_summary(facts)
    assert "None" not in loss.death and " on  " not in loss.death


def test_teardown_message_round_trip() -> None:
    msg = GroupTeardownMsg("pg1", raygroup.RANK_DIED, "10.0.0.2", 300, ((200, 7, "rank"),), 1.5, owner_uid=1000)
    assert decode(encode(msg)) == msg


# --- the guard's own checks (guard.groupwatch), on real processes


def _shaped(title: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SHAPE_TITLE": title, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([*prefix, sys.executable, str(SHAPE)], env=env)
    assert wait_until(lambda: _cmdline(proc.pid).startswith(title))
    return proc


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@contextmanager
def guard_with_groups(tmp_path: Path, **overrides: object) -> Iterator[tuple[PoolWatch, GroupWatch]]:
    """A pool watch (its reaper running, ticked by the test) and the group watch that hands it teardowns, as the
    guard process wires them: a teardown goes through the guard's one kill path (guard.killpath)."""
    settings = load_settings(
        None,
        {
            "state_dir": str(tmp_path / "state"),
            "ancestor_pid": os.getpid(),
            "postmortem": False,
            "floor": "1GiB",  # far under MemAvailable here: only the teardown fires
            "mlock": False,
            "kernel_log_path": str(tmp_path / "no-kmsg"),
            **overrides,
        },
    )
    pool = PoolWatch.build(guard_config(settings), EventLog(tmp_path / "events.jsonl"))
    pool.reaper.start()
    try:
        yield pool, GroupWatch(lambda: pool.snapshot, pool.inbox.submit)
    finally:
        pool.reaper.stop()


def test_guard_kills_only_members_it_verifies_itself(tmp_path: Path) -> None:
    rank = _shaped("ray::RayWorkerWrapper")
    other = _shaped("ray::RayWorkerWrapper")
    plain = subprocess.Popen(["sleep", "60"])
    elsewhere = _shaped("ray::RayWorkerWrapper", ("unshare", "--net"))  # another network namespace: another node
    # another user's process titled as a rank: not the cluster owner's
    theirs = subprocess.Popen(["bash", "-c", "exec -a ray::RayWorkerWrapper sleep 60"], user=65534, group=65534,
                              extra_groups=[])  # fmt: skip
    assert wait_until(lambda: _cmdline(theirs.pid).startswith("ray::RayWorkerWrapper"))
    procs = (rank, other, plain, elsewhere, theirs)
    try:
        ticks = {p.pid: read_start_ticks("/proc", p.pid) or 0 for p in procs}
        msg = GroupTeardownMsg(
            "pg1",
            raygroup.RANK_DIED,
            "10.0.0.2",
            300,
            (
                (rank.pid, ticks[rank.pid], raygroup.RANK),  # passes every check
                (other.pid, ticks[other.pid] + 1, raygroup.RANK),  # another start time: a reused pid
                (plain.pid, ticks[plain.pid], raygroup.RANK),  # not shaped like a Ray worker
                (elsewhere.pid, ticks[elsewhere.pid], raygroup.RANK),  # not on this node
                (theirs.pid, ticks[theirs.pid], raygroup.RANK),  # not the user the group belongs to
            ),
            time.time(),
            owner_uid=os.getuid(),
        )
        with guard_with_groups(tmp_path) as (pool, watch):
            assert watch.handle(replace(msg, owner_uid=-1)) == 0  # a message naming no owner moves nothing
            assert watch.refused_total == 5
            assert watch.handle(msg) == 1
            assert rank.poll() is None  # the check only asks: the kill path kills, on the guard's tick
            pool.tick()
            assert rank.wait(5) == -signal.SIGKILL
            assert other.poll() is None and plain.poll() is None and elsewhere.poll() is None and theirs.poll() is None
            assert watch.refused_total == 5 + 4
            assert pool.stats.kills_total == {"group_teardown": 1}  # counted like every kill
            events = tmp_path / "events.jsonl"
            assert wait_until(lambda: any(e["kind"] == "group_teardown" for e in read_events(events)))
        (event,) = [e for e in read_events(events) if e["kind"] == "group_teardown"]
        assert event["members"] == [{"pid": rank.pid, "role": raygroup.RANK}]
        assert (event["cause"], event["first_node"], event["first_pid"]) == (raygroup.RANK_DIED, "10.0.0.2", 300)
        assert event["trigger"] == "group_teardown" and event["signal_to_reaped_ms"] is not None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)


@pytest.mark.parametrize("on", [False, True])
def test_the_guard_process_honours_group_teardown_itself(tmp_path: Path, on: bool) -> None:
    """With `group_teardown = false` the guard refuses a teardown even when one reaches it (telemetry sends none
    then; a reload racing a message must not kill): the member lives and the refusal is counted. On, the same
    message, through the supervisor's callback as the channel delivers it, kills the member on the next tick."""
    rank = _shaped("ray::RayWorkerWrapper")
    try:
        ticks = read_start_ticks("/proc", rank.pid) or 0
        settings = load_settings(
            None,
            {
                "state_dir": tmp_path / "state",
                "root": tmp_path / "root",
                "ancestor_pid": os.getpid(),
                "floor": "1GiB",
                "mlock": False,
                "listen": "127.0.0.1:9",  # never started here
                "kernel_log_path": str(tmp_path / "no-kmsg"),
                "group_teardown": on,
            },
        )
        gp = GuardProcess(guard_config(settings), telemetry=None)
        msg = GroupTeardownMsg(
            "pg1", raygroup.RANK_DIED, "10.0.0.2", 300, ((rank.pid, ticks, raygroup.RANK),), 1.0, owner_uid=os.getuid()
        )
        gp.supervisor.verifiers[GroupTeardownMsg](msg)
        gp.guard.reaper.start()
        try:
            gp.guard.tick()
            if on:
                assert rank.wait(5) == -signal.SIGKILL
            else:
                time.sleep(0.2)
                assert rank.poll() is None
        finally:
            gp.guard.reaper.stop()
        counters = gp.counters()["groupwatch"]
        assert (counters["teardowns"], counters["refused_off"]) == ((1, 0) if on else (0, 1))
    finally:
        if rank.poll() is None:
            rank.kill()
        rank.wait(5)


# --- telemetry's reading of Ray's state API (telemetry.sources.raystate): every failure counted, none decides


class _Answers(http.server.BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b"<html>not the state API</html>", "bad_answer"),
        (b'{"data": {"result": {"result": "nope"}}}', "bad_answer"),
        (b'{"data": {"result": {"result": [{"node_id": 5}]}}}', "bad_answer"),
    ],
)
def test_a_bad_answer_is_counted_and_decides_nothing(body: bytes, kind: str) -> None:
    handler = type("Handler", (_Answers,), {"body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        source = RayStateSource(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(RayStateError):
            source.poll()
        assert source.errors[kind] == 1
        assert source.last_error is not None and source.last_error.startswith(kind)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_an_unreachable_api_is_counted() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        source = RayStateSource(f"http://127.0.0.1:{port}")
        with pytest.raises(RayStateError):
            source.poll()
    assert source.errors["unreachable"] == 1


@pytest.mark.parametrize("url", ["http://:8265", "http://127.0.0.1:port"])
def test_a_bad_url_is_counted_never_raised_at_start(url: str) -> None:
    source = RayStateSource(url)
    with pytest.raises(RayStateError):
        source.poll_actors()
    assert source.errors["bad_url"] == 1


def test_no_raylet_here_no_request(tmp_path: Path) -> None:
    """A box without a raylet in its namespace never asks Ray anything (the URL would be refused and counted). Its
    process table is an empty proc root: another suite's Ray on this machine is not this box's."""
    (tmp_path / "proc").mkdir()
    settings = load_settings(
        None,
        {
            "state_dir": str(tmp_path / "state"),
            "proc_root": str(tmp_path / "proc"),
            "ray_dashboard_url": "http://127.0.0.1:9",
        },
    )
    sent: list[GroupTeardownMsg | PeerBudgetMsg] = []
    watch = RayWatch(settings, sent.append)
    assert watch.poll_once() == [] and sent == []
    assert watch.source.polls_total == 0 and not any(watch.source.errors.values())


def test_without_a_raylet_the_watch_sleeps_and_a_raylet_started_later_is_found_at_the_next_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telemetry's cycles hand the watch their process table (observe): with no raylet in it the thread never wakes
    and never looks (it looked every RAYLET_LOOK_S), and the cycle that first shows a raylet wakes it, which finds it
    at once; the cycle that no longer shows it has it forgotten. Other raylets on this box (another suite's Ray) are
    left out of the tables handed over."""
    monkeypatch.setattr(raywatch, "RAYLET_LOOK_S", 0.3)  # a watch that looked on a timer would look ten times here
    settings = load_settings(
        None, {"state_dir": str(tmp_path / "state"), "ray_dashboard_url": "http://127.0.0.1:9"}, check_memory=False
    )
    scanner = ProcScanner(Path("/proc"))

    def cycle(*pids: int) -> tuple[Proc, ...]:
        return tuple(p for p in scanner.scan().procs if p.comm != RAYLET_COMM or p.pid in pids)

    shaped = tmp_path / RAYLET_EXE_SUFFIX.lstrip("/")  # a program at Ray's own path: a raylet by its executable
    shaped.parent.mkdir(parents=True)
    shutil.copy("/bin/sh", shaped)
    watch = RayWatch(settings, lambda msg: None)
    watch.start()
    raylet: subprocess.Popen[bytes] | None = None
    try:
        quiet = cycle()
        watch.observe(quiet)
        time.sleep(0.3)
        before = wakeups(watch._thread)
        for _ in range(30):  # 3 s of telemetry cycles without a raylet
            watch.observe(quiet)
            time.sleep(0.1)
        assert wakeups(watch._thread) - before <= 1 and watch.looks_total == 0
        argv = [str(shaped), "-c", "sleep 60; exit 0", "raylet", f"--node_id={NODE_A}", "--gcs-address=127.0.0.1:9"]
        raylet = subprocess.Popen(argv)
        assert wait_until(lambda: Path(f"/proc/{raylet.pid}/comm").read_text().strip() == RAYLET_COMM, 5)
        watch.observe(cycle(raylet.pid))  # the first cycle that sees it
        assert wait_until(lambda: watch.node_ids == {NODE_A}, 5), watch.looks_total
        raylet.kill()
        raylet.wait()
        watch.observe(cycle())
        assert wait_until(lambda: not watch.node_ids, 5)
    finally:
        watch.stop()
        if raylet is not None and raylet.poll() is None:
            raylet.kill()
            raylet.wait()


def test_a_process_named_raylet_in_another_network_namespace_wakes_no_watch(tmp_path: Path) -> None:
    """Another node's raylet on this box (a container's, the two-node tests') is named raylet too: the cycle that
    first shows it costs one readlink of its namespace, and the watch's thread sleeps on. A raylet in ours wakes it."""
    require(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare for a network namespace")
    settings = load_settings(
        None, {"state_dir": str(tmp_path / "state"), "ray_dashboard_url": "http://127.0.0.1:9"}, check_memory=False
    )
    named_raylet = tmp_path / RAYLET_COMM  # a sleep whose comm is raylet
    shutil.copy("/bin/sleep", named_raylet)
    scanner = ProcScanner(Path("/proc"))

    def cycle(*pids: int) -> tuple[Proc, ...]:
        return tuple(p for p in scanner.scan().procs if p.comm != RAYLET_COMM or p.pid in pids)

    watch = RayWatch(settings, lambda msg: None)
    with ExitStack() as stack:
        foreign = subprocess.Popen(["unshare", "--net", str(named_raylet), "60"])
        stack.callback(foreign.wait)
        stack.callback(foreign.kill)
        assert wait_until(lambda: Path(f"/proc/{foreign.pid}/comm").read_text().strip() == RAYLET_COMM, 5)
        watch.observe(cycle())
        changes = watch._named_changes
        watch.observe(cycle(foreign.pid))
        assert watch._named_changes == changes and not watch._wake.is_set()
        ours = subprocess.Popen([str(named_raylet), "60"])
        stack.callback(ours.wait)
        stack.callback(ours.kill)
        assert wait_until(lambda: Path(f"/proc/{ours.pid}/comm").read_text().strip() == RAYLET_COMM, 5)
        watch.observe(cycle(foreign.pid, ours.pid))
        assert watch._named_changes == changes + 1 and watch._wake.is_set()


def test_a_placement_group_outliving_its_teardown_is_leaked() -> None:
    live = raygroup.groups(_state(rank_b_state="DEAD"))
    assert raygroup.leaked_groups(live, {}, 100.0) == ()  # not torn down here: not ours to remove
    assert raygroup.leaked_groups(live, {"pg1": 99.0}, 100.0) == ()  # the driver's death removes it within 0.2 s
    assert raygroup.leaked_groups(live, {"pg1": 100.0 - raygroup.PG_GRACE_S}, 100.0) == ("pg1",)
    assert raygroup.leaked_groups((), {"pg1": 0.0}, 100.0) == ()  # gone already


def test_guard_dry_run_signals_nothing(tmp_path: Path) -> None:
    rank = _shaped("ray::RayWorkerWrapper")
    try:
        with guard_with_groups(tmp_path, dry_run=True) as (pool, watch):
            ticks = read_start_ticks("/proc", rank.pid) or 0
            msg = GroupTeardownMsg(
                "pg1", raygroup.RANK_DIED, "10.0.0.2", 300, ((rank.pid, ticks, raygroup.RANK),), owner_uid=os.getuid()
            )
            assert watch.handle(msg) == 1
            pool.tick()
            assert wait_until(lambda: bool(read_events(tmp_path / "events.jsonl")))
            (event,) = read_events(tmp_path / "events.jsonl")
            assert event["kind"] == "group_teardown"
            assert event["dry_run"] is True and "would stop" in str(event["summary"])
            assert pool.stats.kills_total == {} and pool.stats.would_kills_total == {"group_teardown": 1}
            assert not wait_until(lambda: rank.poll() is not None, timeout_s=0.3)  # a SIGKILL would end it at once
    finally:
        rank.kill()
        rank.wait(5)


# --- groups without Ray: vLLM's multiprocessing backend across the same two namespaces (core.kill.mpgroup,
# telemetry.mpwatch): the group is what both command lines name (`--master-addr A --master-port P`), and each
# node's agent learns the other's members from its peer document.

MP_ENGINE = Path(__file__).resolve().parent / "helpers" / "mp_engine.py"


class NodeProcs:
    """Processes a test started on the two nodes, and (pid, start ticks) of those it signals; `close` ends them."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.keys: dict[str, tuple[int, int]] = {}

    def close(self) -> None:
        for key in self.keys.values():
            if alive(*key):
                sigkill(*key)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


class MpEngine(NodeProcs):
    """`vllm serve tiny-model --nnodes 2 --node-rank R --master-addr <A> --master-port P` in each namespace (rank 1
    `--headless`), each with one `VLLM::EngineCore` child; `keys`: (pid, start ticks) of rank0, child0, rank1,
    child1."""

    def __init__(self, cluster: RayCluster, tmp_path: Path) -> None:
        super().__init__()
        vllm = tmp_path / "bin-mp" / "vllm"
        vllm.parent.mkdir(exist_ok=True)
        shutil.copy(MP_ENGINE, vllm)
        self.port = cluster.free_port(cluster.ns_a)  # rank 0 binds it, on node A
        self.key = f"{cluster.ip_a}:{self.port}"
        try:
            for rank, ns in ((0, cluster.ns_a), (1, cluster.ns_b)):
                argv = [sys.executable, str(vllm), "serve", "tiny-model", "--nnodes", "2", "--node-rank", str(rank),
                        "--master-addr", cluster.ip_a, "--master-port", str(self.port)]  # fmt: skip
                argv += ["--headless"] if rank else []
                self.procs.append(subprocess.Popen(cluster.in_ns(ns, argv), stdout=subprocess.PIPE, text=True))
            for rank, proc in enumerate(self.procs):
                info = json.loads(read_line(proc, 60))
                self.keys[f"rank{rank}"] = key_of(info["pid"], f"rank{rank}")
                self.keys[f"child{rank}"] = key_of(info["child"], f"child{rank}")
        except BaseException:
            self.close()
            raise


@dataclass
class MpPair:
    a: RunningDaemon
    b: RunningDaemon
    listen_a: str
    listen_b: str
    stop_b: ExitStack  # closing it stops B's agent (a test may stop it early)


@contextmanager
def mp_pair(cluster: RayCluster, tmp_path: Path) -> Iterator[MpPair]:
    """One agent a node, each with the other among its `peers` (read every 0.5 s), each listening on its node's
    address; no Ray dashboard looked for."""
    listen_a, listen_b = (
        f"{cluster.ip_a}:{cluster.free_port(cluster.ns_a)}",
        f"{cluster.ip_b}:{cluster.free_port(cluster.ns_b)}",
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    common = {"SPARKWATCH_PEER_POLL_S": "0.5", "SPARKWATCH_RAY_DASHBOARD_URL": "", **pair_key(tmp_path)}
    env_a = {**common, "SPARKWATCH_LISTEN": listen_a, "SPARKWATCH_PEERS": json.dumps([listen_b])}
    env_b = {**common, "SPARKWATCH_LISTEN": listen_b, "SPARKWATCH_PEERS": json.dumps([listen_a])}
    with ExitStack() as stop_b:
        daemon_b = stop_b.enter_context(
            sparkwatch_run(tmp_path / "b", prefix=cluster.in_ns(cluster.ns_b, []), env=env_b)
        )
        with sparkwatch_run(tmp_path / "a", prefix=cluster.in_ns(cluster.ns_a, []), env=env_a) as daemon_a:
            yield MpPair(daemon_a, daemon_b, listen_a, listen_b, stop_b)


def _lists(cluster: RayCluster, listen: str, key: str, pid: int) -> bool:
    return any(g["key"] == key and g["pid"] == pid for g in _peer_doc(cluster, listen).get("groups", []))


def test_a_node_s_port_is_picked_free_in_that_node_s_namespace() -> None:
    """The mp test failed on a fresh clone: node B's agent found its port "in use by another process", a port picked
    free in the test's namespace and bound in B's, where a Ray process held it. A node's port is now picked in its
    namespace: there, with only two ports to give and one held, the picker gives the other, whatever is free here."""
    why = netns_permitted()
    require(why is None, why or "")
    ns = f"swport{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=10)
    in_ns = ["ip", "netns", "exec", ns]
    try:
        subprocess.run([*in_ns, "ip", "link", "set", "lo", "up"], check=True, capture_output=True, timeout=10)
        subprocess.run([*in_ns, "sysctl", "-qw", "net.ipv4.ip_local_port_range=40111 40112"], check=True,
                       capture_output=True, timeout=10)  # fmt: skip
        hold = "import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', 40111)); s.listen(); print(1, flush=True)"
        hold += "; sys.stdin.read()"  # held until the test closes its stdin
        with subprocess.Popen([*in_ns, sys.executable, "-c", hold], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE) as holder:  # fmt: skip
            assert holder.stdout is not None and holder.stdout.readline() == b"1\n"
            try:
                assert {free_port(in_ns) for _ in range(5)} == {40112}
            finally:
                holder.kill()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_mp_group_a_rank_killed_on_b_stops_node_a_s_member(cluster: RayCluster, tmp_path: Path) -> None:
    """The headless rank on B dies (SIGKILL, as the OOM killer would): node A's agent, reading B's agent, stops A's
    member of the same rendezvous (the API server and its engine core) within the goal, and B's agent stops the
    engine core B's rank left behind."""
    with mp_pair(cluster, tmp_path) as pair:
        engine = MpEngine(cluster, tmp_path)
        try:
            # each agent lists its own member, never the other node's (same process table here: the namespace decides)
            assert wait_until(lambda: _lists(cluster, pair.listen_b, engine.key, engine.keys["rank1"][0]), 20, 0.2)
            assert wait_until(lambda: _lists(cluster, pair.listen_a, engine.key, engine.keys["rank0"][0]), 20, 0.2)
            assert not _lists(cluster, pair.listen_b, engine.key, engine.keys["rank0"][0])
            time.sleep(1.5)  # three of A's reads of B: A has seen B's member
            died_at = time.monotonic()
            sigkill(*engine.keys["rank1"])
            took_s = gone_within([engine.keys["rank0"], engine.keys["child0"]], died_at)
            print(f"mp group teardown on node A: last member gone {took_s:.2f} s after the rank on B died")
            assert took_s <= TEARDOWN_GOAL_S
            event = wait_for_event(pair.a.events_path, "group_teardown", timeout_s=10)
            rank1 = engine.keys["rank1"][0]
            assert (event["group"], event["cause"], event["first_pid"]) == (engine.key, "rank_died", rank1)
            members = event["members"]
            assert isinstance(members, list)
            # the member the guard checked, and its engine core, swept with it as a child
            assert [(m["pid"], m["role"]) for m in members] == [
                (engine.keys["rank0"][0], mpgroup.MP_RANK),
                (engine.keys["child0"][0], "child"),
            ]
            # B's own member died and left its engine core behind (reparented, stuck): B's agent stops it, having
            # seen it in the member's tree, ORPHAN_GRACE_S after the death at the earliest
            orphan_s = gone_within([engine.keys["child1"]], died_at)
            print(f"node B: the dead rank's engine core stopped {orphan_s:.2f} s after the rank died")
            assert ORPHAN_GRACE_S <= orphan_s <= TEARDOWN_GOAL_S + ORPHAN_GRACE_S
            on_b = wait_for_event(pair.b.events_path, "group_teardown", timeout_s=10)
            assert (on_b["group"], on_b["cause"], on_b["first_pid"]) == (engine.key, "rank_died", rank1)
            assert on_b["members"] == [{"pid": engine.keys["child1"][0], "role": mpgroup.MP_ORPHAN}]
            assert not any(e["kind"] == "kill" for e in read_events(pair.b.events_path))
        finally:
            engine.close()


def test_mp_group_peer_lost_stops_node_a_s_member(cluster: RayCluster, tmp_path: Path) -> None:
    """B's agent stops answering while the group runs (SIGSTOPped whole: B's kernel takes A's connections and nothing
    answers, as on a wedged Spark): A's agent records `peer_lost` and stops A's member (cause peer_lost). B's rank,
    which no agent watches now, lives."""
    with mp_pair(cluster, tmp_path) as pair:
        engine = MpEngine(cluster, tmp_path)
        try:
            assert wait_until(lambda: _lists(cluster, pair.listen_b, engine.key, engine.keys["rank1"][0]), 20, 0.2)
            time.sleep(1.5)  # three of A's reads of B: A has seen B's member
            with pair.b.paused():
                lost_at = time.monotonic()
                took_s = gone_within([engine.keys["rank0"], engine.keys["child0"]], lost_at)
                lost = wait_for_event(pair.a.events_path, "peer_lost", timeout_s=5)
                lost_s = _event_age_s(lost)
                print(
                    f"mp group teardown on node A: member gone {took_s:.2f} s after B's agent went silent, "
                    f"{lost_s:.2f} s after A recorded peer_lost"
                )
                # the loss itself takes PEER_LOST_AFTER reads of 1 s without an answer (0.5 s apart here)
                assert lost_s <= TEARDOWN_GOAL_S and took_s <= TEARDOWN_GOAL_S + PEER_LOST_AFTER * (
                    PEER_TIMEOUT_S + 0.5
                )
                assert lost["peer"] == pair.listen_b
                event = wait_for_event(pair.a.events_path, "group_teardown", timeout_s=5)
                assert (event["group"], event["cause"], event["first_pid"]) == (engine.key, "peer_lost", None)
                assert alive(*engine.keys["rank1"])
        finally:
            engine.close()


def test_mp_group_a_peer_agent_stopped_is_not_lost_and_ends_nothing(cluster: RayCluster, tmp_path: Path) -> None:
    """B's agent stopped (an upgrade, a restart, the owner's `systemctl stop`): B's kernel refuses A's connections,
    B's rank runs on. That is no lost node: A records no `peer_lost` and its member of the group lives."""
    with mp_pair(cluster, tmp_path) as pair:
        engine = MpEngine(cluster, tmp_path)
        try:
            assert wait_until(lambda: _lists(cluster, pair.listen_b, engine.key, engine.keys["rank1"][0]), 20, 0.2)
            time.sleep(1.5)  # three of A's reads of B: A has seen B's member
            pair.stop_b.close()
            time.sleep(2 * PEER_LOST_AFTER * 0.5 + 1)  # twice the reads that a silent peer would be lost after
            assert alive(*engine.keys["rank0"]) and alive(*engine.keys["child0"]) and alive(*engine.keys["rank1"])
            kinds = [e["kind"] for e in read_events(pair.a.events_path)]
            assert "peer_lost" not in kinds and "group_teardown" not in kinds
            refused = [v for k, v in _scrape(cluster, pair.listen_a).items() if 'counter="peer_errors_refused"' in k]
            assert refused and refused[0] > 0  # said in A's metrics
        finally:
            engine.close()


def _event_age_s(event: dict[str, object]) -> float:
    """How long before now the event was recorded, from its own timestamp."""
    ts = event["ts"]
    assert isinstance(ts, str)
    return time.time() - datetime.fromisoformat(ts).timestamp()


# llama.cpp's RPC shape: `rpc-server -H 0.0.0.0 -p P` on node B, `llama-server -m M --rpc <B>:P` on node A. Each is
# this interpreter under the binary's own name (a symlink: argv[0] is `rpc-server`, as the C++ binary's is), running
# a stand-in: the server accepts and holds its head's connection; the head connects and then blocks as llama.cpp
# does in a recv whose peer is wedged.
RPC_SERVER = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[sys.argv.index("-p") + 1])))
print("listening", flush=True)
held = [server.accept()[0] for _ in range(1)]
time.sleep(3600)
"""
RPC_HEAD = """
import json, os, socket, sys, time
host, port = sys.argv[sys.argv.index("--rpc") + 1].rsplit(":", 1)
deadline = time.monotonic() + 60
while True:
    try:
        conn = socket.create_connection((host, int(port)), timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
print(json.dumps({"pid": os.getpid()}), flush=True)
time.sleep(3600)
"""


class RpcEngine(NodeProcs):
    """llama.cpp over RPC across the two nodes; `keys`: (pid, start ticks) of `server` (B) and `head` (A)."""

    def __init__(self, cluster: RayCluster, tmp_path: Path) -> None:
        super().__init__()
        bin_dir = tmp_path / "bin-rpc"
        bin_dir.mkdir(exist_ok=True)
        for name in ("rpc-server", "llama-server"):
            (bin_dir / name).symlink_to(os.path.realpath(sys.executable))
        self.port = cluster.free_port(cluster.ns_b)  # the rpc-server binds it, on node B
        self.key = f"{cluster.ip_b}:{self.port}"
        try:
            server_argv = [str(bin_dir / "rpc-server"), "-c", RPC_SERVER, "-H", "0.0.0.0", "-p", str(self.port)]
            server = subprocess.Popen(cluster.in_ns(cluster.ns_b, server_argv), stdout=subprocess.PIPE, text=True)
            self.procs.append(server)
            assert read_line(server, 60).strip() == "listening"
            self.keys["server"] = key_of(_ns_child(cluster, cluster.ns_b, "rpc-server"), "server")
            head_argv = [str(bin_dir / "llama-server"), "-c", RPC_HEAD, "-m", "m.gguf", "--rpc", self.key]
            head = subprocess.Popen(cluster.in_ns(cluster.ns_a, head_argv), stdout=subprocess.PIPE, text=True)
            self.procs.append(head)
            self.keys["head"] = key_of(json.loads(read_line(head, 60))["pid"], "head")
        except BaseException:
            self.close()
            raise


def _ns_child(cluster: RayCluster, ns: str, name: str) -> int:
    """The one process of the test's own in namespace `ns` whose argv[0] ends in `name`."""
    (pid,) = [p for p in cluster.netns_pids(ns) if _cmdline(p).split(" ", 1)[0].endswith("/" + name)]
    return pid


def test_rpc_group_a_dead_rpc_server_on_b_stops_the_head_on_a(cluster: RayCluster, tmp_path: Path) -> None:
    """B's rpc-server dies (the OOM killer): A's llama-server head, blocked on it, is stopped by A's agent within the
    goal. B's agent lists its rpc-server by the address the head reached it on, the key the head names."""
    with mp_pair(cluster, tmp_path) as pair:
        engine = RpcEngine(cluster, tmp_path)
        try:
            server_pid = engine.keys["server"][0]
            assert wait_until(lambda: _lists(cluster, pair.listen_b, engine.key, server_pid), 20, 0.2)
            time.sleep(1.5)  # three of A's reads of B: A has seen B's rpc-server
            died_at = time.monotonic()
            sigkill(*engine.keys["server"])
            took_s = gone_within([engine.keys["head"]], died_at)
            print(f"rpc group teardown on node A: the head gone {took_s:.2f} s after B's rpc-server died")
            assert took_s <= TEARDOWN_GOAL_S
            event = wait_for_event(pair.a.events_path, "group_teardown", timeout_s=10)
            assert (event["group"], event["cause"], event["first_pid"]) == (engine.key, "rank_died", server_pid)
            assert event["members"] == [{"pid": engine.keys["head"][0], "role": mpgroup.MP_RANK}]
        finally:
            engine.close()


def test_rpc_group_a_dead_head_leaves_the_rpc_server_waiting_for_the_next(cluster: RayCluster, tmp_path: Path) -> None:
    """The head on A dies: B's rpc-server frees that client's buffers and waits for the next (llama.cpp's design),
    so B's agent stops nothing."""
    with mp_pair(cluster, tmp_path) as pair:
        engine = RpcEngine(cluster, tmp_path)
        try:
            assert wait_until(lambda: _lists(cluster, pair.listen_a, engine.key, engine.keys["head"][0]), 20, 0.2)
            time.sleep(1.5)
            sigkill(*engine.keys["head"])
            time.sleep(2 * 0.5 * PEER_LOST_AFTER + ORPHAN_GRACE_S)
            assert alive(*engine.keys["server"])
            assert not any(e["kind"] in ("kill", "group_teardown") for e in read_events(pair.b.events_path))
        finally:
            engine.close()


SLEEP = "import time; time.sleep(60)"
MP_ARGV = ("vllm", "serve", "m", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.9.0.1", "--master-port")
CORE_TITLE = "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(60)"


@pytest.mark.parametrize(
    ("role", "passes", "fails"),
    [
        # a member: its own command line names the group's rendezvous (the other names another: another group)
        (mpgroup.MP_RANK, ("-c", SLEEP, *MP_ARGV, "29600"), ("-c", SLEEP, *MP_ARGV, "29601")),
        # what a dead member left behind, tied only by the tree telemetry saw: an engine by its own identity
        # (`VLLM::EngineCore`, as vLLM titles it) passes, a plain sleeper telemetry named all the same does not
        (mpgroup.MP_ORPHAN, ("-c", CORE_TITLE), ("-c", SLEEP)),
    ],
)
def test_guard_kills_an_mp_member_only_when_its_own_proc_ties_it_to_the_group(
    tmp_path: Path, role: str, passes: tuple[str, ...], fails: tuple[str, ...]
) -> None:
    """Telemetry names the members; the guard kills one only when its own /proc says it belongs to the group."""
    member = subprocess.Popen([sys.executable, *passes])
    other = subprocess.Popen([sys.executable, *fails])
    try:
        if role == mpgroup.MP_ORPHAN:
            assert wait_until(lambda: _cmdline(member.pid).startswith("VLLM::EngineCore"), 10, 0.05)
        ticks = {p.pid: read_start_ticks("/proc", p.pid) or 0 for p in (member, other)}
        msg = GroupTeardownMsg(
            "10.9.0.1:29600", "rank_died", "spark-b", 41,
            tuple((p.pid, ticks[p.pid], role) for p in (member, other)), time.time(), owner_uid=os.getuid(),
        )  # fmt: skip
        with guard_with_groups(tmp_path) as (pool, watch):
            assert watch.handle(msg) == 1
            pool.tick()
            assert member.wait(5) == -signal.SIGKILL
            assert other.poll() is None and watch.refused_total == 1
    finally:
        for p in (member, other):
            if p.poll() is None:
                p.kill()
            p.wait(5)


def test_the_guard_holds_a_rank_to_a_peer_budget_only_for_that_very_process_and_its_user(
    spawner: Spawner, tmp_path: Path
) -> None:
    """guard.budgets with telemetry's PeerBudgetMsg set: the engine tree whose root is that (pid, start ticks) and
    uid is held to the budget, source `peer`; the same key with another uid, or a key that is not this process's
    start, is not."""
    pidfile = tmp_path / "rank.pids"
    spawner.engine("--title", "ray::RayWorkerWrapper", pidfile=pidfile, wait_for=1)
    (pid, (ticks, _role)), *_ = pids_in(pidfile).items()
    settings = load_settings(None, {"state_dir": str(tmp_path / "state")})
    rules, scope = engine_rules(settings), engine_scope(settings)

    def tracked(peer: dict[tuple[int, int], tuple[int, int]]) -> dict[tuple[int, int], str]:
        watch = BudgetWatch("/proc", ProcScanner(Path("/proc")), kill=lambda r: None, event=lambda *e: None)
        watch.tick(time.monotonic(), 1 << 40, rules=rules, scope=scope, params=BudgetParams(), config_budgets=(),
                   launched=(), gpu=None, peer_budgets=peer)  # fmt: skip
        return {k: t.source for k, t in watch.tracked.items()}

    assert tracked({(pid, ticks): (os.geteuid(), 64 << 20)}) == {(pid, ticks): "peer"}
    assert tracked({(pid, ticks): (os.geteuid() + 1, 64 << 20)}) == {}  # another user's word for our process
    assert tracked({(pid, ticks + 1): (os.geteuid(), 64 << 20)}) == {}  # a reused pid: another process


# --- another user against a root agent on the real cluster (issue 37): a forged word moves nothing

FORGED_STATE = """
import http.server, json, sys
port, ip_a, ip_b, node_a, node_b, driver = sys.argv[1:7]
def rows(r):
    return json.dumps({"data": {"result": {"result": r}}}).encode()
ANSWERS = {
    "nodes": rows([{"node_id": node_a, "node_ip": ip_a, "state": "ALIVE"},
                   {"node_id": node_b, "node_ip": ip_b, "state": "ALIVE"}]),
    "jobs": rows([{"job_id": "01000000", "status": "RUNNING",
                   "driver_info": {"pid": driver, "node_ip_address": ip_a}}]),
    "actors": rows([{"actor_id": "x1", "class_name": "RayWorkerWrapper", "state": "DEAD", "job_id": "01000000",
                     "node_id": node_b, "pid": 4242, "placement_group_id": "ab" * 9}]),
    "placement_groups": rows([{"placement_group_id": "ab" * 9, "creator_job_id": "01000000", "state": "CREATED",
                               "bundles": [{"node_id": node_a}, {"node_id": node_b}]}]),
}
class Answers(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ANSWERS.get(self.path.split("?")[0].rsplit("/", 1)[-1])
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(port)), Answers)
print("up", flush=True)
server.serve_forever()
"""
VLLM_SERVE = """
import subprocess, sys
core = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 120"])
print(core.pid, flush=True)
core.wait()
"""


@pytest.mark.parametrize("served_by", ["nobody", "root"])
def test_a_forged_rank_death_never_kills_another_user_s_engine(
    cluster: RayCluster, tmp_path: Path, spawner: Spawner, served_by: str
) -> None:
    """Node A's raylet is root's; nobody runs a healthy `vllm serve` and its `VLLM::EngineCore` on node A. A Ray state
    API names that engine core as the driver of a group whose rank on B is DEAD (before issue 37, root's guard killed
    both 0.8 s later). Served from a port nobody holds, it is nobody's word: shown, never acted on. Served from a
    port of root's, it speaks for root's cluster, whose members are root's processes only: nobody's engine is none."""
    share = Path(tempfile.mkdtemp(prefix="sw-nobody-"))
    try:
        share.chmod(0o755)
        (share / "vllm").write_text(VLLM_SERVE)
        (share / "forged.py").write_text(FORGED_STATE)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        api = spawner.popen(cluster.in_ns(cluster.ns_a, [*as_nobody, "/usr/bin/python3", str(share / "vllm"),
                                                          "serve", "m"]), stdout=subprocess.PIPE)  # fmt: skip
        assert api.stdout is not None
        core = int(api.stdout.readline())
        port = cluster.free_port(cluster.ns_a)  # the forged dashboard binds it, on node A
        serve_as = as_nobody if served_by == "nobody" else []
        node_a, node_b = cluster.node_ids[cluster.ip_a], cluster.node_ids[cluster.ip_b]
        forged = spawner.popen(cluster.in_ns(cluster.ns_a, [*serve_as, "/usr/bin/python3", str(share / "forged.py"),
                               str(port), cluster.ip_a, cluster.ip_b, node_a, node_b, str(core)]),
                               stdout=subprocess.PIPE)  # fmt: skip
        assert forged.stdout is not None and forged.stdout.readline() == b"up\n"
        keys = [(pid, read_start_ticks("/proc", pid) or 0) for pid in (api.pid, core)]
        env = {"SPARKWATCH_RAY_DASHBOARD_URL": f"http://127.0.0.1:{port}"}
        with sparkwatch_run(tmp_path, prefix=cluster.in_ns(cluster.ns_a, []), env=env) as daemon:
            group = f'group="{"ab" * 9}"'  # the forged group, read and shown (engines, metrics)
            assert wait_until(lambda: group in str(_scrape(cluster, f"127.0.0.1:{daemon.port}")), 20, 0.5)
            time.sleep(3 * 2.0)  # three of the group watch's polls (ray_poll_s): each would have torn it down
            said = "never acted on: the dashboard's port is held by uid 65534"
            assert any(said in line for line in daemon.stderr_lines) == (served_by == "nobody"), daemon.stderr_lines
            assert all(alive(*k) for k in keys)
            assert not any(e["kind"] == "group_teardown" for e in read_events(daemon.events_path))
    finally:
        shutil.rmtree(share, ignore_errors=True)
