"""What the flight recorder costs: per record, and in a running daemon far from the floor and near it.

    flock /tmp/sparkwatch-pressure.lock .venv/bin/python bench/recorder_bench.py --rounds 3 --seconds 60 \
        --out bench/RESULTS-recorder.md

1. Per record, in this process: building a sample (buddyinfo and PSI reads, its binary record) and a slot's
   pwrite, and the pwrite followed by fdatasync (what the recorder does at most once a second near the floor), on
   the disk that holds the state dir. Episodes of 200 records alternate A B A B; medians of the episodes' medians.
2. The daemon (`sparkwatch run`, both processes, idle), with the recorder off (`recorder_window_s = 0`) and on (the
   default, 600 s), alternated A B A B:
   - far: the defaults (the guard ticks once a second, one record a second, no fsync);
   - near: `warn_headroom` larger than the box's memory and `poll_max_s = 0.05`, so the guard sits in the floor's
     band ticking 20 times a second without ever firing: a record every tick and an fdatasync a second, the most the
     recorder ever writes.
   For the guard process: CPU % of one core (user + system from /proc/PID/stat over wall time), max RSS, bytes it
   sent to the storage layer (`write_bytes` of /proc/PID/io: each page it dirtied, once per writeback; re-dirtying
   a page still dirty costs nothing), and the recorder thread's own CPU (schedstat of `sw-recorder`: less noisy than
   the process's, which moves with the box) and wake-ups (its voluntary context switches).

Run under the shared lock (`flock /tmp/sparkwatch-pressure.lock …`) so no other benchmark shares the box.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from tables import publish

from sparkwatch.common.flightrec import SLOT_BYTES, RingWriter, ring_bytes, ring_capacity
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.core.postmortem.flight import FlightSample
from sparkwatch.guard.recorder import FlightRecorder, Tick

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SETTLE_S = 10.0
RECORDS_PER_EPISODE = 200


def per_record(tmp: Path, rounds: int) -> dict[str, list[float]]:
    """µs of CPU (thread time) per operation, and wall µs for the fsync case, one median per episode."""
    recorder = FlightRecorder(tmp, 600, Path("/proc"))
    mem = MeminfoReader(Path("/proc")).read()
    writer = RingWriter(tmp / "recorder.ring", ring_capacity(600), "0" * 32)
    writer.open()
    tick = Tick(0.0, time.time(), mem, 0.0, 1.0, False, "watch", 0)
    out: dict[str, list[float]] = {}

    def episode(name: str, op: Callable[[], object]) -> None:
        cpu, wall = [], []
        for _ in range(RECORDS_PER_EPISODE):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            op()
            cpu.append((time.thread_time_ns() - c0) / 1000)
            wall.append((time.perf_counter_ns() - w0) / 1000)
        out.setdefault(f"{name} cpu", []).append(statistics.median(cpu))
        out.setdefault(f"{name} wall", []).append(statistics.median(wall))

    sample = recorder.sample(tick)
    for _ in range(rounds):
        episode("build sample", lambda: recorder.sample(tick))
        episode("pwrite", lambda: writer.write(sample))
        episode("pwrite + fdatasync", lambda: write_and_sync(writer, sample))
    writer.close()
    return out


def write_and_sync(writer: RingWriter, sample: FlightSample) -> None:
    writer.write(sample)
    writer.sync()


@dataclass
class Daemon:
    cpu_pct: float
    rss_mib: float
    write_kib_per_s: float
    recorder_wakeups_per_s: float | None
    recorder_cpu_pct: float | None  # the recorder thread alone (schedstat)
    ring_mib: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def io_write_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def recorder_thread(pid: int) -> tuple[int, int] | None:
    """(voluntary context switches, ns on CPU from schedstat) of the guard's `sw-recorder` thread."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "sw-recorder":
                on_cpu_ns = int((task / "schedstat").read_text().split()[0])
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        return int(line.split()[1]), on_cpu_ns
        except OSError:
            continue
    return None


