"""The guard loop's kill path with a fixture meminfo and real engine processes.

The fixture /proc holds a meminfo file the test rewrites, and links to the real /proc/<pid> of the engine trees this
test started (nothing else), so the guard scans, pins and signals real processes while the test decides what
MemAvailable reads. GPU bytes come through the guard's injection point, as telemetry provides them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings
from sparkwatch.core.kill import policy
from sparkwatch.core.units import GiB, MiB
from sparkwatch.guard.poolwatch import GpuBytesSource, GuardLinks, PoolWatch
from tests.conftest import Spawner, alive, pids_in, rewrite_in_place, wait_until

GB10 = (Path(__file__).parent / "fixtures" / "proc" / "meminfo.gb10-idle").read_text()
LOW = GB10.replace("118566368", str(4839424))  # 4.6 GiB: under an 8 GiB floor


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    (root / "meminfo").write_text(GB10)
    return root


def link_tree(proc_root: Path, pidfile: Path) -> dict[int, tuple[int, str]]:
    pids = pids_in(pidfile)
    for pid in pids:
        (proc_root / str(pid)).symlink_to(f"/proc/{pid}")
    return pids


def make_guard(proc_root: Path, state_dir: Path, gpu: GpuBytesSource | None = None) -> PoolWatch:
    settings = load_settings(
        overrides={
            "proc_root": proc_root,
            "state_dir": state_dir,
            "floor": "8GiB",
            "mlock": False,
            "ancestor_pid": os.getpid(),
        }
    )
    return PoolWatch.build(guard_config(settings), EventLog(settings.events_path), GuardLinks(gpu_bytes_by_pid=gpu))


def test_memory_recovered_while_choosing_cancels_the_kill(spawner: Spawner, proc_root: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--worker", "VLLM::Worker_TP0", pidfile=pidfile, wait_for=2)
    pids = link_tree(proc_root, pidfile)

    def gpu_and_recovery() -> policy.GpuBytes | None:
        # Called while the guard ranks its victims: memory comes back right then (an engine freed its cache).
        rewrite_in_place(proc_root / "meminfo", GB10)
        return None

    guard = make_guard(proc_root, tmp_path / "state", gpu_and_recovery)
    guard.reaper.start()
    try:
        rewrite_in_place(proc_root / "meminfo", LOW)
        for _ in range(3):
            guard.tick()
            if not guard.stats.cancelled_total:
                rewrite_in_place(proc_root / "meminfo", LOW)
        assert guard.stats.cancelled_total == 1
        assert wait_until(lambda: bool(read_events(guard.events.path)), 5)
        time.sleep(0.3)
        kinds = [e["kind"] for e in read_events(guard.events.path)]
        assert kinds == ["kill_cancelled"]
        (event,) = read_events(guard.events.path)
        assert int(event["mem_available_now_bytes"]) == 118566368 * 1024
        assert all(alive(pid, ticks) for pid, (ticks, _) in pids.items())  # nothing was signalled
        assert guard.state.phase == "watch"
    finally:
        guard.reaper.stop()


def meminfo_at(available_bytes: int) -> str:
    return GB10.replace("118566368", str(available_bytes // 1024))


@pytest.mark.parametrize(
    ("moved_mib", "cancelled"),
    [
        (0, False),  # a pause in a bursty fill: the first rule ("stopped falling") cancelled here, and the floor fell
        (16, False),  # noise
        (8192, True),  # memory came back: at the fill rate, the floor is now seconds away
    ],
)
def test_a_predicted_kill_is_cancelled_only_when_memory_came_back(
    spawner: Spawner, proc_root: Path, tmp_path: Path, moved_mib: int, cancelled: bool
) -> None:
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--worker", "VLLM::Worker_TP0", pidfile=pidfile, wait_for=2)
    pids = link_tree(proc_root, pidfile)
    decided = 8 * GiB + 64 * MiB  # a few GiB/s of fill: the floor is well within the 0.25 s kill budget

    def moved_while_choosing() -> policy.GpuBytes | None:
        rewrite_in_place(proc_root / "meminfo", meminfo_at(decided + moved_mib * MiB))
        return None

    guard = make_guard(proc_root, tmp_path / "state", moved_while_choosing)
    assert guard.config.floor == 8 * GiB
    guard.reaper.start()
    try:
        rewrite_in_place(proc_root / "meminfo", meminfo_at(decided))
        # The state after one predicted sample of a fast fill (2 GiB/s, and 1 GiB in the last 50 ms): the next one
        # fires. The margins hold if this test is descheduled for up to 2 s before the tick (a loaded box).
        guard.state = replace(
            guard.state,
            last_t=time.monotonic() - 0.05,
            last_available_bytes=decided + GiB,
            fill_rate_bytes_per_s=2.0 * GiB,
            predict_count=1,
        )
        guard.tick()
        assert guard.stats.cancelled_total == int(cancelled)
        assert guard.stats.kills_total == ({} if cancelled else {"predicted": 1})
        if cancelled:
            assert all(alive(pid, ticks) for pid, (ticks, _) in pids.items())
        else:
            assert wait_until(lambda: not any(alive(p, t) for p, (t, _) in pids.items()), 10)
    finally:
        guard.reaper.stop()


def test_the_kill_record_holds_the_victims_rss_and_gpu_bytes(spawner: Spawner, proc_root: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--worker", "VLLM::Worker_TP0", "--ignore-term", pidfile=pidfile, wait_for=2)
    pids = link_tree(proc_root, pidfile)
    worker = next(pid for pid, (_t, role) in pids.items() if role == "worker")
    # Telemetry's last per-pid reading: the worker holds 20 GiB of GPU memory; a pid outside the tree is ignored.
    guard = make_guard(proc_root, tmp_path / "state", lambda: (time.monotonic(), {worker: 20 * GiB, 1: 5 * GiB}))
    guard.reaper.start()
    try:
        rewrite_in_place(proc_root / "meminfo", LOW)
        for _ in range(3):
            guard.tick()
        assert wait_until(lambda: not any(alive(p, t) for p, (t, _) in pids.items()), 10)
        assert wait_until(lambda: any(e["kind"] == "kill" for e in read_events(guard.events.path)), 10)
        (kill,) = [e for e in read_events(guard.events.path) if e["kind"] == "kill"]
        assert kill["victim_gpu_bytes"] == 20 * GiB
        assert int(kill["victim_rss_bytes"]) > 0
        assert kill["mem_available_after_settle_bytes"] == 4839424 * 1024  # what MemAvailable read, not a guess
        assert "GPU 20.0 GiB" in " ".join(kill["why"])
        assert "the victims held" in str(kill["summary"]) and "20.0 GiB of GPU memory" in str(kill["summary"])
    finally:
        guard.reaper.stop()


def make_budget_guard(proc_root: Path, state_dir: Path, **overrides: object) -> PoolWatch:
    settings = load_settings(
        overrides={
            "proc_root": proc_root,
            "state_dir": state_dir,
            "floor": "8GiB",
            "mlock": False,
            "ancestor_pid": os.getpid(),
            "engine_budgets": ["1MiB=sw-budget-me"],  # killed past 1 MiB + the 256 MiB margin
            **overrides,
        }
    )
    return PoolWatch.build(guard_config(settings), EventLog(settings.events_path))


def ticked(guard: PoolWatch, done: Callable[[], bool]) -> Callable[[], bool]:
    """A wait_until predicate that ticks the guard once per look (budgets sample on the tick)."""

    def look() -> bool:
        guard.tick()
        return done()

    return look


def test_a_budget_kill_goes_through_the_teardown_like_any_other(
    spawner: Spawner, proc_root: Path, tmp_path: Path
) -> None:
    """A budget kill is the kill path's, as a floor kill is: the episode's teardown holds it (a floor crossing now
    waits for its memory, and the tree is never chosen again), and the episode ends once it is reaped and memory is
    back. Before, the budget killed beside core.kill.trigger's state, which stayed in `watch`, armed."""
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--title", "VLLM::EngineCore_sw-budget-me", "--hog-rate-mib", "600", "--hog-limit-mib", "320",
                   pidfile=pidfile, wait_for=2)  # fmt: skip
    pids = link_tree(proc_root, pidfile)
    guard = make_budget_guard(proc_root, tmp_path / "state")
    guard.reaper.start()
    try:
        assert wait_until(ticked(guard, lambda: guard.stats.kills_total.get("budget") == 1), 20)
        assert guard.stats.phase == "teardown" and guard.stats.armed is False  # MemAvailable is 113 GiB
        assert wait_until(lambda: not any(alive(p, t) for p, (t, _) in pids.items()), 10)
        # Reaped (the reaper said so), settled, and far above the floor: the episode ends.
        assert wait_until(ticked(guard, lambda: guard.stats.phase == "watch" and guard.stats.armed), 10)
        assert guard.stats.kills_total == {"budget": 1}
    finally:
        guard.reaper.stop()


