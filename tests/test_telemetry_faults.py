"""Faults: each one leaves every other series intact, and says what is wrong through collector_success."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings
from sparkwatch.core.model import GpuReport, Snapshot
from sparkwatch.guard.poolwatch import PoolWatch
from sparkwatch.telemetry.exporter.server import build_registry, render
from sparkwatch.telemetry.loop import Telemetry, TelemetryLoop
from tests.conftest import Spawner, alive, pids_in, wait_until
from tests.helpers.proctree import FIXED_MTIME, GB10_MEMINFO, write_module
from tests.helpers.scenario import build_scenario


def families(text: bytes) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def expose(snap: Snapshot, settings: object = None) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    s = settings if settings is not None else load_settings(None, {})
    return families(render(build_registry(s, lambda: snap)))  # type: ignore[arg-type]


def success(m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> float:
    return m["sparkwatch_collector_success"][(("collector", name),)]


def test_meminfo_without_psi(tmp_path: Path) -> None:
    settings = build_scenario(tmp_path, psi=False)
    snap = Telemetry(settings).collect()
    assert snap.psi is None and snap.mem is not None
    m = expose(snap, settings)
    assert "sparkwatch_memory_pressure_stalled_seconds_total" not in m  # absent, never 0
    assert success(m, "psi") == 1
    assert m["sparkwatch_memory_available_bytes"][()] == 118566368 * 1024
    assert m["sparkwatch_compile_parallel_jobs"][()] == 5


def test_garbled_meminfo_fails_only_meminfo(tmp_path: Path) -> None:
    settings = build_scenario(tmp_path)
    (settings.proc_root / "meminfo").write_text(GB10_MEMINFO.replace("MemAvailable:   118566368 kB", "MemAvailable: x"))
    snap = Telemetry(settings).collect()
    assert snap.mem is None
    (meminfo,) = [c for c in snap.collectors if c.name == "meminfo"]
    assert not meminfo.success and meminfo.error is not None and "MemAvailable" in meminfo.error
    m = expose(snap, settings)
    assert success(m, "meminfo") == 0 and success(m, "procs") == 1
    assert "sparkwatch_memory_available_bytes" not in m
    assert m["sparkwatch_memory_floor_bytes"][()] == settings.floor
    assert m["sparkwatch_compile_processes"][(("tool", "nvcc"),)] == 3


def test_unreadable_environ_is_unknown(tmp_path: Path) -> None:
    snap = Telemetry(build_scenario(tmp_path)).collect()
    assert snap.compile is not None
    by_root = {e.root_pid: e for e in snap.compile.engines}
    assert by_root[2000].max_jobs_state == "unknown"  # llama-server: environ unreadable, nothing else to ask
    assert by_root[4001].max_jobs_state == "set"  # ninja's unreadable too, but the raylet's says MAX_JOBS=4
    assert by_root[4001].max_jobs_source == "raylet"


def test_unreadable_cache_keeps_the_rest(tmp_path: Path, monkeypatch: object) -> None:
    settings = build_scenario(tmp_path)
    # A cache directory that is a file where a directory was listed: scandir fails with ENOTDIR on every visit.
    arch = settings.jit_cache_dirs[0] / "0.4.1" / "121a" / "cached_ops"
    telemetry = Telemetry(settings)
    telemetry.collect()
    bad = arch / "batch_prefill"
    real_scandir = os.scandir

    def failing_scandir(path: str | Path) -> object:
        if str(path) == str(bad):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr("sparkwatch.telemetry.sources.jitcache.os.scandir", failing_scandir)  # type: ignore[attr-defined]
    os.utime(bad, (time.time(), time.time()))  # changed: it must be re-read, and cannot be
    snap = telemetry.collect()
    (jit,) = [c for c in snap.collectors if c.name == "jitcache"]
    assert not jit.success and jit.error is not None and "batch_prefill" in jit.error
    m = expose(snap, settings)
    assert success(m, "jitcache") == 0 and success(m, "procs") == 1
    key = (("arch", "121a"), ("cache", "flashinfer"), ("version", "0.4.1"))
    assert m["sparkwatch_jit_cache_files"][key] == 6  # last good totals kept for the unreadable part
    assert m["sparkwatch_compile_processes"][(("tool", "cicc"),)] == 2


class RaisingGpu:
    """An NVML that raises on every call: the GPU part must never take the rest down with it."""

    calls = 0

    def collect(self) -> object:
        self.calls += 1
        raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED (9)")


def test_gpu_source_raising_leaves_the_rest(tmp_path: Path) -> None:
    gpu = RaisingGpu()
    telemetry = Telemetry(build_scenario(tmp_path), gpu_source=gpu)
    snap = telemetry.collect()
    snap = telemetry.collect()
    assert gpu.calls == 2  # retried each cycle
    (status,) = [c for c in snap.collectors if c.name == "gpu"]
    assert not status.success and status.error is not None and "DRIVER_NOT_LOADED" in status.error
    assert snap.gpu is None and snap.mem is not None and snap.compile is not None


def test_driver_not_loaded_leaves_the_rest(tmp_path: Path) -> None:
    """NVML up=False (driver not loaded, code 9): gpu_up 0 with the code, no per-engine GPU bytes, the rest intact."""

    class DownGpu:
        def collect(self) -> GpuReport:
            return GpuReport(up=False, nvml_return_code=9, error="nvmlInit: NVMLError_DriverNotLoaded")

    settings = build_scenario(tmp_path)
    snap = Telemetry(settings, gpu_source=DownGpu()).collect()
    m = expose(snap, settings)
    assert m["sparkwatch_gpu_up"][()] == 0 and m["sparkwatch_gpu_nvml_return_code"][()] == 9
    assert "sparkwatch_engine_gpu_memory_bytes" not in m
    assert success(m, "gpu") == 1  # the source worked: it says the driver is not there
    assert m["sparkwatch_engine_processes"][(("engine", "vllm"),)] == 9


def test_cache_growth_makes_the_engine_compiling_and_stall_is_an_event(tmp_path: Path) -> None:
    settings = build_scenario(tmp_path)
    settings = settings.model_copy(update={"jit_stall_s": 20.0})
    clock = [FIXED_MTIME + 100.0]
    telemetry = Telemetry(settings, wall_clock=lambda: clock[0])
    # The vLLM tree: drop its compilers so only the cache can say it works.
    proc = settings.proc_root
    for pid in (1002, 1003, 1004, 1005, 1006, 1007, 1008):
        (proc / str(pid) / "stat").unlink()
        (proc / str(pid)).rename(proc / f"gone-{pid}")
    telemetry.collect()
    arch = settings.jit_cache_dirs[0] / "0.4.1" / "121a"
    write_module(arch, "sampling", ["s"], built=["s"])
    clock[0] += 1
    snap = telemetry.collect()
    vllm = next(s for s in snap.jit_states if s.root_pid == 1000)
    assert vllm.state == "compiling" and "cache growing" in vllm.reason
    clock[0] += 10  # no growth, every vLLM process asleep, EngineCore waiting on a pipe (anon_pipe_read)
    snap = telemetry.collect()
    assert next(s for s in snap.jit_states if s.root_pid == 1000).state == "idle"
    clock[0] += 15  # 25 s without a sign of work, > jit_stall_s
    snap = telemetry.collect()
    assert next(s for s in snap.jit_states if s.root_pid == 1000).state == "stalled"
    kinds = [e.kind for e in telemetry.drain_events()]
    assert "jit_stalled" in kinds
    assert telemetry.drain_events() == []


def test_scrape_during_a_kill(spawner: Spawner, tmp_path: Path) -> None:
    """A real guard kills a real fake-engine tree while scrapes run back to back: every scrape is whole."""
    with MeminfoReader() as reader:
        mem = reader.read()
    # A floor above MemAvailable fires at once; the candidates are confined to this test's own descendants.
    settings = load_settings(
        None,
        {
            "floor": f"{mem.total_bytes}B",
            "rearm_headroom": "1GiB",
            "ancestor_pid": os.getpid(),
            "state_dir": tmp_path / "state",
            "jit_cache_dirs": [tmp_path / "none"],
            "vllm_cache_dirs": [tmp_path / "none"],
        },
    )
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--worker", "VLLM::Worker_TP0", "--worker", "VLLM::Worker_TP1", pidfile=pidfile, wait_for=3)
    members = pids_in(pidfile)
    events = EventLog(settings.events_path)
    guard = PoolWatch.build(guard_config(settings), events)
    loop = TelemetryLoop(Telemetry(settings), 0.05)
    loop.run_once()
    registry = build_registry(settings, lambda: loop.latest, guard, events)
    scrapes: list[dict[str, dict[tuple[tuple[str, str], ...], float]]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                scrapes.append(families(render(registry)))
            except BaseException as exc:  # any torn scrape fails the test below
                errors.append(exc)
                return

    scraper = threading.Thread(target=scrape)
    scraper.start()
    loop.start()
    guard.start()
    try:
        assert wait_until(lambda: not any(alive(p, t) for p, (t, _r) in members.items()), 15)
        assert wait_until(lambda: any(e["kind"] == "kill" for e in read_events(settings.events_path)), 15)
        time.sleep(0.2)
    finally:
        stop.set()
        scraper.join(10)
        guard.stop()
        loop.stop()
    assert not errors, errors
    assert len(scrapes) > 10
    kills = [s["sparkwatch_guard_kills_total"][(("trigger", "floor"),)] for s in scrapes]
    assert kills[0] == 0 and kills[-1] == 1 and kills == sorted(kills)  # never torn, never backwards
    killed = scrapes[-1]["sparkwatch_guard_killed_processes_total"][()]
    assert killed >= 3
    for s in scrapes:  # every scrape carried the whole set of families, before, during and after the kill
        assert "sparkwatch_memory_available_bytes" in s and "sparkwatch_guard_poll_interval_seconds" in s
        assert s["sparkwatch_collector_success"][(("collector", "procs"),)] == 1
