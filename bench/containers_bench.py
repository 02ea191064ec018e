"""What knowing containers costs: the guard's resolution of a tree's container, and telemetry's Docker client and
events stream when idle (issue 38's bench).

    .venv/bin/python bench/containers_bench.py --rounds 3 --seconds 60 [--sdk] --out bench/RESULTS-containers.md

Run as root (it starts the tests' own dockerd, tests/dockerd.py: its socket, data root and bridge; nothing of the
host's Docker is touched).

1. Resolution (pure, in this process): `core.containerid.container_of` over realistic cgroup paths, one per shape
   (a bare session, a launch scope, docker's systemd and cgroupfs shapes, containerd under kubepods, rootless
   podman), as `EngineTree.container` reads it; and what the guard's ranking (core.kill.policy.rank) pays per tree
   once telemetry has named containers (ContainerNotes: protect and priority matched by id) against none. Medians of
   `--repeat` timeit runs.
2. Telemetry idle, with and without the container watch, against the real dockerd holding one idle labelled
   container (a sleep: the watch holds its facts, the board sends it to the guard): `sparkwatch run` episodes
   alternate A B A B, A with DOCKER_HOST on the test daemon's socket, B with a DOCKER_HOST the watch refuses
   (tcp://: never started, no thread). Each settles 10 s, then `--seconds` are measured: the telemetry process's
   CPU (/proc/PID/stat ticks, 10 ms) and RSS (max of 1 s samples, and VmRSS at the end), and in A the container
   thread's own CPU from /proc/PID/task/TID/schedstat (nanoseconds). The board's `observe` (once per telemetry cycle
   on the loop's thread) is timed in process. Medians over the rounds.
3. The client's own memory: a fresh interpreter (PYTHONMALLOC=malloc, as telemetry runs) that already has h11
   imports, then lists, inspects one container and opens the events stream, with this client
   (telemetry.sources.dockerapi and the container watch) or, with `--sdk`, the `docker` SDK 7.2's APIClient,
   installed for the purpose in a throwaway venv (removed after). VmRSS after minus before, medians over `--repeat`
   alternated runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

import psutil
from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.core.container import ContainerFacts, ContainerNote, ContainerNotes  # noqa: E402
from sparkwatch.core.containerid import container_of  # noqa: E402
from sparkwatch.core.kill import policy  # noqa: E402
from sparkwatch.core.model import EngineTree, Proc  # noqa: E402
from sparkwatch.telemetry.containerboard import ContainerBoard  # noqa: E402
from tests import dockerd as dockerd_mod  # noqa: E402

MiB = 1 << 20
SETTLE_S = 10.0
SDK_VERSION = "7.2.0"
ID = "4f3e2d1c0b" * 6 + "a9b8"
assert len(ID) == 64
PATHS = {
    "bare session": "/user.slice/user-1000.slice/session-3.scope",
    "bare, long path": "/user.slice/user-1000.slice/user@1000.service/app.slice/app-org.gnome.Terminal.slice/"
    "vte-spawn-5c0e1a2b-3c4d-4e5f-8a9b-0c1d2e3f4a5b.scope",
    "launch scope": "/user.slice/user-1000.slice/user@1000.service/app.slice/sparkwatch-launch-ab12cd34.scope",
    "docker, systemd (DGX OS)": f"/system.slice/docker-{ID}.scope",
    "docker, cgroupfs": f"/docker/{ID}",
    "containerd, kubepods": "/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod0c5e1f2a_3b4c_4d5e_8f6a_7b8c9d0e1f2a.slice/cri-containerd-{ID}.scope",
    "podman, rootless": f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope",
}


# --- 1. resolution ----------------------------------------------------------------------------------------------


def tree(pid: int, cgroup: str) -> EngineTree:
    root = Proc(pid, 1, 0, "VLLM::EngineCor", "S", pid, 1 << 30, ("VLLM::EngineCore",), cgroup=cgroup)
    return EngineTree("vllm", root, (root,))


def per_call_us(fn: object, repeat: int, number: int) -> float:
    times = timeit.repeat(fn, repeat=repeat, number=number)  # type: ignore[arg-type]
    return statistics.median(times) / number * 1e6


def resolution(repeat: int) -> list[str]:
    out = ["| cgroup path shape | container_of, µs | EngineTree.container, µs |", "| --- | --- | --- |"]
    worst = 0.0
    for label, path in PATHS.items():
        t = tree(100, path)
        a = per_call_us(lambda p=path: container_of(p), repeat, 20_000)
        b = per_call_us(lambda t=t: t.container, repeat, 20_000)
        worst = max(worst, b)
        out.append(f"| {label} | {a:.2f} | {b:.2f} |")
    # The ranking, per tree: 8 trees of every shape, telemetry's notes for the 4 in containers against none.
    ids = [f"{i:02x}" * 32 for i in range(4)]
    bare = [PATHS["bare session"], PATHS["bare, long path"], PATHS["launch scope"], PATHS["bare session"]]
    trees = [tree(200 + i, f"/system.slice/docker-{cid}.scope") for i, cid in enumerate(ids)]
    trees += [tree(300 + i, path) for i, path in enumerate(bare)]
    notes = ContainerNotes.of(
        ContainerNote(cid, f"c{i}", "img", protect=i == 0, priority=i if i else None) for i, cid in enumerate(ids)
    )
    history = policy.GrowthHistory()
    params = policy.PolicyParams()
    without = per_call_us(lambda: policy.rank(trees, history, 0.0, None, params), repeat, 2_000)
    with_notes = per_call_us(lambda: policy.rank(trees, history, 0.0, None, params, containers=notes), repeat, 2_000)
    added = (with_notes - without) / len(trees)
    out += [
        "",
        f"The guard's ranking of {len(trees)} trees (4 in named containers, 4 bare): {without:.1f} µs without "
        f"telemetry's notes, {with_notes:.1f} µs with them: **{added:.2f} µs per tree added** (goal ≤ 5 µs). The "
        f"resolution alone is at most {worst:.2f} µs a tree; without notes the ranking and the budgets read no cgroup "
        "path at all, and a kill record resolves only the killed tree.",
    ]
    return out


# --- 2. telemetry idle, with and without the watch --------------------------------------------------------------


def schedstat_ns(pid: int, comm: str) -> int | None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == comm:
                return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def episode(docker_host: str, seconds: float, tmp: Path) -> dict[str, float]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        {
            "SPARKWATCH_STATE_DIR": str(tmp / "state"),
            "SPARKWATCH_LISTEN": f"127.0.0.1:{port}",
            "SPARKWATCH_ANCESTOR_PID": str(os.getpid()),  # confined: nothing under this bench is an engine
            "SPARKWATCH_POSTMORTEM": "false",
            "SPARKWATCH_KERNEL_LOG_PATH": str(tmp / "no-kmsg"),
            "XDG_CONFIG_HOME": str(tmp / "xdg"),
            "XDG_RUNTIME_DIR": str(tmp / "run"),
            "DOCKER_HOST": docker_host,
        }
    )
    daemon = subprocess.Popen(
        [sys.executable, "-m", "sparkwatch", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert daemon.stderr is not None
    err = daemon.stderr
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(x.decode(errors="replace") for x in err), daemon=True).start()
    try:
        guard = psutil.Process(daemon.pid)
        deadline = time.monotonic() + 60
        while not guard.children() and time.monotonic() < deadline:
            time.sleep(0.2)
        (telemetry,) = guard.children()
        time.sleep(SETTLE_S)
        cpu0 = sum(telemetry.cpu_times()[:2])
        thread0 = schedstat_ns(telemetry.pid, "sw-containers")
        t0 = time.monotonic()
        peak = 0
        while time.monotonic() < t0 + seconds:
            peak = max(peak, telemetry.memory_info().rss)
            time.sleep(1)
        wall = time.monotonic() - t0
        cpu = (sum(telemetry.cpu_times()[:2]) - cpu0) / wall * 100
        thread1 = schedstat_ns(telemetry.pid, "sw-containers")
        thread = None if thread0 is None or thread1 is None else (thread1 - thread0) / 1e9 / wall * 100
        rss_end = telemetry.memory_info().rss
        following = any("following the Docker API" in x for x in lines)
        return {
            "cpu_pct": cpu,
            "rss_max_mib": peak / MiB,
            "rss_end_mib": rss_end / MiB,
            "thread_pct": -1.0 if thread is None else thread,
            "following": float(following),
        }
    finally:
        daemon.terminate()
        daemon.wait(15)


def observe_cost(repeat: int, containers: int) -> float:
    """µs per ContainerBoard.observe with `containers` running (one engine's among them), nothing to send."""
    facts = [
        ContainerFacts(f"{i:064x}", f"c{i}", "img", "running", 100 + i, labels={"io.sparkwatch.budget": "60GiB"})
        for i in range(containers)
    ]
    trees = [tree(100, f"/system.slice/docker-{0:064x}.scope"), tree(101, PATHS["bare session"])]
    board = ContainerBoard(lambda m: True, resend_s=1e9)
    board.observe(trees, facts)
    return per_call_us(lambda: board.observe(trees, facts), repeat, 2_000)


def idle(rounds: int, seconds: float, repeat: int) -> list[str]:
    tmp = Path(tempfile.mkdtemp(prefix="sw-ctbench-"))
    daemon = dockerd_mod.start(tmp / "dockerd.log")
    name = "sw-bench-idle"
    try:
        args = dockerd_mod.run_args(daemon, name, "--label", "io.sparkwatch.budget=60GiB", src=False)
        daemon.docker(*args, "python3", "-c", "import time; time.sleep(86400)")
        a_host, b_host = daemon.host, "tcp://127.0.0.1:9"  # B: the watch refuses a tcp:// host, never starts
        results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for r in range(rounds):
            for which, host in (("A", a_host), ("B", b_host)):
                got = episode(host, seconds, tmp / f"{which}{r}")
                results[which].append(got)
                print(f"round {r + 1} {which}: {json.dumps({k: round(v, 3) for k, v in got.items()})}", file=sys.stderr)
        assert all(x["following"] for x in results["A"]), "episode A did not follow the test daemon"
    finally:
        daemon.remove(name)
        dockerd_mod.stop(daemon)
        shutil.rmtree(tmp, ignore_errors=True)

    def med(which: str, key: str) -> float:
        return statistics.median(x[key] for x in results[which])

    def span(which: str, key: str) -> str:
        values = [x[key] for x in results[which]]
        return f"{med(which, key):.3f} ({min(values):.3f}-{max(values):.3f})"

    obs1, obs20 = observe_cost(repeat, 1), observe_cost(repeat, 20)
    d_rss = med("A", "rss_end_mib") - med("B", "rss_end_mib")
    d_max = med("A", "rss_max_mib") - med("B", "rss_max_mib")
    d_cpu = med("A", "cpu_pct") - med("B", "cpu_pct")
    return [
        f"{rounds} rounds A B A B, {seconds:.0f} s measured per episode after {SETTLE_S:.0f} s to settle; medians "
        "(min-max):",
        "",
        "| telemetry process | A: watch on the test dockerd | B: no watch | A - B |",
        "| --- | --- | --- | --- |",
        f"| CPU % of one core | {span('A', 'cpu_pct')} | {span('B', 'cpu_pct')} | {d_cpu:+.3f} |",
        f"| max RSS MiB | {span('A', 'rss_max_mib')} | {span('B', 'rss_max_mib')} | {d_max:+.2f} |",
        f"| RSS MiB at the end | {span('A', 'rss_end_mib')} | {span('B', 'rss_end_mib')} | {d_rss:+.2f} |",
        f"| the container thread (sw-containers), CPU % | {span('A', 'thread_pct')} | - | |",
        "",
        f"The board's `observe`, once per telemetry cycle (1 s) on the loop's thread: {obs1:.1f} µs with 1 running "
        f"container, {obs20:.1f} µs with 20 (all labelled): {obs1 / 1e4:.4f} % and {obs20 / 1e4:.4f} % of a core. The "
        "process CPU is read in 10 ms ticks (0.017 % over 60 s): its A - B is noise at this size; the thread's own "
        "schedstat and the timed `observe` are the figures that resolve it. Goals: ≤ 3 MiB RSS, ≤ 0.02 % of a core.",
    ]


# --- 3. the client's memory: this one against the SDK ----------------------------------------------------------

PROBE_OURS = """
import json, os, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
import h11, sparkwatch.core.model, sparkwatch.common.logs  # telemetry has these already
sock, cid = sys.argv[1], sys.argv[2]
before = rss()
from sparkwatch.telemetry.containerwatch import ContainerWatch
from sparkwatch.telemetry.sources.dockerapi import DockerApi, DockerEvents
api = DockerApi(sock)
api.running_ids()
api.inspect(cid)
events = DockerEvents(sock)
events.open()
print(json.dumps({"delta": rss() - before}))
events.close()
"""

PROBE_SDK = """
import json, os, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
import h11  # telemetry has it already
sock, cid = sys.argv[1], sys.argv[2]
before = rss()
import docker
api = docker.APIClient(base_url="unix://" + sock)
api.containers()
api.inspect_container(cid)
events = api.events(decode=True, filters={"type": "container"})
print(json.dumps({"delta": rss() - before, "version": docker.__version__}))
"""


def client_rss(repeat: int, sdk: bool) -> list[str]:
    tmp = Path(tempfile.mkdtemp(prefix="sw-ctbench-sdk-"))
    daemon = dockerd_mod.start(tmp / "dockerd.log")
    name = "sw-bench-client"
    venv = tmp / "sdk-venv"
    try:
        cid = daemon.docker(
            *dockerd_mod.run_args(daemon, name, src=False), "python3", "-c", "import time; time.sleep(86400)"
        ).stdout.strip()
        env = {**os.environ, "PYTHONMALLOC": "malloc"}
        runs: dict[str, list[float]] = {"ours": []}
        version = ""
        if sdk:
            runs["sdk"] = []
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            subprocess.run([*pip, f"docker=={SDK_VERSION}", "h11"], check=True)
        for _ in range(repeat):
            for which, values in runs.items():
                ours = which == "ours"
                python, code = (sys.executable, PROBE_OURS) if ours else (str(venv / "bin" / "python"), PROBE_SDK)
                done = subprocess.run(
                    [python, "-c", code, str(daemon.socket), cid],
                    env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
                )  # fmt: skip
                got = json.loads(done.stdout)
                values.append(got["delta"] / MiB)
                version = got.get("version", version)
    finally:
        daemon.remove(name)
        dockerd_mod.stop(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    out = [
        "| client (list, inspect one, open the events stream) | RSS added, MiB: median (min-max) |",
        "| --- | --- |",
    ]
    for which, values in runs.items():
        label = (
            "telemetry.sources.dockerapi + containerwatch (h11, here already)"
            if which == "ours"
            else (f"docker SDK {version or SDK_VERSION} APIClient (requests, urllib3, ...)")
        )
        out.append(f"| {label} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) |")
    if not sdk:
        out.append("")
        out.append("The SDK's row needs `--sdk` (it installs docker in a throwaway venv, removed after).")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument(
        "--sdk", action="store_true", help=f"also measure the docker SDK {SDK_VERSION} (pip, throwaway venv)"
    )
    ap.add_argument("--skip-idle", action="store_true", help="only the pure resolution and the client's memory")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root: the bench starts its own dockerd (tests/dockerd.py)", file=sys.stderr)
        return 2
    cmd = " ".join(["python", "bench/containers_bench.py", *sys.argv[1:]])
    mem = psutil.virtual_memory().total / (1 << 30)
    head = [
        "# Containers: what naming them costs the guard and telemetry",
        "",
        f"Command: `{cmd}` (as uid 0), commit {git_head()}",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {mem:.1f} GiB, kernel {platform.release()}; "
        f"Python {platform.python_version()}; dockerd {docker_version()} (tests/dockerd.py's own)",
        "",
        "## 1. Resolving a tree's container (core.containerid), in the guard",
        "",
    ]
    body = resolution(args.repeat)
    body += ["", "## 2. Telemetry idle, with and without the container watch", ""]
    body += ["Skipped (--skip-idle)."] if args.skip_idle else idle(args.rounds, args.seconds, args.repeat)
    body += ["", "## 3. The Docker client's memory: this client against the docker SDK", ""]
    body += client_rss(args.repeat, args.sdk)
    publish(head + body, args.out)
    return 0


def git_head() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "sparkwatch")
    return git("rev-parse", "--short", "HEAD") + (" (+ uncommitted changes)" if dirty else "")


def docker_version() -> str:
    done = subprocess.run(["dockerd", "--version"], capture_output=True, text=True)
    return done.stdout.strip().removeprefix("Docker version ").split(",")[0] or "?"


if __name__ == "__main__":
    sys.exit(main())
