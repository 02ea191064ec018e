"""Kill-path benchmark: how long Killer.kill() takes, pin -> last SIGKILL, on a real engine-shaped tree.

Three variants, episodes alternated A B C A B C:
- A: this tree's killer, the engine started by this process (every member is SIGSTOPped, then swept, then killed);
- B: the same engine typed at the prompt of an interactive `bash -i` on a pseudo-terminal: its root leads a terminal
     job, so it gets SIGKILL only (guard/killer.py, step 4) and its shell says Killed, not Stopped;
- C: the killer of another git revision (`--against`, default main) on A's tree: what the change costs.

The tree: a fake EngineCore (tests/helpers/fake_engine.py) with 8 workers and a ninja -> nvcc -> cicc chain
(12 processes). Reported: medians of kill() wall time and of pin -> last SIGKILL, and the ratios.

    flock /tmp/sparkwatch-pressure.lock .venv/bin/python bench/kill_path_bench.py --episodes 15 \
        --out bench/RESULTS-kill-path.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.sources.procs import ProcScanner  # noqa: E402
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees  # noqa: E402
from sparkwatch.core.model import EngineTree  # noqa: E402
from sparkwatch.guard import killer as this_killer  # noqa: E402
from tests.conftest import FAKE_ENGINE, Spawner, wait_until  # noqa: E402

RULES = EngineRules.build()
WORKERS = 8
MEMBERS = 1 + WORKERS + 3
ENGINE_ARGS = [
    "--title",
    "VLLM::EngineCore",
    *(a for i in range(WORKERS) for a in ("--worker", f"VLLM::Worker_TP{i}")),
    "--compiler",
]


def other_killer(rev: str) -> ModuleType:
    """guard/killer.py as it is at `rev`, loaded beside this tree's (it imports the rest of this tree's package)."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:sparkwatch/guard/killer.py"], check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "killer_at_rev.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("killer_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def tree_below(ancestor: int) -> EngineTree:
    scope = Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=ancestor)
    found: list[EngineTree] = []

    def ready() -> bool:
        nonlocal found
        found = find_engine_trees(ProcScanner().scan().procs, RULES, scope)
        return len(found) == 1 and len(found[0].members) == MEMBERS

    assert wait_until(ready, 30), "the engine tree did not start"
    return found[0]


def start_plain(spawner: Spawner, pidfile: Path) -> EngineTree:
    proc = spawner.popen([sys.executable, str(FAKE_ENGINE), *ENGINE_ARGS, "--pidfile", str(pidfile)])
    return tree_below(proc.pid)


def start_in_terminal(spawner: Spawner, pidfile: Path) -> tuple[EngineTree, int]:
    master, slave = os.openpty()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PS1": "$ ", "TERM": "dumb", "HISTFILE": "/dev/null"}
    shell = spawner.popen(
        ["setsid", "-c", "bash", "--norc", "--noprofile", "-i"], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    time.sleep(0.3)
    os.write(master, f"{sys.executable} {FAKE_ENGINE} {' '.join(ENGINE_ARGS)} --pidfile {pidfile}\n".encode())
    return tree_below(shell.pid), master


def episode(variant: str, killer_module: ModuleType, tmp: Path) -> tuple[float, int]:
    spawner = Spawner()
    master = -1
    try:
        pidfile = tmp / f"{variant}-{time.monotonic_ns()}.pids"
        if variant == "B":
            tree, master = start_in_terminal(spawner, pidfile)
        else:
            tree = start_plain(spawner, pidfile)
        k = killer_module.Killer(Path("/proc"), RULES, Scope(self_pid=os.getpid(), own_uid=os.geteuid()))
        t0 = time.perf_counter()
        victims, _signaled, _notes, _method = k.kill([tree])
        elapsed = time.perf_counter() - t0
        for v in victims:
            os.close(v.pidfd)
        return elapsed * 1000, len(victims)
    finally:
        spawner.cleanup()
        if master >= 0:
            os.close(master)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=15)
    ap.add_argument("--against", default="main", help="git revision whose killer is variant C")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    modules = {"A": this_killer, "B": this_killer, "C": other_killer(args.against)}
    times: dict[str, list[float]] = {"A": [], "B": [], "C": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.episodes):
            for variant in "ABC":
                ms, count = episode(variant, modules[variant], Path(tmp))
                assert count == MEMBERS, (variant, count)
                times[variant].append(ms)
            print(f"episode {n + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f} ms" for v in "ABC"), flush=True)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    lines = [
        "# Kill-path benchmark",
        "",
        f"Command: `flock /tmp/sparkwatch-pressure.lock .venv/bin/python bench/kill_path_bench.py --episodes "
        f"{args.episodes} --against {args.against} --out bench/RESULTS-kill-path.md`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, shared with other jobs; date "
        f"{time.strftime('%Y-%m-%d')}. Medians over {args.episodes} episodes per variant, A B C A B C.",
        "",
        f"Killer.kill() wall time (pin, stop, sweep, cgroup check, SIGKILL) on a {MEMBERS}-process engine tree.",
        "A: this tree's killer, engine started by the benchmark; B: this tree's killer, the engine a foreground job of",
        f"`bash -i` on a pty (its root gets SIGKILL only); C: the killer at `{args.against}`, as A.",
        "",
        "| variant | median (ms) | min (ms) | max (ms) | / C |",
        "| --- | --- | --- | --- | --- |",
    ]
    for v in "ABC":
        ts = times[v]
        lines.append(f"| {v} | {med[v]:.2f} | {min(ts):.2f} | {max(ts):.2f} | {med[v] / med['C']:.2f} |")
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
