"""Forks guard loops that write the flight recorder, for the crash test: it SIGKILLs them mid-write, a hundred times.

    python tests/helpers/recorder_zygote.py STATE_DIR

Imports everything once (pydantic, the guard), then on each `spawn` line from stdin forks a child that runs a real
pool watch (PoolWatch.start: the guard loop, reaper, scout and kernel-log threads) with a real FlightRecorder wired
as the guard process wires it, on the real /proc, ticking every 50 ms inside the floor's band (a floor of 1 GiB and
1 TiB of warn_headroom: near the floor, never under it), so it writes a record every tick and fdatasyncs once a
second. It prints the child's pid. `reap PID` waits for that child and prints its wait status. A fork costs ms where
a fresh interpreter costs ~200 ms here, so a hundred kills take seconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from sparkwatch.common.eventlog import EventLog
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings
from sparkwatch.guard.poolwatch import PoolWatch
from sparkwatch.guard.recorder import FlightRecorder


def run_guard(state_dir: Path) -> None:
    settings = load_settings(
        overrides={
            "state_dir": state_dir,
            "floor": "1GiB",  # the smallest floor config accepts
            "warn_headroom": "1TiB",
            "poll_min_s": 0.05,
            "poll_max_s": 0.05,
            "mlock": False,
            "dry_run": True,
            "ancestor_pid": os.getpid(),
            "kernel_log_path": state_dir / "no-kmsg",
            "recorder_window_s": 30,
        }
    )
    recorder = FlightRecorder(
        settings.state_dir, settings.recorder_window_s, settings.proc_root, trees=lambda: guard.seen_trees
    )
    guard = PoolWatch.build(guard_config(settings), EventLog(settings.events_path), recorder=recorder)
    recorder.start()
    guard.start()
    while True:
        time.sleep(3600)


def main() -> int:
    state_dir = Path(sys.argv[1])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for line in sys.stdin:
        word, _, arg = line.strip().partition(" ")
        if word == "spawn":
            pid = os.fork()
            if pid == 0:
                try:
                    run_guard(state_dir)
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif word == "reap":
            _pid, status = os.waitpid(int(arg), 0)
            print(status, flush=True)
        elif word == "quit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
