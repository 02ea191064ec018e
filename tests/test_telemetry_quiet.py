"""A box with nothing to watch is cycled once per QUIET_INTERVAL_S (telemetry.loop.quiet), and the first engine,
compiler or GPU process brings the configured cadence back at the next cycle."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from sparkwatch.common import syscalls
from sparkwatch.core.model import CompileCensus, EngineTree, GpuDevice, GpuProcess, GpuReport, Proc, Snapshot
from sparkwatch.telemetry import loop as loop_module
from sparkwatch.telemetry.loop import QUIET_INTERVAL_S, TelemetryLoop, quiet

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


def test_the_loop_waits_longer_after_a_quiet_cycle_and_not_after_a_busy_one() -> None:
    busy = replace(IDLE, compile=replace(NO_COMPILERS, parallel_jobs=2))
    loop = TelemetryLoop(Scripted([IDLE, IDLE, busy, IDLE]), 0.5, is_quiet=quiet)  # type: ignore[arg-type]
    waits: list[float] = []
    stop = threading.Event()

    def wait(delay: float | None = None) -> bool:  # the loop's only sleep: recorded, never slept
        waits.append(delay or 0.0)
        if len(waits) == 4:
            stop.set()
        return stop.is_set()

    loop._stop = stop
    stop.wait = wait  # type: ignore[method-assign,assignment]
    loop._run()
    # The wait never sleeps, so each delay is the schedule so far: its steps are the differences.
    steps = [round(b - a, 1) for a, b in zip([0.0, *waits], waits, strict=False)]
    assert steps == [QUIET_INTERVAL_S, QUIET_INTERVAL_S, 0.5, QUIET_INTERVAL_S]


def test_an_interval_longer_than_the_quiet_one_is_kept() -> None:
    loop = TelemetryLoop(Scripted([IDLE]), QUIET_INTERVAL_S * 2, is_quiet=quiet)  # type: ignore[arg-type]
    waits: list[float] = []
    stop = threading.Event()

    def wait(delay: float | None = None) -> bool:
        waits.append(delay or 0.0)
        if len(waits) == 2:
            stop.set()
        return stop.is_set()

    loop._stop = stop
    stop.wait = wait  # type: ignore[method-assign,assignment]
    loop._run()
    assert [round(b - a, 1) for a, b in zip([0.0, *waits], waits, strict=False)] == [QUIET_INTERVAL_S * 2] * 2


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
