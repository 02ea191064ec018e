"""Kernel-log benchmark: what reading /dev/kmsg costs the guard, idle and under a 10,000 lines/s burst.

A real PoolWatch runs in this process on a fixture /proc whose MemAvailable sits inside the warning band, with its poll
interval pinned to 50 ms (the guard's fastest, the worst case for a per-tick read). A separate writer process floods
the real /dev/kmsg at the target rate (99 % other subsystems' lines, 1 % NVRM assertion lines that are parsed and
counted but never acted on). Episodes alternate A B A B:

  A: the kernel-log source off (kernel_log_path points nowhere), B: on, reading the real /dev/kmsg

each once with the box idle and once under the burst. Per episode: the CPU the kernel-log poll took on the guard's
thread (thread CPU time summed around KernelLogWatch.poll), lines read and dropped, and the guard loop's lateness:
next tick start - (this tick start + the interval it asked for), so the time spent inside the tick counts.

Needs root (writing /dev/kmsg). Writes about rate x seconds x bursts lines into the real kernel log.

    sudo .venv/bin/python bench/kmsg_bench.py --episodes 2 --seconds 5 --rate 10000 --out bench/RESULTS-kmsg.md
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.eventlog import EventLog  # noqa: E402
from sparkwatch.config.schema import guard_config  # noqa: E402
from sparkwatch.config.settings import load_settings  # noqa: E402
from sparkwatch.guard.poolwatch import PoolWatch  # noqa: E402

GB10 = (ROOT / "tests" / "fixtures" / "proc" / "meminfo.gb10-idle").read_text()
POLL_S = 0.05

WRITER = r"""
import os, sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
batch = max(1, int(rate / 100))  # 100 batches a second
filler = b"<6>bench-kmsg: eth0: link flap filler line %d"
nvrm = b"<4>NVRM: nvAssertFailedNoLog: Assertion failed: 0 @ bench.c:%d"
start = time.monotonic(); n = 0
while time.monotonic() - start < seconds:
    for _ in range(0, batch, 10):
        fd = os.open("/dev/kmsg", os.O_WRONLY)  # printk_devkmsg=ratelimit keeps 10 lines per open file
        for _ in range(10):
            os.write(fd, (nvrm if n % 100 == 0 else filler) % n + b"\n"); n += 1
        os.close(fd)
    due = start + n / rate
    if due > time.monotonic():
        time.sleep(due - time.monotonic())
print(n, time.monotonic() - start)
"""


@dataclass
class Episode:
    label: str
    kernel_log: bool
    burst: bool
    written: int = 0
    write_s: float = 0.0
    poll_cpu_s: float = 0.0
    wall_s: float = 0.0
    lines: int = 0
    dropped: int = 0
    lateness_ms: list[float] = field(default_factory=list)


class TimedGuard(PoolWatch):
    """The real PoolWatch, with tick starts and the kernel-log poll's thread CPU recorded."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.starts: list[tuple[float, float]] = []  # (tick start, interval asked)
        self.poll_cpu_s = 0.0
        inner = self.kernlog.poll

        def timed_poll(*a: object, **k: object) -> str | None:
            t0 = time.thread_time()
            try:
                return inner(*a, **k)  # type: ignore[arg-type]
            finally:
                self.poll_cpu_s += time.thread_time() - t0

        self.kernlog.poll = timed_poll  # type: ignore[method-assign]

    def tick(self) -> float:
        t = time.monotonic()
        interval = super().tick()
        self.starts.append((t, interval))
        return interval


