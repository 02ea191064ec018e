"""HeadroomWatcher.apply: after a reload from an 8 GiB to a 2 GiB floor the low-headroom band follows at once (it
used to keep 8 GiB until a restart while the guard already used 2 GiB)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.telemetry.headroom import HeadroomWatcher

GiB = 1 << 30


def test_reload_moves_the_band(tmp_path: Path) -> None:
    available = [11 * GiB]
    events = EventLog(tmp_path / "events.jsonl")
    old = SimpleNamespace(floor=8 * GiB, warn_headroom=4 * GiB, rearm_headroom=GiB)
    new = SimpleNamespace(floor=2 * GiB, warn_headroom=4 * GiB, rearm_headroom=GiB)
    watch = HeadroomWatcher(old, lambda: available[0], events)
    assert watch.tick()  # 11 GiB is within 4 GiB of an 8 GiB floor
    assert watch.apply(new) == {"floor", "warn_headroom", "rearm_headroom"}
    available[0] = 8 * GiB  # above the new band + hysteresis (2 + 4 + 1 GiB): the episode ends
    assert not watch.tick()
    available[0] = 5 * GiB  # within 4 GiB of the new 2 GiB floor: a new episode, reported against 2 GiB
    assert watch.tick()
    last = read_events(tmp_path / "events.jsonl")[-1]
    assert last["floor_bytes"] == 2 * GiB and "2.0 GiB kill floor" in str(last["summary"])
