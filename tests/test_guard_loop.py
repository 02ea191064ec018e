"""The guard loop on a fixture /proc: bad input never kills, faults never stop it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings
from sparkwatch.guard.poolwatch import GuardLinks, PoolWatch
from tests.conftest import rewrite_in_place, wait_until

GB10 = (Path(__file__).parent / "fixtures" / "proc" / "meminfo.gb10-idle").read_text()


def low(avail_kb: int) -> str:
    return GB10.replace("118566368", str(avail_kb))


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    (root / "meminfo").write_text(GB10)
    return root


def make_guard(proc_root: Path, state_dir: Path, links: GuardLinks | None = None, **overrides: object) -> PoolWatch:
    settings = load_settings(
        overrides={"proc_root": proc_root, "state_dir": state_dir, "floor": "8GiB", "mlock": False, **overrides}
    )
    return PoolWatch.build(guard_config(settings), EventLog(settings.events_path), links or GuardLinks())


def test_garbled_meminfo_is_reported_never_a_kill(proc_root: Path, tmp_path: Path) -> None:
    guard = make_guard(proc_root, tmp_path / "state")
    guard.reaper.start()
    try:
        for garbage in ("", "MemTotal: 1 kB\n", "MemTotal: x kB\nMemFree: 1 kB\nMemAvailable: 0 kB\n", "\0" * 100):
            rewrite_in_place(proc_root / "meminfo", garbage)
            for _ in range(3):
                guard.tick()
        assert guard.stats.meminfo_errors_total == 12
        assert guard.stats.last_error is not None and "meminfo" in guard.stats.last_error
        assert guard.state.below_count == 0  # errors do not count toward the debounce
        time.sleep(0.2)
        assert read_events(guard.events.path) == []
        # The guard is still alive and acts on the next good sample.
        rewrite_in_place(proc_root / "meminfo", low(4839424))
        intervals_s = [guard.tick() for _ in range(3)]
        assert guard.stats.meminfo_errors_total == 12  # the good samples were read, not counted as errors
        assert guard.stats.mem is not None and guard.stats.mem.available_bytes == 4839424 * 1024
        assert all(0 < s <= 1.0 for s in intervals_s)  # the loop keeps polling at its bounds
        assert wait_until(lambda: bool(read_events(guard.events.path)), 5)
        (event,) = read_events(guard.events.path)
        assert event["kind"] == "no_victim"  # no engine in a fixture /proc: said so, nothing signalled
        assert event["mem_available_bytes"] == 4839424 * 1024
    finally:
        guard.reaper.stop()


def test_unwritable_state_dir_keeps_the_guard_running(
    proc_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    guard = make_guard(proc_root, blocker / "state")
    guard.reaper.start()
    try:
        rewrite_in_place(proc_root / "meminfo", low(4839424))
        for _ in range(3):
            guard.tick()
        assert wait_until(lambda: guard.events.write_errors_total == 1, 5)
        rewrite_in_place(proc_root / "meminfo", GB10)
        guard.tick()  # re-arms
        assert guard.state.armed
        rewrite_in_place(proc_root / "meminfo", low(4839424))
        for _ in range(3):
            guard.tick()
        assert wait_until(lambda: guard.events.write_errors_total == 2, 5)
    finally:
        guard.reaper.stop()
    err = capsys.readouterr().err
    assert "could not record no_victim event" in err
    assert "NO ENGINE TO KILL" in err


def test_loop_thread_polls_and_stops(proc_root: Path, tmp_path: Path) -> None:
    beats: list[float] = []
    guard = make_guard(proc_root, tmp_path / "state", GuardLinks(heartbeat=beats.append))
    guard.start()
    try:
        assert wait_until(lambda: len(beats) >= 2, 5)  # far from the floor: about one look a second
        assert guard.stats.poll_interval_s == guard.config.poll_max_s
        rewrite_in_place(proc_root / "meminfo", low(9 * 1024 * 1024))  # 1 GiB above the floor
        n = len(beats)
        assert wait_until(lambda: len(beats) >= n + 5, 5)  # near the floor it looks much more often
        assert guard.stats.poll_interval_s <= 0.1
    finally:
        t0 = time.monotonic()
        guard.stop()
        assert time.monotonic() - t0 < 2  # the wake pipe ends the sleep at once


def test_warm_scans_run_on_the_scout_near_the_floor_only(proc_root: Path, tmp_path: Path) -> None:
    guard = make_guard(proc_root, tmp_path / "state")
    guard.start()
    try:
        time.sleep(1.5)
        assert guard.warm_scans_total == 0  # 110 GiB above the floor: no scan at all
        rewrite_in_place(proc_root / "meminfo", low(10 * 1024 * 1024))  # 2 GiB above an 8 GiB floor, inside warn
        assert wait_until(lambda: guard.warm_scans_total >= 2, 5)
        assert guard.stats.poll_interval_s <= 0.2
    finally:
        guard.stop()
