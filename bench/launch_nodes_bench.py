"""`sparkwatch launch --plan` for an engine across two nodes, whole process, on the real two-node Ray cluster.

    .venv/bin/python bench/launch_nodes_bench.py --rounds 15 --out bench/RESULTS-launch-nodes.md

The cluster is the tests' (tests/raycluster.py: two network namespaces joined by a veth pair, `ray start --head` in
A, `ray start --address` in B); node B runs its own agent (`sparkwatch run`, listening on B's address). On node A,
with B among its `peers`:
- A: `launch --plan --json -- vllm serve MODEL` (one node: the plan alone, the same config validated);
- B: `launch --plan --json -- vllm serve MODEL -tp 2 --distributed-executor-backend ray`: the plan, plus this node's
  raylets (/proc), B's agent (one GET: its raylets and its pool), Ray's state API for stale placement groups (the
  local dashboard), and B's share planned on B's pool.
Rounds alternate A B, then B A. MODEL is a sparse 157 GB checkpoint (one shard and a config.json). Wall time of the
whole process, interpreter start included; medians and the B / A ratio. Issue 30's target: B <= 500 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tables import publish  # noqa: E402

from tests.conftest import wait_until  # noqa: E402
from tests.daemon import daemon_env, free_port, sparkwatch_run  # noqa: E402
from tests.planbox import model_dir  # noqa: E402
from tests.raycluster import ray_cluster  # noqa: E402
from tests.test_launch_nodes import BIG_SHAPE  # noqa: E402

GB = 10**9


def once(argv: list[str], env: dict[str, str]) -> tuple[float, dict[str, object]]:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - started
    if done.returncode not in (0, 1):
        sys.exit(f"launch exited {done.returncode}: {done.stderr}")
    return took * 1000, json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sw-nodes-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = model_dir(tmp / "model", 157 * GB, BIG_SHAPE)
        (tmp / "b").mkdir()
        with ray_cluster() as cluster:
            cluster.wait_nodes()
            listen_b = f"{cluster.ip_b}:{free_port()}"
            env_b = {"SPARKWATCH_LISTEN": listen_b, "SPARKWATCH_RAY_DASHBOARD_URL": cluster.dashboard_b}
            with sparkwatch_run(tmp / "b", prefix=cluster.in_ns(cluster.ns_b, []), env=env_b):
                url = f"http://{listen_b}/peer/v1/state"
                if not wait_until(lambda: b'"memory":{' in cluster.get_in_a(url).stdout.encode(), 30, 0.5):
                    sys.exit("node B's agent never served its pool")
                env = {**daemon_env(tmp, free_port()), "SPARKWATCH_PEERS": json.dumps([listen_b])}
                base = [sys.executable, "-m", "sparkwatch", "launch", "--plan", "--json", "--", "vllm", "serve",
                        str(model), "--gpu-memory-utilization", "0.8"]  # fmt: skip
                commands = {"A": base, "B": [*base, "-tp", "2", "--distributed-executor-backend", "ray"]}
                times: dict[str, list[float]] = {"A": [], "B": []}
                docs: dict[str, dict[str, object]] = {}
                for name in ("A", "B"):  # warm the bytecode caches; not timed
                    once(cluster.in_ns(cluster.ns_a, commands[name]), env)
                for r in range(args.rounds):
                    for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                        ms, docs[name] = once(cluster.in_ns(cluster.ns_a, commands[name]), env)
                        times[name].append(ms)
                    print(f"round {r + 1}: A {times['A'][-1]:.0f} ms, B {times['B'][-1]:.0f} ms", file=sys.stderr)
    nodes = docs["B"]["nodes"]
    assert isinstance(nodes, list) and len(nodes) == 2, nodes
    sources = ", ".join(f"{n['node']} {n['role']} ({n['source']})" for n in nodes)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    load = os.getloadavg()
    out = [
        "# `launch --plan` across two nodes",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/launch_nodes_bench.py', *sys.argv[1:]])}`",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}: {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. The real two-node "
        f"Ray cluster of the tests; node B's own agent answering on B's address. {args.rounds} rounds, alternated "
        f"A B / B A; whole process, interpreter start included. B planned: {sources}.",
        "",
        "| command | median (ms) | min-max (ms) | target |",
        "| --- | ---: | ---: | --- |",
        f"| A: one node (`vllm serve MODEL`) | {a:.0f} | {min(times['A']):.0f}-{max(times['A']):.0f} | - |",
        f"| B: two nodes (`-tp 2` over Ray, B's agent read) | {b:.0f} | {min(times['B']):.0f}-{max(times['B']):.0f} "
        "| ≤ 500 ms |",
        "",
        f"B / A: {b / a:.2f}; B - A: {b - a:.0f} ms (this node's raylets, B's agent, Ray's state API, B's share).",
    ]
    publish(out, args.out)


if __name__ == "__main__":
    main()
