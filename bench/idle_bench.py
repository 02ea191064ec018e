"""What sparkwatch costs a box that is doing nothing: CPU and RSS of each process, idle, with a scrape every 5 s.

    .venv/bin/python bench/idle_bench.py --rounds 3 --seconds 60 --out bench/RESULTS-idle.md

Episodes alternate A B A B: the daemon (`sparkwatch run`, both processes, its metrics endpoint scraped every 5 s as
Prometheus would), then earlyoom 1.7 on the same box, `--rounds` times each. Every episode lets the process settle
for 10 s (telemetry imports prometheus_client and pynvml, and its first cycles warm its caches), then
measures `--seconds`: CPU time (each thread's time on a CPU, in ns, from /proc/PID/task/TID/schedstat) over wall
time, in % of one core, and the largest RSS seen in 1 s samples; at the episode's end, each process's PSS
(smaps_rollup) and its RSS split into anonymous, file and locked pages (/proc/PID/status). Medians over the
rounds; these VMs are noisy.

On a GPU machine (where libnvidia-ml loads) the telemetry process polls NVML every cycle, as it does on a Spark;
`--nvml` in the table says whether it did. Run as root so mlockall applies as in the unit.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from tables import publish

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SCRAPE_EVERY_S = 5.0
SETTLE_S = 10.0


@dataclass
class Sample:
    cpu_pct: float
    rss_mib: float
    # At the episode's end, from /proc/PID/status and smaps_rollup: RSS split into anonymous and file pages, the
    # locked part (the guard's mlockall), and PSS (shared library pages divided among the processes that map them).
    pss_mib: float = 0.0
    anon_mib: float = 0.0
    file_mib: float = 0.0
    locked_mib: float = 0.0


def kib_fields(path: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named `Name:   N kB` lines of a /proc file, in MiB (0 where missing or unreadable)."""
    out = dict.fromkeys(names, 0.0)
    try:
        with open(path) as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def memory_detail(pid: int) -> dict[str, float]:
    status = kib_fields(f"/proc/{pid}/status", ("RssAnon", "RssFile", "RssShmem", "VmLck"))
    rollup = kib_fields(f"/proc/{pid}/smaps_rollup", ("Pss",))
    return {
        "pss_mib": rollup["Pss"],
        "anon_mib": status["RssAnon"],
        "file_mib": status["RssFile"] + status["RssShmem"],
        "locked_mib": status["VmLck"],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (sparkwatch names its threads sw-*; /proc/PID/task/TID/comm), summed by name: the
    time on a CPU in ns from /proc/PID/task/TID/schedstat (its first field). /proc/PID/stat counts in 10 ms clock
    ticks, and an idle agent spends about 100 ms of CPU in 30 s: one tick either way was 0.033 % of a core."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                on_cpu_ns = int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + on_cpu_ns / 1e9
    return out


def process_cpu_s(pid: int) -> float:
    """The process's CPU seconds, its threads' schedstat summed (a thread that ended during the episode is not
    counted: the daemon's threads live as long as it does)."""
    return sum(thread_cpu_s(pid).values())


def measure(procs: dict[str, psutil.Process], seconds: float, tick: object = None) -> dict[str, Sample]:
    t0 = time.monotonic()
    cpu0 = {n: process_cpu_s(p.pid) for n, p in procs.items()}
    threads0 = {n: thread_cpu_s(p.pid) for n, p in procs.items()}
    peak = dict.fromkeys(procs, 0)
    while time.monotonic() < t0 + seconds:
        for n, p in procs.items():
            peak[n] = max(peak[n], p.memory_info().rss)
        time.sleep(1)
    wall = time.monotonic() - t0
    out = {
        n: Sample((process_cpu_s(p.pid) - cpu0[n]) / wall * 100, peak[n] / MiB, **memory_detail(p.pid))
        for n, p in procs.items()
    }
    for n, p in procs.items():  # where the time went, per thread: to the log (stderr), not the table
        after = thread_cpu_s(p.pid)
        spent = {t: (after[t] - threads0[n].get(t, 0.0)) / wall * 100 for t in after}
        busy = ", ".join(f"{t} {pct:.3f} %" for t, pct in sorted(spent.items(), key=lambda kv: -kv[1]) if pct > 0)
        print(f"  {n} threads: {busy or 'none measurable'}", file=sys.stderr)
    parts = list(out.values())
    out["whole agent"] = Sample(
        sum(s.cpu_pct for s in parts),
        sum(s.rss_mib for s in parts),
        sum(s.pss_mib for s in parts),
        sum(s.anon_mib for s in parts),
        sum(s.file_mib for s in parts),
        sum(s.locked_mib for s in parts),
    )
    return out


def sparkwatch_episode(seconds: float, tmp: Path, tree: Path = ROOT) -> tuple[dict[str, Sample], bool]:
    """One daemon episode of the source tree `tree` (this checkout, or another commit's, for --baseline)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        {
            "SPARKWATCH_STATE_DIR": str(tmp / "state"),
            "SPARKWATCH_LISTEN": f"127.0.0.1:{port}",
            "SPARKWATCH_ANCESTOR_PID": str(os.getpid()),  # confined: this bench's tree holds no engine
            "XDG_CONFIG_HOME": str(tmp / "xdg"),
        }
    )
    daemon = subprocess.Popen(
        [sys.executable, "-m", "sparkwatch", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=tree,  # `python -m` imports the package from the working directory first
    )
    assert daemon.stderr is not None
    err = daemon.stderr
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(x.decode(errors="replace") for x in err), daemon=True).start()
    stop = threading.Event()
    nvml = [False]
    last_body = [""]

    def scrape() -> None:
        while not stop.wait(SCRAPE_EVERY_S):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    body = resp.read().decode()
                nvml[0] = nvml[0] or "sparkwatch_gpu_up 1.0" in body
                last_body[0] = body
            except OSError:
                pass

    try:
        deadline = time.monotonic() + 60
        guard = psutil.Process(daemon.pid)
        while not guard.children() and time.monotonic() < deadline:
            time.sleep(0.2)
        (telemetry,) = guard.children()
        threading.Thread(target=scrape, daemon=True).start()
        time.sleep(SETTLE_S)
        got = measure({"guard": guard, "telemetry": telemetry}, seconds)
        durations = [
            line.split("{", 1)[1].replace('collector="', "").replace('"}', "")
            for line in last_body[0].splitlines()
            if line.startswith("sparkwatch_collector_duration_seconds{")
        ]
        print("  telemetry's last cycle, seconds per source: " + ", ".join(durations), file=sys.stderr)
        return got, nvml[0]
    finally:
        stop.set()
        daemon.terminate()
        daemon.wait(15)


def earlyoom_episode(seconds: float) -> dict[str, Sample]:
    proc = subprocess.Popen(
        ["earlyoom", "-M", "524288,524288", "-r", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(SETTLE_S)
        got = measure({"earlyoom": psutil.Process(proc.pid)}, seconds)
        del got["whole agent"]
        return got
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--no-earlyoom", action="store_true", help="where earlyoom is not installed (a GPU host)")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="another commit's source tree (git archive COMMIT | tar -x -C DIR): its daemon runs before this one's "
        "in every round, A B A B, so a change is measured against its parent on the same box the same day",
    )
    args = ap.parse_args()
    runs: dict[str, list[Sample]] = {}
    nvml_seen = False
    with tempfile.TemporaryDirectory() as tmpdir:
        for i in range(args.rounds):
            if args.baseline is not None:
                base, _ = sparkwatch_episode(args.seconds, Path(tmpdir) / f"base{i}", args.baseline)
                for name, s in base.items():
                    runs.setdefault(f"{name} (baseline)", []).append(s)
            got, nvml = sparkwatch_episode(args.seconds, Path(tmpdir) / f"sw{i}")
            nvml_seen = nvml_seen or nvml
            for name, s in got.items():
                runs.setdefault(name, []).append(s)
            if not args.no_earlyoom:
                for name, s in earlyoom_episode(args.seconds).items():
                    runs.setdefault(name, []).append(s)
            print(f"round {i + 1}: " + ", ".join(f"{n} {v[-1].cpu_pct:.3f} %" for n, v in runs.items()), flush=True)
    cmd = "python bench/idle_bench.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{cmd}` (as uid {os.geteuid()})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / (1 << 30):.1f} GiB, kernel {platform.release()}; "
        f"NVML polled by telemetry: {'yes' if nvml_seen else 'no'}",
        "",
        f"Idle, a scrape every {SCRAPE_EVERY_S:.0f} s, {args.seconds:.0f} s per episode after {SETTLE_S:.0f} s to "
        f"settle, {args.rounds} rounds alternated with "
        + ("earlyoom" if not args.no_earlyoom else "nothing")
        + (f" and the baseline tree {args.baseline}" if args.baseline else "")
        + "; medians (min-max):",
        "",
        "| process | CPU % of one core | max RSS MiB | PSS MiB | RSS anon MiB | RSS file MiB | locked MiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    for name, samples in runs.items():
        lines.append(
            f"| {name} | {cell([s.cpu_pct for s in samples], 3)} | {cell([s.rss_mib for s in samples], 1)} | "
            f"{cell([s.pss_mib for s in samples], 1)} | {cell([s.anon_mib for s in samples], 1)} | "
            f"{cell([s.file_mib for s in samples], 1)} | {cell([s.locked_mib for s in samples], 1)} |"
        )
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
