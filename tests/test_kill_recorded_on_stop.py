"""A kill is recorded even when the daemon is stopped before the kill's settle time is over (SIGTERM, a restart)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import read_events
from tests.conftest import Spawner, floor_that_fires_at_once, wait_until
from tests.daemon import sparkwatch_run


@pytest.mark.slow
def test_a_kill_is_recorded_when_the_daemon_stops_during_its_settle_time(spawner: Spawner, tmp_path: Path) -> None:
    engine = spawner.popen(
        [sys.executable, "-c", "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); "
         "time.sleep(120)"]
    )  # fmt: skip
    assert wait_until(lambda: Path(f"/proc/{engine.pid}/cmdline").read_bytes().startswith(b"VLLM::"), 10)
    env = {
        "SPARKWATCH_FLOOR": f"{floor_that_fires_at_once()}B",
        "SPARKWATCH_REARM_HEADROOM": "1MiB",
        "SPARKWATCH_MLOCK": "false",
        "SPARKWATCH_KILL_SETTLE_S": "10",  # the event would be written 10 s after the reap
    }
    with sparkwatch_run(tmp_path, env=env) as d:
        assert wait_until(lambda: engine.poll() is not None, 30)
        d.proc.terminate()  # well inside the settle time
        assert d.proc.wait(15) == 0
        stderr = list(d.stderr_lines)
    kills = [e for e in read_events(tmp_path / "state" / "events.jsonl") if e["kind"] == "kill"]
    assert len(kills) == 1, stderr
    kill = kills[0]
    assert [v["pid"] for v in kill["victims"]] == [engine.pid]
    assert kill["signal_to_reaped_ms"] is not None and kill["survivors"] == []
    assert kill["mem_available_after_settle_bytes"] is not None
    after = re.search(r"MemAvailable was .* ([\d.]+) s after the reap", kill["summary"])
    assert after is not None and float(after.group(1)) < 10, kill["summary"]  # what was waited, not the setting