def run_episode(ep: Episode, seconds: float, rate: float, tmp: Path) -> None:
    proc = tmp / f"proc-{ep.label}"
    proc.mkdir()
    # 10 GiB available over an 8 GiB floor: inside warn_headroom, never a kill (nothing to kill: ancestor_pid 1
    # confines the guard to... everything, so it is pinned to this bench process instead).
    (proc / "meminfo").write_text(GB10.replace("118566368", str(10 * 1024 * 1024)))
    settings = load_settings(
        overrides={
            "proc_root": proc,
            "state_dir": tmp / f"state-{ep.label}",
            "floor": "8GiB",
            "poll_min_s": POLL_S,
            "poll_max_s": POLL_S,
            "mlock": False,
            "ancestor_pid": os.getpid(),
            "kernel_log_path": "/dev/kmsg" if ep.kernel_log else str(tmp / "no-kmsg"),
        }
    )
    guard = TimedGuard(guard_config(settings), EventLog(settings.events_path))
    guard.start()
    time.sleep(0.3)
    writer = None
    if ep.burst:
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(rate), str(seconds)], stdout=subprocess.PIPE, text=True
        )
    guard.starts.clear()
    cpu0 = guard.poll_cpu_s
    t0 = time.monotonic()
    if writer is not None:
        out, _ = writer.communicate(timeout=seconds * 4 + 30)
        n, secs = out.split()
        ep.written, ep.write_s = int(n), float(secs)
    else:
        time.sleep(seconds)
    ep.wall_s = time.monotonic() - t0
    ep.poll_cpu_s = guard.poll_cpu_s - cpu0
    starts = list(guard.starts)
    with guard.kernlog.lock:
        ep.lines, ep.dropped = guard.kernlog.stats.lines_total, guard.kernlog.stats.dropped_total
    guard.stop()
    ep.lateness_ms = [(nxt - (t + interval)) * 1000 for (t, interval), (nxt, _i) in itertools.pairwise(starts)]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=10_000.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root: it writes /dev/kmsg", file=sys.stderr)
        return 2
    episodes: list[Episode] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(args.episodes):
            for burst in (False, True):
                for kernel_log in (False, True):  # A B A B
                    ep = Episode(f"{i}-{'burst' if burst else 'idle'}-{'B' if kernel_log else 'A'}", kernel_log, burst)
                    run_episode(ep, args.seconds, args.rate, tmp)
                    episodes.append(ep)
                    print(
                        f"{ep.label}: poll cpu {ep.poll_cpu_s * 1000:.1f} ms over {ep.wall_s:.1f} s, "
                        f"lines {ep.lines} dropped {ep.dropped}, written {ep.written} in {ep.write_s:.1f} s, "
                        f"lateness p50 {pct(ep.lateness_ms, 0.5):.2f} p99 {pct(ep.lateness_ms, 0.99):.2f} ms",
                        flush=True,
                    )
    text = report(episodes, args)
    publish(text, args.out)
    return 0


HEADER = (
    "| box | kernel log | poll CPU (median, % of a core) | written (median rate, total) | lines read | dropped "
    "| guard lateness p50 / p99 / max | ticks |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def report(episodes: list[Episode], args: argparse.Namespace) -> str:
    rows = []
    for burst in (False, True):
        for kernel_log in (False, True):
            eps = [e for e in episodes if e.burst == burst and e.kernel_log == kernel_log]
            late = [x for e in eps for x in e.lateness_ms]
            cpu_pct = statistics.median(e.poll_cpu_s / e.wall_s * 100 for e in eps)
            written = sum(e.written for e in eps)
            wrate = statistics.median(e.written / e.write_s for e in eps) if burst else 0.0
            read = sum(e.lines for e in eps)
            dropped = sum(e.dropped for e in eps)
            rows.append(
                f"| {'burst' if burst else 'idle'} | {'B: on' if kernel_log else 'A: off'} | "
                f"{cpu_pct:.2f} % | {f'{wrate:,.0f}/s ({written:,})' if burst else '-'} | {read:,} | {dropped:,} | "
                f"{pct(late, 0.5):.2f} / {pct(late, 0.99):.2f} / {max(late) if late else float('nan'):.2f} ms | "
                f"{len(late)} |"
            )
    uname = platform.uname()
    return f"""# Kernel-log benchmark

Machine: {uname.machine}, {os.cpu_count()} CPUs, Python {platform.python_version()}, kernel {uname.release}.
Targets: the kernel-log poll costs the guard under 1 % of a core idle and stays bounded under a 10,000 lines/s
flood (lines over the 2000 lines/s bound are skipped and counted, not queued); the guard loop's lateness under the
flood stays within a few ms of the same loop without the kernel log.

Command (root: it writes /dev/kmsg):

  .venv/bin/python bench/kmsg_bench.py --episodes {args.episodes} --seconds {args.seconds:g} --rate {args.rate:g} \\
      --out bench/RESULTS-kmsg.md

{args.episodes} episodes of {args.seconds:g} s per row, alternated A B A B; guard poll pinned to {POLL_S * 1000:.0f} ms.

{HEADER}
{chr(10).join(rows)}
"""


if __name__ == "__main__":
    sys.exit(main())
