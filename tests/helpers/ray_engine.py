"""A vLLM-shaped engine over a running Ray cluster, as vLLM's Ray executor shapes it (vllm/v1/executor/ray_*.py):

- `vllm serve` (this file, installed by the test as a `vllm` script and run as `python .../vllm serve MODEL ...`):
  the API server; it starts one child,
- `VLLM::EngineCore` (setproctitle, as vllm/utils/system_utils.py does): the Ray driver. It calls
  `ray.init(address=...)`, makes a STRICT_SPREAD placement group with one bundle per node, and starts one actor per
  bundle whose class is named `RayWorkerWrapper` (Ray titles the worker `ray::RayWorkerWrapper` and, while a method
  runs, `ray::RayWorkerWrapper.execute_method`). It prints one JSON line (the driver's pid, the placement group's
  id, each rank's pid and node id) and then blocks as vLLM's driver does in a collective whose peer is gone: it
  never notices a dead rank by itself.

Environment: RAY_ENGINE_ADDRESS (the GCS, host:port), RAY_ENGINE_NODE_IP (this node's address), RAY_ENGINE_NODES
(bundles, default 2), RAY_ENGINE_REMOTE_RANK_MIB (the ranks on other nodes than the driver's take this much memory,
touched, right after the JSON line: a rank over its node's budget). The test signals only the processes it started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def api_server() -> None:
    core = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine-core"])
    try:
        core.wait()  # vLLM's API server exits when its engine core dies; the test usually kills both first
    finally:
        sys.exit(1)


def engine_core() -> None:
    import ray
    import setproctitle
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    setproctitle.setproctitle("VLLM::EngineCore")
    nodes = int(os.environ.get("RAY_ENGINE_NODES", "2"))
    ray.init(
        address=os.environ["RAY_ENGINE_ADDRESS"],
        _node_ip_address=os.environ["RAY_ENGINE_NODE_IP"],
        logging_level=40,
        log_to_driver=False,
    )
    pg = placement_group([{"CPU": 1}] * nodes, strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)

    @ray.remote(num_cpus=1, max_restarts=0)
    class RayWorkerWrapper:
        def info(self) -> tuple[int, str]:
            return os.getpid(), ray.get_runtime_context().get_node_id()

        def hold(self, mib: int) -> int:
            self.held = bytearray(mib << 20)  # zero pages are not resident: touch one byte a page
            for i in range(0, len(self.held), 4096):
                self.held[i] = 1
            return len(self.held)

        def execute_method(self, seconds: float) -> int:
            time.sleep(seconds)
            return os.getpid()

    workers = [
        RayWorkerWrapper.options(  # type: ignore[attr-defined]
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(nodes)
    ]
    ranks = ray.get([w.info.remote() for w in workers], timeout=60)
    remote_mib = int(os.environ.get("RAY_ENGINE_REMOTE_RANK_MIB", "0"))
    here = ray.get_runtime_context().get_node_id()
    # not waited for: a rank killed for it (the test's budget) is a dead rank like any other
    held = [
        w.hold.remote(remote_mib) for w, (_pid, node) in zip(workers, ranks, strict=True) if remote_mib and node != here
    ]
    busy = [w.execute_method.remote(3600) for w in workers]
    print(
        json.dumps(
            {
                "driver": os.getpid(),
                "api": os.getppid(),
                "placement_group": pg.id.hex(),
                "ranks": [{"pid": pid, "node_id": node} for pid, node in ranks],
            }
        ),
        flush=True,
    )
    del busy, held
    while True:  # blocked, as a driver waiting on a collective whose peer died
        time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine-core"]:
        engine_core()
    else:
        api_server()
