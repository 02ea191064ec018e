"""A GPU runaway that grows in one step: how far past its budget it gets and how soon after the step it dies.

    python3 bench/gpu_runaway_bench.py --arm main=/path/to/main/tree --arm branch=. --episodes 3 \
        --out bench/RESULTS-gpu-runaway.md

Needs a CUDA GPU, torch, nvidia-ml-py and the project's dependencies (wheels where the machine lacks them). Each
episode starts a real `sparkwatch run` from one arm's source tree (`python -m sparkwatch` with that tree first on
PYTHONPATH, so the guard and its telemetry process both run that tree's code), confined to this script's processes
(`ancestor_pid`), with a config budget (`engine_budgets`, 6 GiB by default) for one engine process shaped like vLLM's:
titled `VLLM::EngineCore_gpu-runaway` (setproctitle, as vLLM does; where it is missing, a config engine pattern
matches the argv). The engine allocates device memory (torch.empty on cuda, touched) until its footprint as the
guard counts it (its RSS + NVML's bytes for its pid) is `--near` of the budget (85 %: at or above the 80 % that asks
for fast sampling), holds it `--settle-s` (the guard sees it near and tells telemetry), then takes `--step-gib` (10 GiB)
in one allocation. The script waits for the engine's death (its child: Popen.wait on a thread) and reads the guard's
kill event. Arms alternate A B A B; medians per arm.

Columns: the latency runs from the start of the step (before the allocation) and from its end (the allocation
returned, touched and synchronised) to the engine's death as this script's wait saw it; `GPU bytes at the kill` is
the event's victim_gpu_bytes (what the guard counted), `footprint` its footprint_bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tables import publish

GiB = 1 << 30
MiB = 1 << 20
TITLE = "VLLM::EngineCore_gpu-runaway"


def own_footprint_bytes() -> int:
    """RSS + NVML's bytes for this pid: what the guard's budget counts for a one-process tree."""
    import pynvml

    with open("/proc/self/statm", "rb") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    used = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                used += int(p.usedGpuMemory)
    return rss + used


def engine(budget_bytes: int, near: float, settle_s: float, step_gib: float, progress: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(TITLE)
    except ImportError:
        pass  # the config's engine pattern matches this script's argv instead
    import pynvml
    import torch  # type: ignore[import-not-found,unused-ignore]

    pynvml.nvmlInit()
    torch.cuda.init()
    keep = [torch.ones(1, device="cuda")]  # the CUDA context
    torch.cuda.synchronize()
    target = int(near * budget_bytes)
    while (have := own_footprint_bytes()) < target - 64 * MiB:
        t = torch.empty(target - have, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()
        keep.append(t)
    with open(progress, "w", encoding="ascii") as out:
        out.write(f"ready {time.monotonic():.6f} {own_footprint_bytes()}\n")
        out.flush()
        time.sleep(settle_s)
        out.write(f"step {time.monotonic():.6f}\n")
        out.flush()
        t = torch.empty(int(step_gib * GiB), dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()
        keep.append(t)
        out.write(f"stepped {time.monotonic():.6f}\n")
        out.flush()
        time.sleep(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def episode(tree: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    state = tmp / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        SPARKWATCH_ANCESTOR_PID=str(os.getpid()),
        SPARKWATCH_STATE_DIR=str(state),
        SPARKWATCH_LISTEN=f"127.0.0.1:{free_port()}",
        SPARKWATCH_FLOOR="1GiB",
        SPARKWATCH_ENGINE_PATTERNS=json.dumps([r"gpurunaway=gpu_runaway_bench\.py engine"]),
        SPARKWATCH_ENGINE_BUDGETS=json.dumps([f"{args.budget_mib}MiB=gpu.runaway"]),
        SPARKWATCH_KERNEL_LOG_PATH=str(tmp / "no-kmsg"),
        SPARKWATCH_JIT_CACHE_DIRS=json.dumps([str(tmp / "no-jit")]),
        XDG_RUNTIME_DIR=str(tmp),
        XDG_CONFIG_HOME=str(tmp / "xdg"),
        PYTHONPATH=os.pathsep.join([str(tree.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PYTHONUNBUFFERED="1",
    )
    lines: list[str] = []
    daemon = subprocess.Popen([sys.executable, "-m", "sparkwatch", "run"], env=env, cwd=tree,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    ready = threading.Event()

    def read() -> None:
        assert daemon.stderr is not None
        for line in daemon.stderr:
            lines.append(line.rstrip())
            if "telemetry running" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    progress = tmp / "progress"
    try:
        if not ready.wait(90):
            raise SystemExit("sparkwatch run did not start:\n" + "\n".join(lines[-30:]))
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "engine", "--budget-mib", str(args.budget_mib),
             "--near", str(args.near), "--settle-s", str(args.settle_s), "--step-gib", str(args.step_gib),
             str(progress)],
            env={k: v for k, v in env.items() if not k.startswith("SPARKWATCH_")},
        )  # fmt: skip
        died: list[float] = []

        def wait() -> None:
            proc.wait()
            died.append(time.monotonic())

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(args.settle_s + 90)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        marks = {x.split()[0]: x.split()[1:] for x in progress.read_text().splitlines()} if progress.exists() else {}
        kill: dict[str, Any] | None = None
        deadline = time.monotonic() + 10
        while kill is None and time.monotonic() < deadline:  # the event is written after the reap and settle
            path = state / "events.jsonl"
            events = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
            kill = next((e for e in events if e["kind"] == "kill"), None)
            time.sleep(0.2)
        reaped_ms = (kill or {}).get("signal_to_reaped_ms")
        stepped = float(marks["stepped"][0]) if "stepped" in marks else None
        step = float(marks["step"][0]) if "step" in marks else None
        return {
            "near_bytes": int(marks["ready"][1]) if "ready" in marks else None,
            "step_s": None if step is None or stepped is None else stepped - step,
            "latency_s": None if step is None or not died else died[0] - step,
            "after_end_s": None if stepped is None or not died else died[0] - stepped,
            "returncode": proc.returncode,
            "trigger": kill.get("trigger") if kill else None,
            "gpu_bytes": kill.get("victim_gpu_bytes") if kill else None,
            "footprint_bytes": kill.get("footprint_bytes") if kill else None,
            "source": kill.get("footprint_source") if kill else None,
            "signal_to_reaped_s": None if reaped_ms is None else reaped_ms / 1000,
        }
    finally:
        daemon.terminate()
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f}"


def to_signal(r: dict[str, Any]) -> float | None:
    """Step start -> the guard's SIGKILL: the death this script saw, less the guard's own signal -> reaped time (a
    process holding 15 GiB of device memory takes a while to be torn down by the driver)."""
    if r["latency_s"] is None or r["signal_to_reaped_s"] is None:
        return None
    return float(r["latency_s"]) - float(r["signal_to_reaped_s"])


def med(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        ap = argparse.ArgumentParser()
        ap.add_argument("cmd")
        ap.add_argument("--budget-mib", type=int, required=True)
        ap.add_argument("--near", type=float, required=True)
        ap.add_argument("--settle-s", type=float, required=True)
        ap.add_argument("--step-gib", type=float, required=True)
        ap.add_argument("progress")
        a = ap.parse_args()
        engine(a.budget_mib * MiB, a.near, a.settle_s, a.step_gib, a.progress)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=TREE", help="a source tree to run")
    ap.add_argument("--episodes", type=int, default=3, help="per arm, alternated A B A B")
    ap.add_argument("--budget-mib", type=int, default=6 * 1024)
    ap.add_argument("--near", type=float, default=0.85)
    ap.add_argument("--settle-s", type=float, default=8.0)
    ap.add_argument("--step-gib", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    arms = [(name, Path(tree)) for name, tree in (a.split("=", 1) for a in args.arm)]
    rows: list[tuple[str, int, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="sw-gpu-runaway-") as tmp_s:
        for i in range(args.episodes):
            for name, tree in arms:
                tmp = Path(tmp_s) / f"{name}-{i}"
                tmp.mkdir()
                got = episode(tree, tmp, args)
                rows.append((name, i + 1, got))
                print(f"{name} #{i + 1}: {got}", flush=True)
    import torch  # type: ignore[import-not-found,unused-ignore]

    cmd = "python3 bench/gpu_runaway_bench.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{cmd}`",
        "",
        f"Machine: {torch.cuda.get_device_name(0)}, {platform.machine()}, {os.cpu_count()} cores, kernel "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}. Budget "
        f"{args.budget_mib} MiB (config), held at {args.near:.0%} for {args.settle_s:g} s, then one step of "
        f"{args.step_gib:g} GiB.",
        "",
        "| arm | episode | footprint before the step GiB | step took ms | step start -> death ms "
        "| step end -> death ms | signal -> reaped ms (guard) | step start -> signal ms | trigger "
        "| GPU bytes at the kill GiB | footprint at the kill GiB (source) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, i, r in rows:
        lines.append(
            f"| {name} | {i} | {gib(r['near_bytes'])} | {ms(r['step_s'])} | {ms(r['latency_s'])} "
            f"| {ms(r['after_end_s'])} | {ms(r['signal_to_reaped_s'])} | {ms(to_signal(r))} | {r['trigger']} "
            f"| {gib(r['gpu_bytes'])} | {gib(r['footprint_bytes'])} ({r['source']}) |"
        )
    lines += ["", "Medians per arm:", "", "| arm | step start -> signal ms | step start -> death ms "
              "| step end -> death ms | GPU bytes at the kill GiB | killed on budget |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, _tree in arms:
        mine = [r for n, _i, r in rows if n == name]
        budget_kills = sum(1 for r in mine if r["trigger"] == "budget")
        lines.append(
            f"| {name} | {ms(med([to_signal(r) for r in mine]))} | {ms(med([r['latency_s'] for r in mine]))} "
            f"| {ms(med([r['after_end_s'] for r in mine]))} "
            f"| {gib(med([r['gpu_bytes'] for r in mine]))} | {budget_kills} of {len(mine)} |"
        )
    publish(lines, args.out)


if __name__ == "__main__":
    main()
