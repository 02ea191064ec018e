"""Identity benchmark: what recognising engines and unforgeable protection cost on a 2,000-process /proc.

N real sleeping processes (`sleep`, killed by pid at the end), plus a small real engine tree. Episodes alternate
A B C A B C:
- A: the scanner without the protection facts (exe and cgroup reads switched off: what the scan cost before);
- B: exe and cgroup, without the namespace check (what the scan cost before the namespace check);
- C: the scanner as shipped (readlink /proc/PID/exe and a read of /proc/PID/cgroup per new process, and for the
  processes whose exe would protect them a stat of /proc/PID/ns/user and ns/mnt, all cached per process for one
  program image and title).
Per episode, CPU time (process_time) of: a cold full scan (new scanner), a warm full scan (median of 5), and
find_engine_trees over that table with cold rules (empty identity cache) and warm rules (median of 5).

    flock /tmp/sparkwatch-pressure.lock .venv/bin/python bench/identity_bench.py --procs 2000 --episodes 4 \
        --protected 40 --out bench/RESULTS-identity.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.sources import procs as procs_mod  # noqa: E402
from sparkwatch.common.sources.procs import ProcScanner  # noqa: E402
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees  # noqa: E402


def cpu_of(fn: Callable[[], object]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def ms(s: float) -> str:
    return f"{s * 1000:.1f}"


def episode(with_facts: bool, with_namespaces: bool = True) -> dict[str, float]:
    real_exe, real_cgroup, real_ns = procs_mod._read_exe, procs_mod._read_cgroup, procs_mod.outside_namespaces
    looked = [0]

    def counted(base: str, initial: tuple[int, int | None]) -> bool:
        looked[0] += 1
        return real_ns(base, initial)

    procs_mod.outside_namespaces = counted if with_namespaces else (lambda base, initial: False)
    if not with_facts:
        procs_mod._read_exe = lambda base: None
        procs_mod._read_cgroup = lambda base: None
    try:
        scanner = ProcScanner()
        cold_scan = cpu_of(scanner.scan)
        warm_scan = statistics.median(cpu_of(scanner.scan) for _ in range(5))
        table = scanner.scan().procs
        scope = Scope(self_pid=os.getpid(), own_uid=os.geteuid())
        rules = EngineRules.build()
        cold_trees = cpu_of(lambda: find_engine_trees(table, rules, scope))
        warm_trees = statistics.median(cpu_of(lambda: find_engine_trees(table, rules, scope)) for _ in range(5))
        trees = find_engine_trees(table, rules, scope)
    finally:
        procs_mod._read_exe, procs_mod._read_cgroup = real_exe, real_cgroup
        procs_mod.outside_namespaces = real_ns
    return {
        "procs": len(table),
        "ns_looked": looked[0],  # processes whose namespaces were read (once each: cached with the rest)
        "trees": len(trees),
        "cold_scan": cold_scan,
        "warm_scan": warm_scan,
        "cold_trees": cold_trees,
        "warm_trees": warm_trees,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=2000)
    ap.add_argument("--episodes", type=int, default=4, help="per variant; alternated A B A B")
    ap.add_argument(
        "--protected",
        type=int,
        default=40,
        help="tmux servers to start: processes whose exe would protect them (sshd, systemd, tmux… on a real box)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    sleep = shutil.which("sleep") or "/bin/sleep"
    tmux = shutil.which("tmux")
    sockets = [f"sw-identity-{os.getpid()}-{i}" for i in range(args.protected if tmux else 0)]
    for name in sockets:  # each a tmux server (exe /usr/bin/tmux) with one sleep below it
        subprocess.run([str(tmux), "-L", name, "-f", "/dev/null", "new-session", "-d", f"{sleep} 600"], check=True)
    before = len([d for d in os.listdir("/proc") if d.isdigit()])
    sleepers = [
        subprocess.Popen([sleep, "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        for _ in range(max(0, args.procs - before))
    ]
    engine = subprocess.Popen(
        [sys.executable, "-c", "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); "
         "import subprocess; subprocess.Popen(['sleep', '600']); time.sleep(600)"]
    )  # fmt: skip
    time.sleep(1.0)
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": [], "C": []}
    try:
        for _ in range(args.episodes):
            results["A"].append(episode(False))
            results["B"].append(episode(True, with_namespaces=False))
            results["C"].append(episode(True))
    finally:
        for name in sockets:
            subprocess.run([str(tmux), "-L", name, "kill-server"], check=False)
        for p in [*sleepers, engine]:
            p.kill()
        for p in [*sleepers, engine]:
            p.wait()

    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[variant])

    n = int(med("C", "procs"))
    rows = [
        ("cold full scan (new scanner), CPU", "cold_scan"),
        ("warm full scan (caches hot), CPU", "warm_scan"),
        ("find_engine_trees, empty identity cache, CPU", "cold_trees"),
        ("find_engine_trees, warm identity cache, CPU", "warm_trees"),
    ]
    lines = [
        "# Identity benchmark",
        "",
        "Command: `flock /tmp/sparkwatch-pressure.lock .venv/bin/python bench/identity_bench.py --procs "
        f"{args.procs} --episodes {args.episodes} --protected {args.protected}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, shared with other jobs; {n} processes on /proc, "
        f"{int(med('C', 'trees'))} engine tree(s). Medians over {args.episodes} episodes per variant, A B C A B C.",
        "",
        "A: scan without the protection facts (exe, cgroup); B: exe and cgroup, no namespace check; C: as shipped "
        f"(the namespaces of the {int(med('C', 'ns_looked'))} processes whose exe would protect them are read too).",
        "",
        "| measure | A (ms) | B (ms) | C (ms) | B / A | C / B |",
        "| --- | --- | --- | --- | --- | --- |",
    ]

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}" if y else "-"

    for label, key in rows:
        a, b, c = med("A", key), med("B", key), med("C", key)
        lines.append(f"| {label} | {ms(a)} | {ms(b)} | {ms(c)} | {ratio(b, a)} | {ratio(c, b)} |")
    text = "\n".join(lines) + "\n"
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
