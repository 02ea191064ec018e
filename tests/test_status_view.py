"""The status frame's pure parts: trends, bars and rows, rendered without a terminal."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC

from rich.console import Console

from sparkwatch.core.enums import JitState, MaxJobsState
from sparkwatch.core.model import (
    BootState,
    CollectorStatus,
    CompileCensus,
    EngineCompile,
    EngineTree,
    GpuDevice,
    GpuReport,
    JitCacheState,
    JitEngineState,
    MemInfo,
    Proc,
    Snapshot,
)
from sparkwatch.core.report.gates import GatedView
from sparkwatch.core.report.guardstate import GuardState
from sparkwatch.core.report.trend import BuildRate, PoolTrend, build_rate, pool_trend, slope_per_s
from sparkwatch.core.units import GiB, MiB
from sparkwatch.tui.status_view import (
    CACHE,
    FLOOR_MARK,
    USED,
    WARN_MARK,
    BuildView,
    StatusFrame,
    fmt_duration,
    pool_bar,
    render,
    trend_line,
)
from tests.helpers.scenario import stranded_driver

GB10 = MemInfo(
    total_bytes=127600748 * 1024,
    available_bytes=118566368 * 1024,
    free_bytes=117873224 * 1024,
    buffers_bytes=61372 * 1024,
    cached_bytes=1497120 * 1024,
    swap_total_bytes=0,
    swap_free_bytes=0,
)


def text_of(renderable: object, width: int = 140) -> str:
    console = Console(width=width, color_system=None, force_terminal=False, record=True)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


# --- trends


def test_slope_needs_history_then_fits() -> None:
    assert slope_per_s([(0.0, 1.0)]) is None
    assert slope_per_s([(0.0, 1.0), (1.0, 2.0)]) is None  # under MIN_SPAN_S
    slope = slope_per_s([(float(t), 100.0 - 3 * t) for t in range(6)])
    assert slope is not None and abs(slope + 3.0) < 1e-9


def test_pool_trend_falling_gives_time_to_floor() -> None:
    # 40 -> 30 GiB over 5 s: 2 GiB/s, 22 GiB above an 8 GiB floor: 11 s.
    samples = [(float(t), (40 - 2 * t) * GiB) for t in range(6)]
    trend = pool_trend(samples, 8 * GiB)
    assert trend.fill_rate_bytes_per_s is not None and abs(trend.fill_rate_bytes_per_s - 2 * GiB) < 1
    assert trend.seconds_to_floor is not None and abs(trend.seconds_to_floor - 11.0) < 1e-6


def test_pool_trend_rising_has_no_time_to_floor() -> None:
    trend = pool_trend([(float(t), (10 + t) * GiB) for t in range(6)], 8 * GiB)
    assert trend.fill_rate_bytes_per_s is not None and trend.fill_rate_bytes_per_s < 0
    assert trend.seconds_to_floor is None


def test_build_rate_and_eta() -> None:
    # 4 objects in 60 s, 36 left: 0.0667 objects/s, 540 s.
    samples = [(0.0, 10.0), (20.0, 11.0), (40.0, 13.0), (60.0, 14.0)]
    rate = build_rate(samples, 50)
    assert rate.objects_per_s is not None and abs(rate.objects_per_s - 4 / 60) < 1e-9
    assert rate.eta_s is not None and abs(rate.eta_s - 540.0) < 1e-6
    assert rate.idle_s == 0.0


def test_build_rate_idle_and_reset() -> None:
    stuck = build_rate([(0.0, 5.0), (10.0, 6.0), (30.0, 6.0), (50.0, 6.0)], 10)
    assert stuck.idle_s == 40.0
    # A count that drops (cache cleared) restarts the history there.
    reset = build_rate([(0.0, 30.0), (1.0, 0.0), (2.0, 1.0), (4.0, 2.0)], 10)
    assert reset.objects_per_s is not None and abs(reset.objects_per_s - 2 / 3) < 1e-9


def test_fmt_duration() -> None:
    assert [fmt_duration(s) for s in (0, 4.9, 192, 7500, 3 * 86400 + 4 * 3600)] == [
        "0 s",
        "4 s",
        "3m12s",
        "2h05m",
        "3d04h",
    ]


# --- the pool bar


def test_pool_bar_marks_floor_and_warn_where_used_would_reach_them() -> None:
    mem = GB10
    bar = pool_bar(mem, 8 * GiB, 4 * GiB, 100).plain
    assert len(bar) == 100
    total = mem.total_bytes
    assert bar.index(FLOOR_MARK) == round((total - 8 * GiB) / total * 100)
    assert bar.index(WARN_MARK) == round((total - 12 * GiB) / total * 100)
    assert bar.count(USED) == round(mem.used_bytes / total * 100)
    assert bar.startswith(USED * 7 + CACHE)  # 9 GiB used of 122 GiB, then the page cache


def test_pool_bar_full_pool_runs_through_the_marks() -> None:
    mem = MemInfo(100 * GiB, 2 * GiB, GiB, 0, GiB, 0, 0)
    bar = pool_bar(mem, 8 * GiB, 4 * GiB, 50).plain
    assert bar.index(FLOOR_MARK) == 46 and bar.index(WARN_MARK) == 44
    assert set(bar[:44]) == {USED}


def test_trend_lines() -> None:
    def line(rate: float | None, eta: float | None) -> str:
        frame = _frame(trend=PoolTrend(rate, eta))
        return trend_line(frame).plain

    assert line(None, None).startswith("fill rate: measuring")
    assert line(10 * MiB, 1000.0) == "fill rate: steady (-10 MiB/s)"
    assert line(-GiB, None) == "fill rate: rising 1.00 GiB/s (memory coming back)"
    assert line(2 * GiB, 11.0) == "fill rate: falling 2.00 GiB/s · floor in 11 s"


# --- a whole frame


def _proc(pid: int, ppid: int, comm: str, title: str | None = None, rss: int = 100 * MiB) -> Proc:
    return Proc(pid, ppid, 1000, comm, "S", pid, rss, (title or comm,))


def _frame(**changes: object) -> StatusFrame:
    root = _proc(4242, 1, "VLLM::EngineCor", "VLLM::EngineCore", rss=GiB)
    tree = EngineTree("vllm", root, (root, _proc(4243, 4242, "ninja"), _proc(4244, 4243, "nvcc")))
    cache = JitCacheState(
        cache="flashinfer",
        version="0.2.8",
        arch="121a",
        path="/home/u/.cache/flashinfer/0.2.8/121a",
        bytes=300 * MiB,
        files=120,
        last_change_ts=1_795_000_000.0 - 4,
        objects_done=12,
        objects_total=40,
        modules_total=10,
        modules_built=3,
    )
    snap = Snapshot(
        ts=1_795_000_000.0,
        mem=GB10,
        engines=(tree,),
        compile=CompileCensus(
            tools={"nvcc": 4, "cicc": 4, "ninja": 1, "ptxas": 0},
            rss_bytes=20 * GiB,
            parallel_jobs=8,
            archs={"121a": 8},
            engines=(
                EngineCompile(
                    "vllm", 4242, {"nvcc": 4, "cicc": 4, "ninja": 1}, 20 * GiB, MaxJobsState.UNSET, None, "raylet"
                ),
            ),
        ),
        jit=(cache,),
        jit_states=(JitEngineState("vllm", 4242, JitState.COMPILING, 1_795_000_000.0 - 192, "9 compiler processes"),),
        collectors=(CollectorStatus("gpu", False, 0.01, "NVMLError_LibraryNotFound"),),
    )
    fields: dict[str, object] = {
        "snapshot": snap,
        "host": "spark-a",
        "floor_bytes": 8 * GiB,
        "warn_headroom_bytes": 4 * GiB,
        "compile_jobs_alert": 8,
        "trend": PoolTrend(None, None),
        "builds": (BuildView(cache, BuildRate(4 / 60, 420.0, 0.0)),),
        "last_kill": None,
        "events_path": "/var/lib/sparkwatch/events.jsonl",
        "started_ts": 1_795_000_000.0 - 600,
    }
    fields.update(changes)
    return StatusFrame(**fields)  # type: ignore[arg-type]


def test_frame_rows_answer_is_it_hung() -> None:
    out = text_of(render(_frame(), 140, tz=UTC))
    lines = out.splitlines()
    assert lines[0] == "sparkwatch status · spark-a · 2026-11-18 11:06:40"
    assert "ENGINES    vllm 4242 · VLLM::EngineCore · 3 processes · RSS 1.2 GiB · JIT compiling for 3m12s" in out
    assert "COMPILERS  9 processes, 20.0 GiB RSS: nvcc 4 · cicc 4 · ninja 1" in out
    assert "8 parallel nvcc/cicc jobs · arch 121a" in out
    assert "vllm 4242: nvcc 4 · cicc 4 · ninja 1 · MAX_JOBS unset in the raylet's environment" in out
    (jit,) = [line for line in lines if line.startswith("JIT")]
    assert "flashinfer 0.2.8 121a" in jit
    assert "12/40 objects · 3/10 modules · 4.0 objects/min · ETA 7m00s · changed 4 s ago" in jit
    assert "░" in jit and "█" in jit
    assert "GPU        no GPU source" in out
    assert "LAST KILL  none recorded in /var/lib/sparkwatch/events.jsonl" in out
    assert "ERRORS     gpu: NVMLError_LibraryNotFound" in out


def test_frame_with_a_gpu_report_and_a_driver_verdict() -> None:
    # A GB10 as NVML reports it: memory and power limit unsupported (None), the rest answered.
    gb10 = GpuDevice(
        index=0,
        uuid="GPU-1",
        name="NVIDIA GB10",
        bus_id="0000000F:01:00.0",
        unified=True,
        power_watts=12.4,
        utilization_ratio=0.0,
        temperature_celsius=41.0,
        sm_clock_hertz=2.418e9,
    )
    report = GpuReport(up=True, nvml_return_code=0, driver_version="580.95.05", devices=(gb10,))
    stranded = replace(
        stranded_driver(), summary="kernel 6.11.0-1016-nvidia has no NVIDIA modules; reboot into 6.17.0-1008-nvidia"
    )
    snap = Snapshot(ts=1_795_000_000.0, mem=GB10, gpu=report, driver=stranded)
    out = text_of(render(_frame(snapshot=snap, builds=()), 140, tz=UTC))
    assert "GPU        NVIDIA GB10 · 12 W · 0 % util · 41 °C · SM 2.42 GHz · driver 580.95.05" in out
    assert "DRIVER     stranded: kernel 6.11.0-1016-nvidia has no NVIDIA modules" in out
    assert "ENGINES    no engine processes" in out
    assert "COMPILERS  compiler census unavailable this cycle" in out
    # A missing field is left out, never printed as 0.
    bare = GpuReport(up=True, nvml_return_code=0, devices=(GpuDevice(0, "GPU-1", "NVIDIA GB10", "b", True),))
    out = text_of(render(_frame(snapshot=Snapshot(ts=snap.ts, mem=GB10, gpu=bare)), 140, tz=UTC))
    assert "GPU        NVIDIA GB10\n" in out + "\n"


def test_a_gpu_that_is_down_and_a_failed_driver_check_say_why() -> None:
    snap = Snapshot(ts=1_795_000_000.0, mem=GB10, gpu=GpuReport(up=False, nvml_return_code=9))
    out = text_of(render(_frame(snapshot=snap, driver_error="PermissionError: /var/lib/dpkg/status"), 140, tz=UTC))
    assert "GPU        GPU not available: NVML error 9" in out
    assert "DRIVER     driver check failed: PermissionError: /var/lib/dpkg/status" in out
    none = text_of(render(_frame(snapshot=Snapshot(ts=snap.ts, mem=GB10)), 140, tz=UTC))
    assert "GPU        no GPU source" in none and "DRIVER     not checked yet" in none


def test_a_finished_quiet_cache_is_one_short_line() -> None:
    cache = JitCacheState("flashinfer", "0.2.7", "121a", "/c", 900 * MiB, 4000, 1_795_000_000.0 - 86400, 40, 40, 10, 10)
    out = text_of(render(_frame(builds=(BuildView(cache, BuildRate(None, None, 0.0)),)), 140, tz=UTC))
    assert "flashinfer 0.2.7 121a  complete: 40 objects, 10 modules, 900 MiB · changed 1d00h ago" in out


def test_the_guard_row_and_a_launched_engines_boot_phase() -> None:
    now = 1_795_000_000.0
    boot = BootState(4242, "vllm", "/models/Qwen3-32B", "jit_compile", now - 192, now - 300, budget_bytes=60 * GiB)
    snap = replace(_frame().snapshot, boots=(boot, BootState(5151, "sglang", "m", "ready", now - 60, now - 200, 140.0)))
    armed = GuardState(77, 1, 0, False, 8 * GiB, 0, 1, ((4242, 9),), now)
    out = text_of(render(_frame(snapshot=snap, guards=(armed,)), 160, tz=UTC))
    assert "GUARD      guard pid 77 (root), armed, floor 8.0 GiB, 1 budget, 1 launched engine\n" in out
    engines = out.split("ENGINES", 1)[1]
    assert (
        "vllm 4242 · VLLM::EngineCore · 3 processes · RSS 1.2 GiB · launched: phase jit_compile for 3m12s, " in engines
    )
    assert "budget 60.0 GiB · JIT compiling" in engines
    # Declared, but not an engine tree in this cycle's scan: still shown, with its phase.
    assert "sglang 5151 · m · launched: phase ready for 1m00s (ready after 2m20s)" in engines
    dry = replace(armed, uid=1000, dry_run=True, budget_rules=2, declared_budgets=0, taken=())
    out = text_of(render(_frame(guards=(dry,), guard_notes=("/run/sparkwatch/guard.json is stale: …",)), 160))
    assert "GUARD      guard pid 77 (uid 1000), DRY RUN (records, kills nothing), floor 8.0 GiB, 2 budgets\n" in out
    assert "           /run/sparkwatch/guard.json is stale: …\n" in out
    none = text_of(render(_frame(), 160))
    assert "GUARD      no guard is running: nothing is killed before the pool runs out\n" in none


def test_a_container_the_after_kill_gate_holds_is_its_own_row() -> None:
    """A restart after a guard kill, paused until the pool can take it (telemetry.afterkill): named as `docker ps`
    shows it, since when, and what it waits for; no row when none is held."""
    held = GatedView("3f2a" * 16, "vllm-qwen", "nvcr.io/nvidia/vllm:25.09", "2026-11-18T11:06:00.000Z", 61 * GiB,
                     "kill footprint")  # fmt: skip
    out = text_of(render(_frame(gated=(held,)), 300, tz=UTC), width=300)
    (row,) = [line for line in out.splitlines() if line.startswith("GATED")]
    assert "vllm-qwen (nvcr.io/nvidia/vllm:25.09, 3f2a3f2a3f2a) paused since 2026-11-18 11:06:00 (40 s)" in row
    assert "unpaused once the pool has settled and 61.0 GiB (kill footprint) fits" in row
    assert "GATED" not in text_of(render(_frame(), 300, tz=UTC), width=300)
