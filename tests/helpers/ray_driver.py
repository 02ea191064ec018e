"""A Ray driver as a user writes one: starts a local cluster on loopback, runs an actor shaped like vLLM's Ray
worker (RayWorkerWrapper) and a task (which leaves an idle worker, `ray::IDLE`), prints the pids as JSON, then waits
for a line on stdin and shuts Ray down.

Small on purpose: one CPU, an 80 MiB object store; the dashboard and its agents start as Ray starts them.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ray


def main() -> None:
    ray.init(num_cpus=1, object_store_memory=80 * 1024 * 1024, _node_ip_address="127.0.0.1")

    @ray.remote(num_cpus=0)
    class RayWorkerWrapper:
        def execute_method(self, seconds: float) -> int:
            time.sleep(seconds)
            return os.getpid()

        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    def task() -> int:
        return os.getpid()

    actor = RayWorkerWrapper.remote()  # type: ignore[attr-defined]
    actor_pid = ray.get(actor.pid.remote())
    task_pid = ray.get(task.remote())
    busy = actor.execute_method.remote(3600)  # titled ray::RayWorkerWrapper.execute_method while it runs
    print(json.dumps({"driver": os.getpid(), "actor": actor_pid, "task_worker": task_pid}), flush=True)
    sys.stdin.readline()
    del busy
    ray.shutdown()


if __name__ == "__main__":
    main()
