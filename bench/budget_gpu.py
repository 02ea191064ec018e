"""Budgets on a real GPU: a budget counts GPU and pinned host memory, and a tree that allocates past it is killed on
the `budget` trigger. Self-contained: needs torch, nvidia-ml-py and the project (and the project's own dependencies:
pydantic, pydantic-settings, prometheus-client, rich, as wheels where the machine lacks them).

    python3 bench/budget_gpu.py --out bench/RESULTS-budget-gpu.md

It starts a real `sparkwatch run` (guard and telemetry: telemetry reads NVML's per-process bytes every second and
sends them to the guard, which counts them in a budgeted tree's footprint), confined to this script's own processes
(`ancestor_pid`), and runs, one after the other:

1. gpu: a process that allocates device memory (cudaMalloc through torch) 1 GiB at a time, twice a second, toward
   16 GiB, under an 8 GiB config budget (`engine_budgets`): it must die on trigger `budget` near 8 GiB, although its
   RSS stays small: the GPU bytes are what count;
2. pinned: the same with pinned host memory (`torch.empty(pin_memory=True)`, cudaHostAlloc): it must die near 8 GiB;
   the table shows whether NVML also counts pinned memory for the pid (RSS + NVML would then count it twice);
3. under: a process holding 4 GiB of device memory under an 8 GiB budget for 20 s: never touched;
4. launch: `sparkwatch launch --budget 6GiB -- python3 bench/budget_gpu.py hog gpu …`: the launched tree dies on its
   declared budget and launch prints the guard's line and exits 137.

Prints a table (and writes it with --out). `--scale 0.25` shrinks every size (budgets, steps, limits) for a small box;
the orchestration was checked that way on a CPU box with a stand-in for torch's allocations (the GPU facts need the
GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tables import publish

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
MiB = 1 << 20


def hog(kind: str, step_gib: float, limit_gib: float, *, every_s: float, hold_s: float, progress: str) -> None:
    """Allocate `kind` memory (gpu | pinned) step by step, writing 'monotonic allocated_bytes' after each step."""
    import torch  # type: ignore[import-not-found,unused-ignore]

    torch.cuda.init()
    keep = []
    done = 0
    step = int(step_gib * GiB)
    with open(progress, "w", encoding="ascii") as out:
        out.write(f"{time.monotonic():.6f} 0\n")
        out.flush()
        while done + step <= limit_gib * GiB:
            if kind == "gpu":
                t = torch.empty(step, dtype=torch.uint8, device="cuda")
                t.fill_(1)
                torch.cuda.synchronize()
            else:
                t = torch.empty(step, dtype=torch.uint8, pin_memory=True)
                t.fill_(1)
            keep.append(t)
            done += step
            out.write(f"{time.monotonic():.6f} {done}\n")
            out.flush()
            time.sleep(every_s)
    time.sleep(hold_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(self, tmp: Path, budgets: list[str]) -> None:
        self.state = tmp / "state"
        self.run_dir = tmp / "run"
        self.run_dir.mkdir(exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
        self.env.update(
            SPARKWATCH_ANCESTOR_PID=str(os.getpid()),
            SPARKWATCH_STATE_DIR=str(self.state),
            SPARKWATCH_LISTEN=f"127.0.0.1:{free_port()}",
            SPARKWATCH_FLOOR="1GiB",
            SPARKWATCH_ENGINE_PATTERNS=json.dumps([r"gpuhog=budget_gpu\.py hog"]),
            SPARKWATCH_ENGINE_BUDGETS=json.dumps(budgets),
            SPARKWATCH_KERNEL_LOG_PATH=str(tmp / "no-kmsg"),
            SPARKWATCH_JIT_CACHE_DIRS=json.dumps([str(tmp / "no-jit")]),
            XDG_RUNTIME_DIR=str(self.run_dir),
            XDG_CONFIG_HOME=str(tmp / "xdg"),
            PYTHONUNBUFFERED="1",
        )
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sparkwatch", "run"], env=self.env, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                if "telemetry running" in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(90):
            self.stop()
            raise SystemExit("sparkwatch run did not start:\n" + "\n".join(self.lines[-30:]))

    def events(self) -> list[dict[str, Any]]:
        path = self.state / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def nvml_used(pid: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        total = None
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                for p in fn(h):
                    if p.pid == pid and p.usedGpuMemory is not None:
                        total = (total or 0) + int(p.usedGpuMemory)
        return total
    except Exception:
        return None


def rss_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def run_case(daemon: Daemon, tmp: Path, name: str, argv: list[str], wait_s: float) -> dict[str, Any]:
    progress = tmp / f"progress-{name}"
    kills_before = sum(1 for e in daemon.events() if e["kind"] == "kill")
    proc = subprocess.Popen([*argv, str(progress)], cwd=ROOT, env=daemon.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    seen: dict[str, int | None] = {"rss": None, "nvml": None}
    deadline = time.monotonic() + wait_s
    while proc.poll() is None and time.monotonic() < deadline:
        target = proc.pid if name != "launch" else _launched_root(daemon) or proc.pid
        rss, used = rss_of(target), nvml_used(target)
        if rss is not None:
            seen["rss"], seen["nvml"] = rss, used
        time.sleep(0.5)
    survived = proc.poll() is None
    if survived:
        proc.terminate()
    _out, err = proc.communicate(timeout=60)
    rows = [line.split() for line in progress.read_text().splitlines()] if progress.exists() else []
    allocated = int(rows[-1][1]) if rows else 0
    time.sleep(3)  # the kill event comes after the reap and the settle time
    kills = [e for e in daemon.events() if e["kind"] == "kill"][kills_before:]
    return {
        "name": name,
        "returncode": proc.returncode,
        "survived": survived,
        "allocated": allocated,
        "last_rss": seen["rss"],
        "last_nvml": seen["nvml"],
        "kill": kills[-1] if kills else None,
        "stderr": err,
    }


def _launched_root(daemon: Daemon) -> int | None:
    d = daemon.run_dir / "sparkwatch" / "launched"
    for f in sorted(d.glob("[0-9]*.json")) if d.is_dir() else []:
        try:
            return int(json.loads(f.read_text())["root_pid"])
        except (ValueError, KeyError, OSError):
            continue
    return None


def fmt(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "hog":
        ap = argparse.ArgumentParser()
        ap.add_argument("cmd")
        ap.add_argument("kind", choices=("gpu", "pinned"))
        ap.add_argument("--step-gib", type=float, default=1.0)
        ap.add_argument("--limit-gib", type=float, default=16.0)
        ap.add_argument("--every-s", type=float, default=0.5)
        ap.add_argument("--hold-s", type=float, default=60.0)
        ap.add_argument("progress")
        a = ap.parse_args()
        hog(a.kind, a.step_gib, a.limit_gib, every_s=a.every_s, hold_s=a.hold_s, progress=a.progress)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every size by this (default 1: 8 GiB budget)")
    args = ap.parse_args()
    k = args.scale

    def gib(x: float) -> str:
        return f"{x * k:g}"

    import torch  # type: ignore[import-not-found,unused-ignore]

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (torch.cuda.is_available() is False)")
    me = [sys.executable, str(Path(__file__).resolve()), "hog"]
    results = []
    with tempfile.TemporaryDirectory(prefix="sw-budget-gpu-") as tmp_s:
        tmp = Path(tmp_s)
        daemon = Daemon(tmp, [f"{int(8 * k * 1024)}MiB=budget_gpu"])
        steps = ["--step-gib", gib(1), "--limit-gib", gib(16)]
        try:
            results.append(run_case(daemon, tmp, "gpu", [*me, "gpu", *steps], 60))
            results.append(run_case(daemon, tmp, "pinned", [*me, "pinned", *steps], 60))
            under = [*me, "gpu", "--step-gib", gib(1), "--limit-gib", gib(4), "--hold-s", "20"]
            results.append(run_case(daemon, tmp, "under", under, 30))
            launch = [sys.executable, "-m", "sparkwatch", "launch", "--budget", f"{int(6 * k * 1024)}MiB",
                      "--settle-timeout", "0", "--force", "--", *me, "gpu", *steps]  # fmt: skip
            results.append(run_case(daemon, tmp, "launch", launch, 60))
        finally:
            daemon.stop()
    gpu_name = torch.cuda.get_device_name(0)
    lines = [
        "# Budgets on a GPU: GPU and pinned host memory count, a tree past its budget dies on `budget`",
        "",
        "Command: `python3 bench/budget_gpu.py"
        + (f" --scale {k:g}" if k != 1 else "")
        + (f" --out {args.out}" if args.out else "")
        + "`",
        "",
        f"Machine: {gpu_name}, {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}, "
        f"torch {torch.__version__}. Budgets: {gib(8)} GiB (config `engine_budgets`), {gib(6)} GiB "
        f"(`launch --budget`); allocations of {gib(1)} GiB twice a second.",
        "",
        "| case | expected | outcome | trigger | allocated when it ended | footprint at the kill (source) "
        "| GPU bytes in it | last RSS / NVML seen by this script |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    expected = {"gpu": f"killed near {gib(8)} GiB", "pinned": f"killed near {gib(8)} GiB", "under": "untouched",
                "launch": f"killed near {gib(6)} GiB, launch exits 137"}  # fmt: skip
    for r in results:
        kill = r["kill"]
        if r["name"] == "under":
            outcome = "untouched" if r["survived"] else f"ended ({r['returncode']})"
        else:
            outcome = f"killed, exit {r['returncode']}" if not r["survived"] else "NOT killed"
        trigger = kill["trigger"] if kill else "-"
        at_kill = f"{fmt(kill.get('footprint_bytes'))} ({kill.get('footprint_source')})" if kill else "-"
        gpu = fmt(kill.get("victim_gpu_bytes")) if kill else "-"
        lines.append(
            f"| {r['name']} | {expected[r['name']]} | {outcome} | {trigger} | {fmt(r['allocated'])} | {at_kill} | "
            f"{gpu} | {fmt(r['last_rss'])} / {fmt(r['last_nvml'])} |"
        )
    launch_line = next((x for x in results[-1]["stderr"].splitlines() if "the guard killed" in x), "(no line)")
    lines += ["", f"launch's line: `{launch_line}`", ""]
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
