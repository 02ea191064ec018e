"""A real Ray cluster (pip `ray`, loopback only) under the guard: only the allocating actor dies, Ray restarts it.

The test driver starts the local cluster itself, so the GCS, the raylet, its agents and every worker descend from
this test process and the guard (confined with ancestor_pid) may touch nothing else. The floor sits relative to the
MemAvailable left after Ray started; the actor allocates at most 1.5 GiB past it, in steps.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common.eventlog import read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.core.units import GiB, MiB
from tests.conftest import alive, require, wait_until
from tests.daemon import sparkwatch_run

HEADROOM_BYTES = int(1.5 * GiB)


@pytest.fixture
def ray_cluster() -> Iterator[Any]:
    require(importlib.util.find_spec("ray") is not None, "ray is not installed (pyproject's test group)")
    import ray

    # Ray's own memory monitor would kill workers on its own schedule (the field's advice: disable it); the object
    # store is kept small; no dashboard, no usage reporting; everything on loopback. This process's environment is put
    # back after: `ray.init` itself leaves RAY_AUTH_MODE=token and PYTHONBREAKPOINT in it (measured), and a later
    # test's Ray driver that inherits them has its ranks cancelled on a cluster without a token.
    saved = dict(os.environ)
    try:
        os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # noqa: SIM112 (Ray's own spelling)
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=80 * MiB,
            _node_ip_address="127.0.0.1",
            configure_logging=False,
            log_to_driver=False,
        )
        yield ray
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def raylet_pids() -> dict[int, int]:
    """pid -> start ticks of the raylets below this test process."""
    procs = ProcScanner().scan().procs
    by_pid = {p.pid: p for p in procs}
    out = {}
    for p in procs:
        if p.comm != "raylet":
            continue
        cur = p
        while cur is not None and cur.ppid > 1:
            if cur.ppid == os.getpid():
                out[p.pid] = p.start_ticks
                break
            cur = by_pid.get(cur.ppid)  # type: ignore[assignment]
    return out


@pytest.mark.pressure
def test_only_the_allocating_actor_dies_and_ray_restarts_it(ray_cluster: Any, tmp_path: Path) -> None:
    ray = ray_cluster

    @ray.remote(max_restarts=1, max_task_retries=0)
    class Allocator:
        def __init__(self) -> None:
            self.held: list[bytearray] = []

        def pid(self) -> int:
            return os.getpid()

        def allocate(self, limit_mib: int, rate_mib: float) -> int:
            start = time.monotonic()
            for i in range(limit_mib // 32):
                self.held.append(bytearray(b"\xa5" * (32 * MiB)))  # touched: real RSS
                ahead = (i + 1) * 32 / rate_mib - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
            return len(self.held)

    @ray.remote
    class Bystander:
        def pid(self) -> int:
            return os.getpid()

    actor = Allocator.remote()  # type: ignore[attr-defined]
    bystander = Bystander.remote()  # type: ignore[attr-defined]
    first_pid = ray.get(actor.pid.remote(), timeout=120)
    bystander_pid = ray.get(bystander.pid.remote(), timeout=120)
    raylets = raylet_pids()
    assert raylets, "the driver started no raylet"
    with MeminfoReader() as reader:
        available = reader.read().available_bytes
    if available < 5 * GiB:
        pytest.skip(f"only {available >> 20} MiB available after Ray started; this test wants 5 GiB")
    floor = available - HEADROOM_BYTES
    with sparkwatch_run(tmp_path, env={"SPARKWATCH_FLOOR": f"{floor}B"}) as daemon:
        time.sleep(2.5)  # the scout has seen every Ray process steady
        ref = actor.allocate.remote((HEADROOM_BYTES + GiB) // MiB, 512)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(ref, timeout=120)
        assert wait_until(lambda: any(e["kind"] == "kill" for e in read_events(daemon.events_path)), 30)
        kills = [e for e in read_events(daemon.events_path) if e["kind"] == "kill"]
        victims = {v["pid"] for k in kills for v in k["victims"]}
        assert first_pid in victims
        assert bystander_pid not in victims
        assert all(alive(pid, ticks) for pid, ticks in raylets.items()), "the raylet must survive"
        # Ray restarts the actor (max_restarts=1): a new process answers (unavailable while it restarts).
        second_pid = None
        deadline = time.monotonic() + 120
        while second_pid is None and time.monotonic() < deadline:
            try:
                second_pid = ray.get(actor.pid.remote(), timeout=120)
            except ray.exceptions.ActorUnavailableError:
                time.sleep(0.5)
            except ray.exceptions.RayActorError:
                pytest.fail("the restarted actor died too:\n" + "\n".join(daemon.stderr_lines))
        assert second_pid != first_pid
        assert ray.get(bystander.pid.remote(), timeout=60) == bystander_pid
        time.sleep(1.0)
        assert len([e for e in read_events(daemon.events_path) if e["kind"] == "kill"]) == 1
