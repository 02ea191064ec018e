"""Caches keyed by a process keep only live processes' entries, plus a small slack (sparkwatch/core/livecache.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.core.livecache import DEAD_SLACK, LiveCache
from sparkwatch.telemetry.sources.procenv import EnvironReader


def test_a_cut_waits_for_the_slack_and_builds_live_keys_only_then() -> None:
    calls: list[int] = []

    def live() -> set[int]:
        calls.append(1)
        return {1, 2}

    cache: LiveCache[int, str] = LiveCache()
    for k in range(DEAD_SLACK):
        cache.put(k, str(k))
    assert not cache.forget_dead(live) and calls == []
    cache.put(999, "dead")
    assert cache.forget_dead(live) and calls == [1]
    assert len(cache) == 2 and cache.get(1) == "1" and 999 not in cache
    # The next cut counts from what survived: DEAD_SLACK more entries, not DEAD_SLACK more than a process count.
    for k in range(100, 100 + DEAD_SLACK):
        cache.put(k, str(k))
    assert not cache.forget_dead(live)
    cache.put(7, "7")
    assert cache.forget_dead(live) and len(cache) == 2


def test_the_hard_cap_holds_for_a_caller_that_never_cuts() -> None:
    cache: LiveCache[int, int] = LiveCache(hard_max=100)
    for k in range(1000):
        cache.put(k, k)
        assert len(cache) <= 100


def test_scanner_and_environ_caches_follow_real_process_churn() -> None:
    """Waves of real short-lived processes (more than the slack each): the scan that sees the next wave cuts the
    previous, dead wave's entries from the scanner's cache and from the environment cache."""
    scanner = ProcScanner()
    environ = EnvironReader(Path("/proc"), ["PATH"])
    dead: set[int] = set()
    for _wave in range(4):
        wave = [subprocess.Popen(["sleep", "30"]) for _ in range(2 * DEAD_SLACK)]
        pids = {w.pid for w in wave}
        try:
            procs = scanner.scan().procs
            mine = [p for p in procs if p.pid in pids]
            assert len(mine) == len(wave)
            for p in mine:
                environ.read(p.pid, p.start_ticks)
            environ.forget_dead(procs)
            assert not {key[0] for key in scanner._cache._data} & dead, "the scanner still holds a dead wave"
            assert not {key[0] for key in environ._cache._data} & dead, "the environment cache holds a dead wave"
            assert len(scanner._cache) <= len(procs) + DEAD_SLACK
        finally:
            for w in wave:
                w.kill()
                w.wait()
        dead = pids - {p.pid for p in scanner.scan().procs}  # less any pid the kernel already handed out again