def test_a_tree_chosen_under_the_floor_is_not_chosen_again_for_its_budget(
    spawner: Spawner, proc_root: Path, tmp_path: Path
) -> None:
    """One tree, one decision per episode, whichever trigger came first: in dry run the floor chooses the tree, and
    its budget, past a moment later, finds it already this episode's victim (before, a second would_kill)."""
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--title", "VLLM::EngineCore_sw-budget-me", "--hog-rate-mib", "600", "--hog-limit-mib", "320",
                   pidfile=pidfile, wait_for=2)  # fmt: skip
    link_tree(proc_root, pidfile)
    guard = make_budget_guard(proc_root, tmp_path / "state", dry_run=True)
    guard.reaper.start()
    try:
        rewrite_in_place(proc_root / "meminfo", LOW)
        assert wait_until(ticked(guard, lambda: any(t.killed for t in guard.budgets.tracked.values())), 20)
        assert guard.stats.would_kills_total == {"floor": 1}
        assert wait_until(lambda: any(e["kind"] == "would_kill" for e in read_events(guard.events.path)), 5)
        time.sleep(0.3)  # the reaper writes in order: a second decision would be there by now
        assert [e["trigger"] for e in read_events(guard.events.path) if e["kind"] == "would_kill"] == ["floor"]
    finally:
        guard.reaper.stop()


