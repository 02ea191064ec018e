"""A box with nothing to watch is cycled once per QUIET_INTERVAL_S (telemetry.loop.quiet), and the first engine,
compiler or GPU process brings the configured cadence back at the next cycle."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from sparkwatch.common import syscalls
from sparkwatch.common.launched import LaunchedWatch
from sparkwatch.core.model import CompileCensus, EngineTree, GpuDevice, GpuProcess, GpuReport, Proc, Snapshot
from sparkwatch.telemetry import loop as loop_module
from sparkwatch.telemetry.loop import QUIET_INTERVAL_S, TelemetryLoop, quiet
from tests.conftest import wait_until

NO_COMPILERS = CompileCensus(tools={"nvcc": 0}, rss_bytes=0, parallel_jobs=0, archs={})
IDLE = Snapshot(ts=1.0, compile=NO_COMPILERS)
ROOT = Proc(
    pid=10, ppid=1, uid=0, comm="VLLM::EngineCor", state="S", start_ticks=5, rss_bytes=1, argv=("VLLM::EngineCore",)
)


def gpu_with(processes: tuple[GpuProcess, ...]) -> GpuReport:
    device = GpuDevice(0, "GPU-1", "NVIDIA H200", "0000:01:00.0", False, processes=processes)
    return GpuReport(up=True, nvml_return_code=0, devices=(device,))


def test_only_a_box_with_nothing_to_watch_is_quiet() -> None:
    assert quiet(IDLE)
    assert quiet(replace(IDLE, gpu=gpu_with(())))  # a GPU nobody uses
    assert not quiet(replace(IDLE, engines=(EngineTree(kind="vllm", root=ROOT, members=(ROOT,)),)))
    assert not quiet(replace(IDLE, compile=replace(NO_COMPILERS, parallel_jobs=3)))
    assert not quiet(replace(IDLE, compile=replace(NO_COMPILERS, outside_engines=1)))
    assert not quiet(replace(IDLE, gpu=gpu_with((GpuProcess(77, 1 << 30, 0),))))
    assert not quiet(replace(IDLE, compile=None))  # no census this cycle: not known to be quiet


class Scripted:
    """Stands in for Telemetry: hands out the given snapshots, one a cycle."""

    def __init__(self, snapshots: list[Snapshot]) -> None:
        self.snapshots = snapshots

    def collect(self) -> Snapshot:
        return self.snapshots.pop(0) if len(self.snapshots) > 1 else self.snapshots[0]

    def drain_events(self) -> list[object]:
        return []

    def close(self) -> None:
        pass


def record_waits(loop: TelemetryLoop, count: int) -> list[float]:
    """Run the loop for `count` waits through its one sleep, recorded and never slept: each delay is then the
    schedule so far."""
    waits: list[float] = []

    def sleep(delay_s: float, quiet: bool, waker: object, not_before: float = 0.0) -> bool:
        waits.append(delay_s)
        if len(waits) == count:
            loop._stop.set()
        return False

    loop._sleep = sleep  # type: ignore[method-assign]
    loop._run()
    return [round(b - a, 1) for a, b in zip([0.0, *waits], waits, strict=False)]


def test_the_loop_waits_longer_after_a_quiet_cycle_and_not_after_a_busy_one() -> None:
    busy = replace(IDLE, compile=replace(NO_COMPILERS, parallel_jobs=2))
    loop = TelemetryLoop(Scripted([IDLE, IDLE, busy, IDLE]), 0.5, is_quiet=quiet)  # type: ignore[arg-type]
    assert record_waits(loop, 4) == [QUIET_INTERVAL_S, QUIET_INTERVAL_S, 0.5, QUIET_INTERVAL_S]


def test_an_interval_longer_than_the_quiet_one_is_kept() -> None:
    loop = TelemetryLoop(Scripted([IDLE]), QUIET_INTERVAL_S * 2, is_quiet=quiet)  # type: ignore[arg-type]
    assert record_waits(loop, 2) == [QUIET_INTERVAL_S * 2] * 2


def cycles_after(loop: TelemetryLoop, seconds: float) -> int:
    start = loop.cycles
    time.sleep(seconds)
    return loop.cycles - start


@contextmanager
def running(snapshot: Snapshot, interval_s: float, launched_dir: Path | None = None) -> Iterator[TelemetryLoop]:
    """A loop on its own thread that hands out `snapshot` every cycle, past its first cycle; with `launched_dir`,
    that directory is its declarations directory (as the daemon's Telemetry has one). Stopped on the way out."""
    scripted = Scripted([snapshot])
    if launched_dir is not None:
        launched_dir.mkdir()
        scripted.launched = LaunchedWatch((launched_dir,), None, "/proc")  # type: ignore[attr-defined]
    loop = TelemetryLoop(scripted, interval_s, is_quiet=quiet)  # type: ignore[arg-type]
    loop.start()
    try:
        assert wait_until(lambda: loop.cycles == 1, 5)
        yield loop
    finally:
        loop.stop()


def test_hurry_ends_a_quiet_wait_and_leaves_a_busy_one() -> None:
    """The guard near the floor, or a kill, ends a quiet wait at once; a wait at the configured interval stays."""
    busy = replace(IDLE, compile=replace(NO_COMPILERS, parallel_jobs=2))
    for snapshot, interval_s, expected in ((IDLE, 1.0, 1), (busy, 6.0, 0)):
        with running(snapshot, interval_s) as loop:
            time.sleep(0.2)  # in its wait
            assert cycles_after(loop, 0.5) == 0
            loop.hurry()
            assert cycles_after(loop, 1.0) == expected, snapshot


def test_a_launch_declaration_ends_a_quiet_wait(tmp_path: Path) -> None:
    """A declaration written while the loop waits quietly starts a cycle at once (the kernel's word through
    inotify): a launched engine's first boot phases are exported, not missed for QUIET_INTERVAL_S."""
    launched_dir = tmp_path / "launched"
    with running(IDLE, 1.0, launched_dir) as loop:
        time.sleep(0.2)
        assert cycles_after(loop, 0.5) == 0
        (launched_dir / "123.json").write_text("{}")
        assert wait_until(lambda: loop.cycles == 2, 1.0)


def test_a_directory_changing_over_and_over_costs_a_cycle_per_interval_at_most(tmp_path: Path) -> None:
    """Another user's files changing every 50 ms in a declarations directory wake a quiet wait, but the cycles stay
    the configured interval apart (here 1 s): 2 s of churn cost 2-3 cycles, not 40."""
    launched_dir = tmp_path / "launched"
    with running(IDLE, 1.0, launched_dir) as loop:
        start = loop.cycles
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            (launched_dir / "churn").write_text(str(time.monotonic()))
            time.sleep(0.05)
        assert 1 <= loop.cycles - start <= 3, loop.cycles - start


def test_the_heap_is_trimmed_after_the_first_cycle_then_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """By cycle count (every 60th) a quiet box trimmed first after five minutes: what start-up left free (imports,
    NVML's init) stayed resident until then."""
    trims: list[int] = []
    monkeypatch.setattr(syscalls, "trim_heap", lambda: trims.append(1))
    loop = TelemetryLoop(Scripted([IDLE]), 1.0, is_quiet=quiet)  # type: ignore[arg-type]
    for _ in range(3):
        loop.run_once()
    assert len(trims) == 1
    assert loop._trimmed_at is not None
    loop._trimmed_at -= loop_module.TRIM_EVERY_S
    loop.run_once()
    loop.run_once()
    assert len(trims) == 2
