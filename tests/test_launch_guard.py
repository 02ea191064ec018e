"""The guard's side of `sparkwatch launch`, with a real daemon: a launched engine is known by declaration, its boot
phases become metrics and durable events (engine_started, engine_ready, engine_exited), and a declaration is never
trusted for a process it does not name."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common import launched
from sparkwatch.common.flightrec import RING_NAME, read_ring
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.core.bootphase import BootPhase
from sparkwatch.guard.launchwatch import LaunchedEngines
from tests.daemon import sparkwatch_run, wait_for_event
from tests.launchbox import Box, box_for, fitting_util, small_args, small_model


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    yield from box_for(tmp_path)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
    return text


def test_phases_become_metrics_and_events_the_guard_records(box: Box, tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path, env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as daemon:
        model = small_model(tmp_path)
        proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.4", "--serve-s", "4")
        seen_phases: set[str] = set()
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            for line in scrape(daemon.port).splitlines():
                if line.startswith("sparkwatch_engine_boot_phase{") and line.endswith(" 1.0"):
                    seen_phases.add(line.split('phase="')[1].split('"')[0])
            time.sleep(0.3)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()
        assert "ready" in seen_phases, seen_phases  # the dashboard's boot timeline reads this family
        assert len(seen_phases) >= 2, seen_phases
        started: dict[str, Any] = wait_for_event(daemon.events_path, "engine_started")
        ready: dict[str, Any] = wait_for_event(daemon.events_path, "engine_ready")
        exited: dict[str, Any] = wait_for_event(daemon.events_path, "engine_exited")
    decl = box.declarations()[0]
    assert started["root_pid"] == ready["root_pid"] == exited["root_pid"] == decl["root_pid"]
    assert started["engine"] == "vllm" and started["model"] == str(model)
    assert isinstance(ready["seconds_to_ready"], float) and ready["seconds_to_ready"] > 1.0
    assert ready["peak_bytes"] is None or ready["peak_bytes"] > 0
    assert [p["phase"] for p in ready["phases"]][-1] == "ready"
    assert exited["exit_code"] == 0 and exited["killed_by"] is None and exited["signal"] is None
    # Durable: the guard wrote them to events.jsonl (launch itself never writes there).
    kinds = [json.loads(line)["kind"] for line in daemon.events_path.read_text().splitlines()]
    assert kinds.index("engine_started") < kinds.index("engine_ready") < kinds.index("engine_exited")
    # The flight recorder kept the launched engine and its phase in its samples (what a postmortem says was booting).
    ring = read_ring(daemon.state_dir / RING_NAME)
    assert ring is not None
    recorded = [(e.name, e.phase) for s in ring.samples for e in s.launched if e.pid == decl["root_pid"]]
    assert recorded, "no sample names the launched engine"
    assert {name for name, _ in recorded} == {f"vllm {model.name}"}
    assert "ready" in {phase for _, phase in recorded}, recorded  # ready held for 4 s: samples come at 1 Hz


def _decl(pid: int, uid: int, start: int | None = None) -> launched.Declaration:
    now = time.time()
    ticks = read_start_ticks("/proc", pid) if start is None else start
    assert ticks is not None
    return launched.Declaration(
        root_pid=pid,
        start_ticks=ticks,
        uid=uid,
        kind="vllm",
        model="m",
        key="k",
        budget_bytes=None,
        launched_at=now,
        launcher_pid=os.getpid(),
    ).entered(BootPhase.STARTING, now)


def test_a_declaration_is_trusted_only_for_the_process_it_names(tmp_path: Path) -> None:
    directory = tmp_path / "launched"
    records: list[tuple[str, dict[str, object]]] = []
    engines = LaunchedEngines([directory], "/proc", lambda kind, _s, fields, _l, _line: records.append((kind, fields)))
    me = os.getpid()
    launched.write(directory, _decl(me, os.geteuid()))
    launched.write(directory, _decl(1, os.geteuid(), start=12345))  # PID 1 with another start time: never trusted
    launched.write(directory, _decl(os.getppid(), os.geteuid() + 1))  # declares another uid than the file's owner
    (directory / "garbage.json").write_bytes(b"{not json")
    (directory / "big.json").write_bytes(b" " * (launched.DECLARATION_MAX_BYTES + 10))
    engines.poll(time.monotonic())
    assert set(engines.declared()) == {(me, read_start_ticks("/proc", me))}
    assert engines.watch.errors_total == 2  # the garbage and the oversized one (root may declare any uid: the kernel
    # refuses the third, whose process is not of the uid it declares)
    assert [k for k, _f in records] == ["engine_started"]
    reads = engines.watch.reads_total
    time.sleep(0.06)
    engines.poll(time.monotonic())
    engines.poll(time.monotonic())
    assert engines.watch.reads_total == reads + 0 or engines.watch.reads_total <= reads + 1  # unchanged: a stat
    launched.write(directory, _decl(me, os.geteuid()).entered(BootPhase.READY, time.time()))
    engines.poll(time.monotonic())
    assert [k for k, _f in records] == ["engine_started", "engine_ready"]


def test_engines_shows_a_launched_trees_budget_footprint_and_phase(box: Box, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.launchbox import wait_ready

    model = small_model(tmp_path)
    proc = box.launch("--budget", "2GiB", "--", *small_args(model, fitting_util()), "--phase-mib",
                      "loading_weights=64", "--phase-s", "0.05", "--pidfile", str(box.pidfile))  # fmt: skip
    try:
        decl = wait_ready(box)
        shown = subprocess.run(
            [sys.executable, "-m", "sparkwatch", "engines", "--json", "--window", "0"],
            env=box.env, capture_output=True, check=True, timeout=60,
        )  # fmt: skip
        tree = next(t for t in json.loads(shown.stdout)["engines"] if t["root_pid"] == decl["root_pid"])
        assert tree["engine"] == "vllm"  # by declaration: the root runs boot_engine.py, which no rule names
        budget = tree["budget"]
        assert budget["budget_bytes"] == 2 << 30 and budget["budget_source"] == "launch"
        assert budget["phase"] == "ready" and budget["footprint_bytes"] >= 64 << 20
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