def test_a_reload_lands_between_ticks_whole(proc_root: Path, tmp_path: Path) -> None:
    """A tick decides under one config snapshot: a reload that lands in the middle of a tick (here from the budgets'
    look, where telemetry's engine count is read) takes effect at the next tick, whole. Before, the rest of the tick
    read the new floor beside the old floor's decision."""
    overrides = {"proc_root": proc_root, "state_dir": tmp_path / "state", "warn_headroom": "4GiB", "mlock": False}
    settings = load_settings(overrides={**overrides, "floor": "8GiB"})
    lower = guard_config(load_settings(overrides={**overrides, "floor": "6GiB"}))
    rewrite_in_place(proc_root / "meminfo", GB10.replace("118566368", str(11 * 1024 * 1024)))  # 11 GiB available
    applied: list[frozenset[str]] = []

    def engines_hint() -> int | None:
        if not applied:
            applied.append(guard.reconfigure(lower))  # SIGHUP's reload thread, mid-tick
        return None

    guard = PoolWatch.build(
        guard_config(settings), EventLog(settings.events_path), GuardLinks(engines_hint=engines_hint)
    )
    try:
        guard.tick()
        assert applied and "floor" in applied[0] and guard.config.floor == 6 * GiB
        assert guard.near_floor  # this tick: 11 GiB is within the old floor's band (8 + 4 GiB)
        guard.tick()
        assert not guard.near_floor  # the next: 11 GiB is outside the new floor's (6 + 4 GiB)
    finally:
        guard.meminfo.close()  # never started: nothing else to stop
