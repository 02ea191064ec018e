"""A real guard process (sparkwatch.guard.process.GuardProcess, its own interpreter) whose telemetry process is a
stand-in, for the channel-flood test.

Usage: flood_guard.py TELEMETRY_SCRIPT < settings.json   (settings.json: `sparkwatch run --print-settings` output)

It imports only what the daemon's guard process imports (the validated settings come on stdin, as the memfd brings
them), runs the guard, and prints one JSON line every 0.2 s on stdout: the pool watch's loop age, this process's
RSS, and the supervisor's restart, stall and flood counters. SIGTERM stops it as it stops the daemon.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from sparkwatch.common.guardconfig import GuardConfig
from sparkwatch.common.selfwatch import rss_bytes
from sparkwatch.guard.process import GuardProcess


def main() -> int:
    script = sys.argv[1]
    data = json.loads(sys.stdin.read())
    config = GuardConfig.from_wire(data["wire"], data["public"])
    process = GuardProcess(config, telemetry=lambda fd, _nvml: [sys.executable, script, "--channel-fd", str(fd)])
    signal.signal(signal.SIGTERM, lambda _s, _f: process.request_stop())

    def report() -> None:
        while True:
            g, sup = process.guard, process.supervisor
            with g.lock:
                last = g.stats.last_loop_monotonic
            line = {
                "loop_age_s": time.monotonic() - last if last else None,
                "rss_bytes": rss_bytes(),
                "restarts": sup.restarts_total,
                "stalls": sup.stalls_total,
                "floods": sup.floods_total,
            }
            print(json.dumps(line), flush=True)
            time.sleep(0.2)

    threading.Thread(target=report, daemon=True).start()
    return process.run()


if __name__ == "__main__":
    raise SystemExit(main())
