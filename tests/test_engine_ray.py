"""A real local Ray cluster (pip `ray`, loopback): its workers and actors are candidates; the raylet, the GCS, the
dashboard and its agents, the monitors and the driver are not, and killing the workers leaves the node up.

One module-scoped cluster: Ray takes ~15-30 s and several hundred MiB to start on a 2-core box.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner, read_start_ticks
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees, is_infrastructure
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.guard.killer import Killer
from tests.conftest import alive, descendants, require, wait_until

DRIVER = Path(__file__).resolve().parent / "helpers" / "ray_driver.py"
RULES = EngineRules.build()


@dataclass
class RayNode:
    driver: subprocess.Popen[str]
    actor: int
    task_worker: int

    def procs(self) -> dict[int, Proc]:
        mine = {self.driver.pid, *descendants(self.driver.pid)}
        return {p.pid: p for p in ProcScanner().scan().procs if p.pid in mine}

    def scope(self) -> Scope:
        return Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=self.driver.pid)

    def trees(self) -> list[EngineTree]:
        return find_engine_trees(ProcScanner().scan().procs, RULES, self.scope())


@pytest.fixture  # one cluster per test: one test kills the workers, and the order is random
def ray_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNode]:
    require(importlib.util.find_spec("ray") is not None, "ray is not installed (pip: the test dependency group)")
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",  # no token written under ~/.ray
        "RAY_TMPDIR": str(tmp_path_factory.mktemp("ray")),
    }
    driver = subprocess.Popen(
        [sys.executable, str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()  # Ray's own start-up bounds this; the driver exits on failure
        assert line, "the Ray driver exited before its cluster was up"
        info = json.loads(line)
        yield RayNode(driver, info["actor"], info["task_worker"])
    finally:
        _shut_down(driver)


def _shut_down(driver: subprocess.Popen[str]) -> None:
    """ray.shutdown() through the driver; then SIGKILL whatever it started that is still there (ours only)."""
    started = {pid: read_start_ticks("/proc", pid) for pid in [driver.pid, *descendants(driver.pid)]}
    try:
        if driver.stdin is not None:
            driver.stdin.write("exit\n")
            driver.stdin.close()
        driver.wait(60)
    except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
        pass
    for pid, ticks in started.items():
        if ticks is not None and read_start_ticks("/proc", pid) == ticks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        driver.wait(10)
    except subprocess.TimeoutExpired:
        pass
    if driver.stdout is not None:
        driver.stdout.close()


def _named(procs: dict[int, Proc], text: str) -> list[Proc]:
    return [p for p in procs.values() if p.comm == text or (p.argv and text in p.argv[0])]


def test_workers_and_actors_are_candidates_and_ray_itself_is_not(ray_node: RayNode) -> None:
    assert wait_until(
        lambda: any(
            p.argv and p.argv[0].startswith("ray::RayWorkerWrapper.execute_method") for p in ray_node.procs().values()
        ),
        60,  # a loaded 2-core box: Ray starts its worker and the actor retitles itself in its own time
    )
    procs = ray_node.procs()
    trees = ray_node.trees()
    roots = {t.root.pid: t.kind for t in trees}
    members = {pid for t in trees for pid in t.pids}
    assert roots.get(ray_node.actor) == "ray"  # ray::RayWorkerWrapper.execute_method
    assert roots.get(ray_node.task_worker) == "ray"  # ray::IDLE: a candidate (see docs/engines.md)
    infrastructure = [
        *_named(procs, "raylet"),
        *_named(procs, "gcs_server"),
        *_named(procs, "ray::DashboardAgent"),
        *_named(procs, "ray::RuntimeEnvAgent"),
    ]
    names = {p.comm for p in infrastructure}
    assert {"raylet", "gcs_server"} <= names, sorted(p.argv[0] for p in procs.values())
    assert any(p.argv[0].startswith("ray::DashboardAgent") for p in infrastructure)
    assert any(p.argv[0].startswith("ray::RuntimeEnvAgent") for p in infrastructure)
    # Ray's Python services (dashboard head, log monitor, autoscaler monitor) where this Ray starts them.
    services = [p for p in procs.values() if any("/ray/" in a and a.endswith(".py") for a in p.argv[:3])]
    for proc in [*infrastructure, *services]:
        assert is_infrastructure(proc, RULES), proc.argv[:3]
        assert proc.pid not in members, proc.argv[:3]
    assert ray_node.driver.pid not in members  # the user's driver script is no engine


def test_killing_the_workers_leaves_the_node_up(ray_node: RayNode) -> None:
    trees = ray_node.trees()
    assert trees, "no Ray worker to kill"
    procs = ray_node.procs()
    keep = [p for p in procs.values() if is_infrastructure(p, RULES)]
    assert keep
    victims, _signaled_at, _notes, _method = Killer(Path("/proc"), RULES, ray_node.scope()).kill(trees)
    assert {v.proc.pid for v in victims} >= {ray_node.actor}
    assert not {v.proc.pid for v in victims} & {p.pid for p in keep}
    for v in victims:
        os.close(v.pidfd)
    assert wait_until(lambda: not alive(ray_node.actor), 15)
    time.sleep(3)  # the raylet fate-shares with its agents: had one died, the raylet would follow within ~1 s
    for proc in keep:
        assert alive(proc.pid, proc.start_ticks), f"{proc.argv[:1]} died"
