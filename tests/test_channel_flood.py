"""A telemetry process that floods the channel cannot hurt the guard: a real guard process, a stand-in telemetry that
sends valid `tel` messages without pause for 30 s, and a real engine under real memory pressure meanwhile.

Before the channel was bounded, such a sender grew the guard from 24 MiB to 6-7 GiB in 6 s at 100 % CPU, the 15 s
stall watchdog never fired, and a kill came 951 ms after detection, about 2 GiB under the floor.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common.selfwatch import GUARD_RSS_CAP_BYTES
from sparkwatch.core.units import GiB
from tests.conftest import Spawner, alive, pids_in, settled_available_bytes, wait_until
from tests.daemon import daemon_env, free_port, wait_for_event
from tests.test_guard_pressure import HEADROOM_BYTES, OVERSHOOT_MARGIN_BYTES, MinTracker, hog_args

HELPERS = Path(__file__).parent / "helpers"
FLOOD_S = 30.0
# The pool watch beats at least every poll_max_s (1 s); twice that is late.
LOOP_AGE_MAX_S = 2.0
# The flood must not stall the kill path: the bench's detect → signal is a few ms; before the fix it was 951 ms.
DETECT_TO_SIGNAL_MAX_MS = 250.0


def guard_settings(tmp_path: Path, floor: int) -> str:
    """The validated settings, as `sparkwatch run` hands them to the guard process."""
    env = daemon_env(tmp_path, free_port())
    env.update({"SPARKWATCH_FLOOR": f"{floor}B", "SPARKWATCH_MLOCK": "false"})
    done = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "run", "--print-settings"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


@pytest.mark.pressure
@pytest.mark.slow
def test_a_flooding_telemetry_cannot_hurt_the_guard(spawner: Spawner, tmp_path: Path) -> None:
    available = settled_available_bytes()
    if available < 6 * GiB:
        pytest.skip(f"only {available >> 20} MiB available; this test wants 6 GiB")
    floor = available - HEADROOM_BYTES
    guard = spawner.popen(
        [sys.executable, str(HELPERS / "flood_guard.py"), str(HELPERS / "flood_telemetry.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert guard.stdin is not None and guard.stdout is not None
    guard.stdin.write(guard_settings(tmp_path, floor).encode())
    guard.stdin.close()
    reports: list[dict[str, Any]] = []
    out = guard.stdout
    reader = threading.Thread(target=lambda: reports.extend(json.loads(line) for line in out), daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        assert wait_until(lambda: len(reports) >= 5, 30), "the guard process did not start"
        time.sleep(3.0)  # the channel is full by now
        tracker = MinTracker()
        tracker.start()
        pidfile = tmp_path / "tree.pids"
        spawner.engine(
            "--worker",
            "VLLM::Worker_TP0",
            "--ignore-term",
            *hog_args(floor, HEADROOM_BYTES),
            pidfile=pidfile,
            wait_for=2,
        )
        event = wait_for_event(tmp_path / "state" / "events.jsonl", "kill", timeout_s=60)
        tracker.stop.set()
        tracker.join()
        recorded = pids_in(pidfile)
        assert wait_until(lambda: not any(alive(pid, t) for pid, (t, _) in recorded.items()), 10)
        time.sleep(max(0.0, FLOOD_S - (time.monotonic() - started)))
        assert wait_until(lambda: reports[-1]["floods"] >= 1 and reports[-1]["restarts"] >= 1, 20), reports[-1]
    finally:
        guard.terminate()
        guard.wait(15)
        reader.join(5)
    # Killed before the floor, and at once.
    assert event["trigger"] == "predicted", event["trigger"]
    assert int(str(event["mem_available_bytes"])) > floor
    assert float(str(event["detect_to_signal_ms"])) <= DETECT_TO_SIGNAL_MAX_MS, event["detect_to_signal_ms"]
    assert floor - tracker.min_available <= OVERSHOOT_MARGIN_BYTES
    # The loop stayed on time and the guard's memory under its cap, throughout.
    ages = [r["loop_age_s"] for r in reports if r["loop_age_s"] is not None]
    assert ages and max(ages) <= LOOP_AGE_MAX_S, max(ages)
    assert max(r["rss_bytes"] for r in reports) < GUARD_RSS_CAP_BYTES
    # Telemetry was restarted as stalled (flooding), with an event that says why.
    assert reports[-1]["stalls"] >= 1
    restarts = [
        json.loads(line)
        for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()
        if '"component_restarted"' in line
    ]
    assert any("flooded the channel" in str(e["reason"]) for e in restarts), restarts
