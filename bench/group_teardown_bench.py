"""Group teardown over Ray (issue 29): how long node A takes to stop its half of an engine after the rank on node B
dies, and what watching Ray costs telemetry.

    .venv/bin/python bench/group_teardown_bench.py --runs 20 --idle-s 60 --out bench/RESULTS-group-teardown.md

The real two-node cluster of the tests (tests/raycluster.py: two network namespaces, `ray start --head` and
`--address`), a real `sparkwatch run` in node A's namespace, and the vLLM-shaped engine (`vllm serve` ->
`VLLM::EngineCore` as the Ray driver, a STRICT_SPREAD placement group, one `RayWorkerWrapper` per node).

Part 1, latency: each run starts the engine, SIGKILLs the rank on node B, and measures (CLOCK_MONOTONIC in this
process) until node A's API server, driver and rank are all gone, then waits for the placement group's REMOVED.

With `--pair` (issue 37) both nodes run an agent, each naming the other in `peers` under one `peer_key_file` (the
pair authenticated, as docs/multinode.md sets it up), node B reading the head's dashboard over the link: what it reads
there is display-only, and it acts on the state node A's agent relays in its proven document. The same death is
measured: A's agent reads Ray's state itself; B's agent serves and reads documents under the proof meanwhile.

Part 2, cost: with the engine running and nothing dying, the CPU time of telemetry's group-watch thread
(`sw-raywatch`, /proc/PID/task/TID/schedstat) over `--idle-s`, and telemetry's RSS against a daemon with
`ray_dashboard_url = ""` (the watch off) in the same conditions.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tables import publish  # noqa: E402

from tests.conftest import wait_until  # noqa: E402
from tests.daemon import free_port, sparkwatch_run  # noqa: E402
from tests.helpers.peerkey import key_env, key_file  # noqa: E402
from tests.raycluster import Engine, RayCluster, gone_within, pg_state, ray_cluster, sigkill  # noqa: E402


def telemetry_pid(guard_pid: int) -> int:
    for _ in range(100):
        for task in os.listdir(f"/proc/{guard_pid}/task"):
            try:
                children = Path(f"/proc/{guard_pid}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in children:
                if b"telemetry" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return int(child)
        time.sleep(0.1)
    raise RuntimeError("no telemetry process")


def thread_cpu_s(pid: int, comm: str) -> float | None:
    """CPU time of the thread named `comm`, from the scheduler's own nanosecond count (/proc/.../schedstat): utime
    and stime come in 10 ms ticks, charged to whichever thread runs at a tick."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() != comm:
                continue
            return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue
    return None


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size: shared library pages (libssl, libcrypto) divided among the processes that map them."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def removed(cluster: RayCluster, pg: str) -> bool:
    return pg_state(cluster, pg) == ["REMOVED"]


def latency_runs(cluster: RayCluster, tmp: Path, runs: int, pair: bool) -> list[tuple[str, float, float]]:
    """(which rank died, the other node's members gone after it, the placement group removed after it) per run."""
    out = []
    (tmp / "lat" / "b").mkdir(parents=True)
    listen_a, listen_b = f"{cluster.ip_a}:{free_port()}", f"{cluster.ip_b}:{free_port()}"
    key = key_env(key_file(tmp / "key"))
    env_a = {"SPARKWATCH_LISTEN": listen_a, "SPARKWATCH_PEERS": f'["{listen_b}"]', **key} if pair else {}
    env_b = {"SPARKWATCH_LISTEN": listen_b, "SPARKWATCH_PEERS": f'["{listen_a}"]', **key,
             "SPARKWATCH_RAY_DASHBOARD_URL": cluster.dashboard_b}  # fmt: skip
    with contextlib.ExitStack() as agents:
        agents.enter_context(sparkwatch_run(tmp / "lat", prefix=cluster.in_ns(cluster.ns_a, []), env=env_a))
        if pair:
            agents.enter_context(sparkwatch_run(tmp / "lat" / "b", prefix=cluster.in_ns(cluster.ns_b, []), env=env_b))
        for i in range(runs):
            engine = Engine(cluster, tmp / "lat", "a")
            dies, others = "rank_b", ["api", "driver", "rank_a"]
            try:
                died_at = time.monotonic()
                sigkill(*engine.keys[dies])
                took = gone_within([engine.keys[k] for k in others], died_at)
                assert wait_until(functools.partial(removed, cluster, engine.placement_group), 30, 0.1)
                pg_s = time.monotonic() - died_at
            finally:
                engine.close()
            print(f"run {i + 1}: {dies} killed, the others gone {took:.2f} s, placement group removed {pg_s:.2f} s",
                  file=sys.stderr)  # fmt: skip
            out.append((dies, took, pg_s))
    return out


