"""SIGHUP: the telemetry takes new caches, patterns and thresholds between cycles; the exporter follows the guard."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from sparkwatch.common.eventlog import EventLog
from sparkwatch.config.schema import guard_config
from sparkwatch.core.model import Event
from sparkwatch.guard.poolwatch import PoolWatch
from sparkwatch.telemetry.exporter.server import build_registry, render
from sparkwatch.telemetry.loop import Telemetry, TelemetryLoop
from tests.helpers.proctree import write_module
from tests.helpers.scenario import StaticGpu, build_scenario


def value(text: bytes, name: str) -> float:
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    raise AssertionError(name)


def test_reload_applies_between_cycles(tmp_path: Path) -> None:
    settings = build_scenario(tmp_path)
    events: list[Event] = []
    loop = TelemetryLoop(Telemetry(settings, gpu_source=StaticGpu()), 1.0, on_event=events.append)
    snap = loop.run_once()
    assert {j.version for j in snap.jit} == {"0.4.1", "0.2.8", ""}
    other = tmp_path / "other-flashinfer"
    write_module(other / "0.5.0" / "121a", "norm", ["norm"], built=["norm"])
    new = settings.model_copy(
        update={"jit_cache_dirs": [other], "compile_jobs_alert": 2, "jit_stall_s": 10.0, "telemetry_interval_s": 0.5}
    )
    applied = loop.reconfigure(new)
    assert {"jit_cache_dirs", "compile_jobs_alert", "jit_stall_s", "telemetry_interval_s"} <= applied
    assert loop.interval_s == 0.5
    snap = loop.run_once()
    assert {j.version for j in snap.jit if j.cache == "flashinfer"} == {"0.5.0"}
    # 5 parallel jobs > 2 now: the burst alert uses the new threshold
    assert any(e.kind == "compile_burst" and "exceed 2" in e.summary for e in events), [e.summary for e in events]


def test_exporter_follows_the_guards_live_floor(tmp_path: Path) -> None:
    settings = build_scenario(tmp_path)
    events = EventLog(settings.events_path)
    guard = PoolWatch.build(guard_config(settings), events)
    registry = build_registry(settings, lambda: None, guard, events)
    assert value(render(registry), "sparkwatch_memory_floor_bytes") == 8 << 30
    assert value(render(registry), "sparkwatch_guard_dry_run") == 0
    guard.reconfigure(guard_config(settings.model_copy(update={"floor": 6 << 30, "dry_run": True})))
    assert value(render(registry), "sparkwatch_memory_floor_bytes") == 6 << 30
    assert value(render(registry), "sparkwatch_guard_dry_run") == 1