def daemon_episode(tmp: Path, seconds: float, recorder_on: bool, near: bool) -> Daemon:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        {
            "SPARKWATCH_STATE_DIR": str(tmp / "state"),
            "SPARKWATCH_LISTEN": f"127.0.0.1:{free_port()}",
            "SPARKWATCH_ANCESTOR_PID": str(os.getpid()),
            "SPARKWATCH_RECORDER_WINDOW_S": "600" if recorder_on else "0",
            "XDG_CONFIG_HOME": str(tmp / "xdg"),
        }
    )
    if near:
        env["SPARKWATCH_WARN_HEADROOM"] = "1TiB"
        env["SPARKWATCH_POLL_MAX_S"] = "0.05"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "sparkwatch", "run"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert daemon.stderr is not None
    err = daemon.stderr
    threading.Thread(target=lambda: [None for _ in err], daemon=True).start()
    try:
        guard = psutil.Process(daemon.pid)
        deadline = time.monotonic() + 60
        while not guard.children() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(SETTLE_S)
        cpu0, io0, rec0 = sum(guard.cpu_times()[:2]), io_write_bytes(daemon.pid), recorder_thread(daemon.pid)
        t0 = time.monotonic()
        peak = 0
        while time.monotonic() < t0 + seconds:
            peak = max(peak, guard.memory_info().rss)
            time.sleep(1)
        wall = time.monotonic() - t0
        cpu1, io1, rec1 = sum(guard.cpu_times()[:2]), io_write_bytes(daemon.pid), recorder_thread(daemon.pid)
        ring = tmp / "state" / "recorder.ring"
        return Daemon(
            cpu_pct=(cpu1 - cpu0) / wall * 100,
            rss_mib=peak / MiB,
            write_kib_per_s=(io1 - io0) / wall / 1024,
            recorder_wakeups_per_s=None if rec0 is None or rec1 is None else (rec1[0] - rec0[0]) / wall,
            recorder_cpu_pct=None if rec0 is None or rec1 is None else (rec1[1] - rec0[1]) / wall / 1e7,
            ring_mib=ring.stat().st_size / MiB if ring.exists() else 0.0,
        )
    finally:
        daemon.terminate()
        daemon.wait(15)


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmpdir:
        tmp = Path(tmpdir)
        micro = per_record(tmp / "micro", args.rounds)
        runs: dict[tuple[str, bool], list[Daemon]] = {}
        for i in range(args.rounds):
            for mode in ("far", "near"):
                for on in (False, True):  # A B A B: off, on, off, on
                    got = daemon_episode(tmp / f"d{i}-{mode}-{int(on)}", args.seconds, on, mode == "near")
                    runs.setdefault((mode, on), []).append(got)
                    print(f"round {i + 1} {mode} recorder {'on' if on else 'off'}: {got}", flush=True)
        fs = subprocess.run(["df", "-T", tmpdir], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    cmd = "python bench/recorder_bench.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{cmd}` (as uid {os.geteuid()})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / (1 << 30):.1f} GiB, kernel {platform.release()}; state dir on {fs}",
        "",
        f"Ring: {SLOT_BYTES}-byte records, {ring_capacity(600)} slots for the default 600 s "
        f"({ring_bytes(ring_capacity(600)) / MiB:.2f} MiB, written whole once per boot, never grown).",
        "",
        f"Per record, in-process, {args.rounds} episodes of {RECORDS_PER_EPISODE}; medians of episode medians "
        "(min-max):",
        "",
        "| operation | CPU µs | wall µs |",
        "| --- | --- | --- |",
    ]
    for name in ("build sample", "pwrite", "pwrite + fdatasync"):
        lines.append(
            f"| {name} | {spread(micro[f'{name} cpu'], '{:.1f}')} | {spread(micro[f'{name} wall'], '{:.1f}')} |"
        )
    lines += [
        "",
        f"The guard process of an idle daemon, {args.seconds:.0f} s per episode after {SETTLE_S:.0f} s to settle, "
        f"{args.rounds} rounds, recorder off and on alternated; medians (min-max):",
        "",
        "| mode | recorder | guard CPU % of one core | recorder thread CPU % | max RSS MiB | written KiB/s | "
        "recorder wake-ups/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in ("far", "near"):
        for on in (False, True):
            episodes = runs[(mode, on)]
            wake = [d.recorder_wakeups_per_s for d in episodes if d.recorder_wakeups_per_s is not None]
            thread = [d.recorder_cpu_pct for d in episodes if d.recorder_cpu_pct is not None]
            lines.append(
                f"| {mode} | {'on' if on else 'off'} | {spread([d.cpu_pct for d in episodes])} | "
                f"{spread(thread) if thread else '-'} | "
                f"{spread([d.rss_mib for d in episodes], '{:.1f}')} | "
                f"{spread([d.write_kib_per_s for d in episodes], '{:.1f}')} | "
                f"{spread(wake, '{:.2f}') if wake else '-'} |"
            )
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
