"""The guard's idle tick: what one PoolWatch.tick costs far from the floor (the path every poll takes).

A real PoolWatch on a fixture /proc (a GB10's idle meminfo, 113 GiB available over an 8 GiB floor), no threads
started, no budget, no kernel log: each tick reads meminfo through the kept-open fd, steps core.kill.trigger, looks at
the budgets and the kill path's teardown, and updates the stats. Per round, the mean over `--ticks` ticks; printed, the
best and the median round (a shared 2-core VM: compare builds by alternating runs, A B A B).

    .venv/bin/python bench/tick_bench.py --rounds 5 --ticks 20000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.eventlog import EventLog  # noqa: E402
from sparkwatch.config.schema import guard_config  # noqa: E402
from sparkwatch.config.settings import load_settings  # noqa: E402
from sparkwatch.guard.poolwatch import PoolWatch  # noqa: E402

GB10 = ROOT / "tests" / "fixtures" / "proc" / "meminfo.gb10-idle"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ticks", type=int, default=20000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc = Path(tmp) / "proc"
        proc.mkdir()
        (proc / "meminfo").write_text(GB10.read_text())
        settings = load_settings(
            None,
            {
                "proc_root": proc,
                "state_dir": Path(tmp) / "state",
                "floor": "8GiB",
                "mlock": False,
                "kernel_log_path": Path(tmp) / "no-kmsg",
            },
        )
        guard = PoolWatch.build(guard_config(settings), EventLog(settings.events_path))
        for _ in range(2000):  # warm: caches, the first tick's news
            guard.tick()
        rounds_us = []
        for _ in range(args.rounds):
            start = time.perf_counter_ns()
            for _ in range(args.ticks):
                guard.tick()
            rounds_us.append((time.perf_counter_ns() - start) / args.ticks / 1000)
        guard.meminfo.close()
    print(f"tick: best {min(rounds_us):.2f} µs, median {statistics.median(rounds_us):.2f} µs ({args.rounds} rounds)")


if __name__ == "__main__":
    main()