def idle_cost(cluster: RayCluster, tmp: Path, idle_s: float, watch: bool) -> tuple[float | None, int, int]:
    env = {} if watch else {"SPARKWATCH_RAY_DASHBOARD_URL": ""}
    name = "on" if watch else "off"
    (tmp / name).mkdir(parents=True)
    with sparkwatch_run(tmp / name, env=env, prefix=cluster.in_ns(cluster.ns_a, [])) as daemon:
        engine = Engine(cluster, tmp / name, "a")
        try:
            tel = telemetry_pid(daemon.proc.pid)
            time.sleep(5)  # warm-up: the first polls, imports
            cpu0 = thread_cpu_s(tel, "sw-raywatch")
            time.sleep(idle_s)
            cpu1 = thread_cpu_s(tel, "sw-raywatch")
            share = (cpu1 - cpu0) / idle_s if cpu0 is not None and cpu1 is not None else None
            return share, rss_bytes(tel), pss_bytes(tel)
        finally:
            engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--idle-s", type=float, default=60)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--pair", action="store_true", help="both agents, each naming the other, authenticated")
    ap.add_argument("--no-cost", action="store_true", help="the latency runs only")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swgtb"))
    try:
        with ray_cluster() as cluster:
            runs = latency_runs(cluster, tmp, args.runs, args.pair)
            costs: dict[bool, list[tuple[float | None, int, int]]] = {True: [], False: []}
            for episode in range(0 if args.no_cost else 4):  # A B A B: these VMs are noisy
                watch = episode % 2 == 0
                costs[watch].append(idle_cost(cluster, tmp / str(episode), args.idle_s, watch=watch))
            start_s = cluster.start_s
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    from sparkwatch.config.defaults import STATIC

    poll_s = STATIC["ray_poll_s"]
    lines = [
        "# Group teardown over Ray: latency and cost",
        "",
        f"`{' '.join(['bench/group_teardown_bench.py', *sys.argv[1:]])}` on {platform.node()} "
        f"({os.cpu_count()} cores, {platform.release()}); cluster up in {start_s:.1f} s.",
        "",
        "The rank on node B SIGKILLed; node A's `sparkwatch run` stops the API server, the driver and A's rank."
        + (" With `--pair`: an agent on each node, each naming the other under one `peer_key_file`." if args.pair
           else ""),
        "",
        "| what | runs | median | worst |",
        "| --- | --- | --- | --- |",
    ]  # fmt: skip
    took = sorted(r[1] for r in runs)
    pg = sorted(r[2] for r in runs)
    lines += [
        f"| last of node A's members gone after the death | {len(took)} | {statistics.median(took):.2f} s "
        f"| {took[-1]:.2f} s |",
        f"| placement group REMOVED after the death | {len(pg)} | {statistics.median(pg):.2f} s | {pg[-1]:.2f} s |",
    ]
    if not args.no_cost:
        shares = [c[0] for c in costs[True] if c[0] is not None]
        share_on = statistics.median(shares) if shares else None
        rss_on, rss_off = (statistics.median(c[1] for c in costs[w]) for w in (True, False))
        pss_on, pss_off = (statistics.median(c[2] for c in costs[w]) for w in (True, False))
        lines += [
            "",
            f"Cost, an engine running and nothing dying, over {args.idle_s:.0f} s, episodes with and without the "
            "watch alternated A B A B (medians): the group watch's thread took "
            + (f"{share_on * 100:.3f} % of a core" if share_on is not None else "(thread not found)")
            + f" (ray_poll_s {poll_s:g} s); telemetry's RSS {rss_on / 2**20:.1f} MiB with the watch, "
            f"{rss_off / 2**20:.1f} MiB without ({(rss_on - rss_off) / 2**20:+.1f} MiB), PSS {pss_on / 2**20:.1f} "
            f"against {pss_off / 2**20:.1f} MiB ({(pss_on - pss_off) / 2**20:+.1f} MiB).",
        ]
    lines += ["", "Every run: " + ", ".join(f"{t:.2f}" for _d, t, _ in runs) + " s."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
