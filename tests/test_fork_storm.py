"""A root with 1,000 children that keeps forking: one kill leaves no orphan (issue: the 4 KiB children read)."""

from __future__ import annotations

import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner, read_children
from tests.conftest import Spawner, alive, pids_in, wait_until
from tests.test_killer import kill_and_reap, trees_now

HELPER = Path(__file__).parent / "helpers" / "fork_storm.py"


def sleepers_with(token: str) -> list[int]:
    """Live processes whose argv is exactly `sleep TOKEN`: only this test starts them (the token is random)."""
    out = []
    for proc in ProcScanner().scan().procs:
        if len(proc.argv) == 2 and proc.argv[1] == token and proc.state != "Z":
            out.append(proc.pid)
    return out


@pytest.fixture
def token() -> Iterator[str]:
    value = f"{random.randint(100000, 999999)}.{os.getpid()}"
    yield value
    for pid in sleepers_with(value):  # whatever escaped: started by this test, identified by its unique argv
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_children_file_is_read_completely(spawner: Spawner, tmp_path: Path, token: str) -> None:
    pidfile = tmp_path / "storm.pids"
    root = spawner.popen(
        [
            sys.executable,
            str(HELPER),
            "--children",
            "1000",
            "--max-children",
            "1000",
            "--token",
            token,
            "--pidfile",
            str(pidfile),
        ]
    )
    spawner.pidfiles.append(pidfile)
    assert wait_until(lambda: pidfile.exists() and "ready" in pidfile.read_text(), 60)
    children = read_children("/proc", root.pid)
    assert children is not None
    # Well over one 4 KiB page of pids: a single read() would have stopped at ~680.
    assert len(children) >= 1000, len(children)


@pytest.mark.slow
def test_root_with_1000_children_that_keeps_forking_leaves_no_orphan(
    spawner: Spawner, tmp_path: Path, token: str
) -> None:
    pidfile = tmp_path / "storm.pids"
    root = spawner.popen(
        [
            sys.executable,
            str(HELPER),
            "--children",
            "1000",
            "--max-children",
            "3000",
            "--every-ms",
            "1",
            "--token",
            token,
            "--pidfile",
            str(pidfile),
        ]
    )
    spawner.pidfiles.append(pidfile)
    assert wait_until(lambda: pidfile.exists() and "ready" in pidfile.read_text(), 60)
    trees = trees_now()
    assert [t.root.pid for t in trees] == [root.pid]
    assert len(trees[0].members) > 1000
    _facts, notes, _method = kill_and_reap(trees)
    assert not alive(root.pid)
    recorded = pids_in(pidfile)
    survivors = [pid for pid, (ticks, _) in recorded.items() if alive(pid, ticks)]
    assert survivors == [], f"{len(survivors)} recorded children survived; notes: {notes}"
    # Children forked after the root's last record are found by their unique argv.
    assert wait_until(lambda: sleepers_with(token) == [], 10), sleepers_with(token)


def test_engine_kind_cache_stays_bounded_under_churn() -> None:
    """Every new argv is a new cache key; the cache forgets the dead ones instead of growing to its hard cap."""
    from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
    from sparkwatch.core.livecache import DEAD_SLACK
    from sparkwatch.core.model import Proc

    rules = EngineRules.build()
    scope = Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=os.getpid())
    live: list[Proc] = []
    for i in range(20_000):  # 20,000 short-lived processes, 100 alive at a time
        live.append(Proc(pid=10_000 + i, ppid=1, uid=0, comm="sleep", state="S", start_ticks=i, rss_bytes=0,
                         argv=("sleep", f"{i}.5")))  # fmt: skip
        live = live[-100:]
        find_engine_trees(live, rules, scope)
        assert len(rules.kind_cache) <= len(live) + DEAD_SLACK + 1
