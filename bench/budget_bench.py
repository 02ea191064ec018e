"""Per-engine budgets: from crossing the budget to the signal, and how far above the floor a budget keeps the box.

    .venv/bin/python bench/budget_bench.py --episodes 10 --rates 0.5,2,6 --out bench/RESULTS-budget.md

Part 1, crossing -> signal. The guard's own code (guard.poolwatch.PoolWatch, its thread, its tick, its budget watch
and killer) runs in this process with `engine_budgets = ["1GiB=sw-budget-bench"]`; a hog titled
VLLM::EngineCore_sw-budget-bench touches anonymous memory at a target rate in 32 MiB steps toward budget + 1.5 GiB,
stamping CLOCK_MONOTONIC and its own RSS after every step. Crossing = the first stamp past the kill limit (budget +
max(2 %, 256 MiB)); signal = when the killer's SIGKILL went out (its return value). Reported per target rate: the
rate the hog really reached just before the crossing (this VM's fill comes in host-side bursts), the median and
worst crossing -> signal, and how far past the limit the hog got by the signal.

Part 2, with and without a budget, and earlyoom: the floor is set 3 GiB under MemAvailable, and a runaway tree grows
at 2 GiB/s toward 1.5 GiB past the floor. A: sparkwatch with the tree's budget at 1 GiB; B: sparkwatch without a
budget (the floor stops it); C: earlyoom 1.7 at the same floor (`-M floor,floor --prefer`). Episodes alternate A B C
A B C; a 2 ms sampler records MemAvailable, and the table gives how far above the floor the box stayed at its lowest.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.eventlog import EventLog  # noqa: E402
from sparkwatch.common.sources.meminfo import MeminfoReader  # noqa: E402
from sparkwatch.config.schema import guard_config  # noqa: E402
from sparkwatch.config.settings import load_settings  # noqa: E402
from sparkwatch.core.kill.budget import BudgetParams, limit_bytes  # noqa: E402
from sparkwatch.guard.poolwatch import PoolWatch  # noqa: E402
from tests.memsampler import Sampler  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
CHUNK = 32 * MiB
BUDGET = 1 * GiB
TITLE = "VLLM::EngineCore_sw-budget-bench"


def hog(rate_mib: float, limit_mib: int, stamps: str, go: str) -> None:
    import setproctitle

    setproctitle.setproctitle(TITLE)
    while not os.path.exists(go):
        time.sleep(0.01)
    page = os.sysconf("SC_PAGE_SIZE")
    block = b"\xa5" * CHUNK
    maps = []
    out = open(stamps, "w", encoding="ascii")  # noqa: SIM115
    start = time.monotonic()
    done = 0
    while done < limit_mib * MiB:
        mm = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.write(block)
        maps.append(mm)
        done += CHUNK
        with open("/proc/self/statm", "rb") as fh:
            rss = int(fh.read().split()[1]) * page
        out.write(f"{time.monotonic():.6f} {rss}\n")
        out.flush()
        ahead = done / (rate_mib * MiB) - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
    while True:
        time.sleep(60)


def start_hog(tmp: Path, rate_gib: float, limit: int) -> tuple[subprocess.Popen[bytes], Path, Path]:
    stamps = tmp / f"stamps-{time.monotonic_ns()}"
    go = tmp / f"go-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--hog", str(rate_gib * 1024), str(limit // MiB), str(stamps), str(go)]
    )
    return proc, stamps, go


def guard(tmp: Path, budgets: list[str], floor: int) -> tuple[PoolWatch, list[float]]:
    settings = load_settings(
        overrides={
            "state_dir": tmp / "state",
            "floor": f"{floor}B",  # config takes sizes with a unit; bytes are <n>B
            "mlock": False,
            "ancestor_pid": os.getpid(),
            "engine_budgets": budgets,
            "kernel_log_path": tmp / "no-kmsg",
        }
    )
    pool = PoolWatch.build(guard_config(settings), EventLog(settings.events_path))
    signals: list[float] = []
    killer = pool.kills.killer
    kill = killer.kill

    def recording_kill(*a: object, **kw: object) -> object:
        out = kill(*a, **kw)  # type: ignore[arg-type]
        signals.append(time.monotonic() if out[1] is None else out[1])
        return out

    killer.kill = recording_kill  # type: ignore[method-assign,assignment]
    pool.start()
    return pool, signals


@dataclass
class Crossing:
    rate_gib: float
    real_rate_gib: float | None
    to_signal_ms: float | None
    past_limit_mib: float | None


def stamps_of(path: Path) -> list[tuple[float, int]]:
    out = []
    for line in path.read_text().splitlines():
        t, rss = line.split()
        out.append((float(t), int(rss)))
    return out


def wait_gone(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def crossing_episode(tmp: Path, rate_gib: float) -> Crossing:
    limit = limit_bytes(BUDGET, BudgetParams())
    pool, signals = guard(tmp, [f"{BUDGET}=sw-budget-bench"], floor=1 * GiB)  # the smallest floor config accepts
    proc, stamps, go = start_hog(tmp, rate_gib, BUDGET + int(1.5 * GiB))
    try:
        # Measured for a tree the guard already tracks (a new one is discovered within a second through telemetry's
        # census, which this in-process guard lacks, and within DISCOVER_EVERY_S without it).
        deadline = time.monotonic() + 15
        while not any(k[0] == proc.pid for k in pool.budgets.tracked) and time.monotonic() < deadline:
            time.sleep(0.05)
        go.touch()
        killed = wait_gone(proc, 30)
    finally:
        pool.stop()
    rows = stamps_of(stamps)
    cross = next(((t, r) for t, r in rows if r > limit), None)
    if not killed or not signals or cross is None:
        return Crossing(rate_gib, None, None, None)
    before = [(t, r) for t, r in rows if cross[0] - 0.1 <= t <= cross[0]]
    real = None
    if len(before) >= 2 and before[-1][0] > before[0][0]:
        real = (before[-1][1] - before[0][1]) / (before[-1][0] - before[0][0]) / GiB
    at_signal = max((r for t, r in rows if t <= signals[0]), default=cross[1])
    return Crossing(rate_gib, real, (signals[0] - cross[0]) * 1000, (at_signal - limit) / MiB)


def floor_episode(tmp: Path, contender: str) -> float | None:
    """How far above the floor MemAvailable stayed at its lowest (MiB; negative: under it)."""
    with MeminfoReader() as r:
        floor = r.read().available_bytes - 3 * GiB
    eo = None
    pool = None
    if contender == "earlyoom":
        kib = floor // 1024
        eo = subprocess.Popen(["earlyoom", "-M", f"{kib},{kib}", "-r", "0", "--prefer", "sw-budget-bench"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(0.5)
    else:
        budgets = [f"{BUDGET}=sw-budget-bench"] if contender == "budget" else []
        pool, _signals = guard(tmp, budgets, floor=floor)
    sampler = Sampler()
    proc, _stamps, go = start_hog(tmp, 2.0, 3 * GiB + int(1.5 * GiB))
    try:
        time.sleep(6.0)  # every contender has seen the hog (the budget watch discovers within DISCOVER_EVERY_S)
        sampler.start()
        go.touch()
        killed = wait_gone(proc, 30)
    finally:
        sampler.stop.set()
        sampler.join()
        if pool is not None:
            pool.stop()
        if eo is not None:
            eo.terminate()
            eo.wait()
    if not killed or sampler.low is None:
        return None
    return (sampler.low - floor) / MiB


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--hog":
        hog(float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--rates", default="0.5,2,6")
    ap.add_argument("--floor-episodes", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[float, list[Crossing]] = {r: [] for r in rates}
    floors: dict[str, list[float | None]] = {"budget": [], "floor": [], "earlyoom": []}
    contenders = ["budget", "floor"] + (["earlyoom"] if shutil.which("earlyoom") and os.geteuid() == 0 else [])
    with tempfile.TemporaryDirectory(prefix="sw-budget-bench-") as tmp_s:
        tmp = Path(tmp_s)
        for _ in range(args.episodes):
            for rate in rates:  # rates interleaved: a slow minute of the VM hits every rate alike
                results[rate].append(crossing_episode(tmp, rate))
        for i in range(args.floor_episodes):
            order = contenders if i % 2 == 0 else list(reversed(contenders))
            for c in order:
                floors[c].append(floor_episode(tmp, c))
    lines = [
        "# Budgets: crossing -> signal, and the floor with and without a budget",
        "",
        f"Command: `python bench/budget_bench.py --episodes {args.episodes} --rates {args.rates} "
        f"--floor-episodes {args.floor_episodes}` (as uid {os.geteuid()})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}. Budget "
        f"{BUDGET >> 20} MiB, kill limit {limit_bytes(BUDGET, BudgetParams()) >> 20} MiB "
        "(budget + max(2 %, 256 MiB)).",
        "",
        "| target rate | real rate at the crossing (median) | crossing -> signal, median | worst "
        "| past the limit at the signal, median (worst) | episodes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for rate, eps in results.items():
        ok = [e for e in eps if e.to_signal_ms is not None]
        real = [e.real_rate_gib for e in ok if e.real_rate_gib is not None]
        if not ok:
            lines.append(f"| {rate:g} GiB/s | - | - | - | - | 0 of {len(eps)} |")
            continue
        ms = [e.to_signal_ms for e in ok if e.to_signal_ms is not None]
        past = [e.past_limit_mib for e in ok if e.past_limit_mib is not None]
        lines.append(
            f"| {rate:g} GiB/s | {statistics.median(real):.2f} GiB/s | {statistics.median(ms):.0f} ms | "
            f"{max(ms):.0f} ms | {statistics.median(past):.0f} MiB ({max(past):.0f}) | {len(ok)} of {len(eps)} |"
            if real
            else f"| {rate:g} GiB/s | - | {statistics.median(ms):.0f} ms | {max(ms):.0f} ms | "
            f"{statistics.median(past):.0f} MiB ({max(past):.0f}) | {len(ok)} of {len(eps)} |"
        )
    lines += [
        "",
        "A runaway tree at 2 GiB/s toward 1.5 GiB past a floor set 3 GiB under MemAvailable; how far above the floor "
        "MemAvailable stayed at its lowest (MiB, median and lowest), episodes alternated:",
        "",
        "| contender | above the floor, median | lowest | episodes |",
        "| --- | --- | --- | --- |",
    ]
    names = {"budget": "sparkwatch, 1 GiB budget", "floor": "sparkwatch, no budget (floor)", "earlyoom": "earlyoom 1.7"}
    for c in contenders:
        vals = [v for v in floors[c] if v is not None]
        if vals:
            lines.append(
                f"| {names[c]} | {statistics.median(vals):.0f} MiB | {min(vals):.0f} MiB | {len(vals)} of "
                f"{len(floors[c])} |"
            )
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
