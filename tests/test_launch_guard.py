"""The guard's side of `sparkwatch launch`, with a real daemon: a launched engine is known by declaration, its boot
phases become metrics and durable events (engine_started, engine_ready, engine_exited), and a declaration is never
trusted for a process it does not name."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common import launched
from sparkwatch.common.flightrec import RING_NAME, read_ring
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.core.launch.bootphase import BootPhase
from sparkwatch.guard.launchwatch import LaunchedEngines
from tests.conftest import wait_until
from tests.daemon import scrape, sparkwatch_run, wait_for_event
from tests.launchbox import Box, box_for, fitting_util, small_args, small_model, wait_ready


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    yield from box_for(tmp_path)


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


# --- what launch, status and doctor say about the guard (its published state, common.guardfile)


def _run(box: Box, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", *args], env=box.env, capture_output=True, text=True, timeout=90
    )


def _frame_section(out: str, label: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(label))
    body = [lines[start][len(label) :].strip()]
    body += [line.strip() for line in itertools.takewhile(lambda x: x[:1] == " ", lines[start + 1 :])]
    return body


def test_launch_with_a_budget_and_no_guard_says_once_that_the_budget_is_not_enforced(box: Box, tmp_path: Path) -> None:
    model = small_model(tmp_path)
    proc = box.launch("--budget", "2GiB", "--", *small_args(model, fitting_util()), "--phase-s", "0.05",
                      "--serve-s", "2")  # fmt: skip
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    text = err.decode()
    assert text.count("no guard is running") == 1, text
    assert "sparkwatch: no guard is running: the budget is not enforced\n" in text
    (decl,) = box.declarations()
    where = box.run_dir / "sparkwatch" / "launched" / f"{decl['root_pid']}-{decl['start_ticks']}.json"
    assert f"sparkwatch: declared in {where}\n" in text
    # Without a budget, a softer line, also once.
    proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.05", "--serve-s", "0")
    _out, err = proc.communicate(timeout=60)
    assert err.decode().count("no guard is running") == 1 and "budget is not enforced" not in err.decode()


def test_a_dry_run_guard_takes_the_declaration_and_status_and_doctor_say_so(box: Box, tmp_path: Path) -> None:
    """A real daemon in dry run: launch says the guard took its declaration and that its budget is only watched;
    `status` shows the guard (dry run, floor, budgets) and the engine's boot phase; `doctor` warns."""
    with sparkwatch_run(tmp_path, "--dry-run", "--floor", "1GiB", env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as d:
        published = box.run_dir / "sparkwatch" / "guard.json"
        assert oct(published.stat().st_mode & 0o777) == "0o644"
        model = small_model(tmp_path)
        proc = box.launch("--budget", "2GiB", "--", *small_args(model, fitting_util()), "--phase-s", "0.05",
                          "--serve-s", "30", "--pidfile", str(box.pidfile))  # fmt: skip
        try:
            decl = wait_ready(box)
            key = [decl["root_pid"], decl["start_ticks"]]
            assert wait_until(lambda: key in json.loads(published.read_text())["taken"], 10), published.read_text()
            status = _run(box, "status", "--once")
            doctor = _run(box, "doctor", "--json")
        finally:
            proc.terminate()
            _out, err = proc.communicate(timeout=30)
        text = err.decode()
        pid = d.proc.pid
        took = f"sparkwatch: guard pid {pid} (DRY RUN) took it: its budget 2.0 GiB is watched and recorded, nothing is "
        assert took in text, text
        assert "no guard is running" not in text
        # The guard republished when the engine it took went away.
        assert wait_until(lambda: json.loads(published.read_text())["taken"] == [], 10), published.read_text()
    assert status.returncode == 0, status.stderr
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    guard = _frame_section(status.stdout, "GUARD")
    assert guard == [
        f"guard pid {pid} ({who}), DRY RUN (records, kills nothing), floor 1.0 GiB, 1 budget, 1 launched engine"
    ]
    engines = _frame_section(status.stdout, "ENGINES")
    row = next(line for line in engines if line.startswith(f"vllm {decl['root_pid']} "))
    assert "launched: phase ready for " in row and "budget 2.0 GiB" in row, row
    check = next(c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "guard")
    assert check["status"] == "warn" and f"guard pid {pid} " in check["summary"] and "DRY RUN" in check["summary"]
    assert not published.exists()  # a clean stop removes it: no reader takes a stopped guard as running


def test_an_armed_guard_takes_the_declaration_and_doctor_finds_it_ok(box: Box, tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path, "--floor", "1GiB", env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as d:
        model = small_model(tmp_path)
        proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.05", "--serve-s", "3")
        _out, err = proc.communicate(timeout=60)
        status = _run(box, "status", "--once")
        doctor = _run(box, "doctor", "--json")
        pid = d.proc.pid
    assert proc.returncode == 0, err.decode()
    assert f"sparkwatch: guard pid {pid} (armed) took it\n" in err.decode(), err.decode()
    guard = _frame_section(status.stdout, "GUARD")
    assert guard[0].startswith(f"guard pid {pid} (") and ", armed, floor 1.0 GiB, no budget" in guard[0], guard
    check = next(c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "guard")
    assert check["status"] == "ok" and f"guard pid {pid} " in check["summary"] and ", armed," in check["summary"]


def test_a_guard_that_does_not_read_this_runtime_dir_is_said_not_to_have_taken_it(box: Box, tmp_path: Path) -> None:
    """The guard's runtime dir cannot be made (its XDG_RUNTIME_DIR is a file): it publishes in the state dir, which
    launch also reads, but it reads no declaration of launch's runtime dir: after the bounded wait, launch says so."""
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    with sparkwatch_run(tmp_path, "--dry-run", "--floor", "1GiB", env={"XDG_RUNTIME_DIR": str(blocked)}) as d:
        assert (box.state / "guard.json").is_file()
        assert any("could not publish the guard's state in" in line for line in d.stderr_lines), d.stderr_lines
        model = small_model(tmp_path)
        proc = box.launch("--budget", "2GiB", "--", *small_args(model, fitting_util()), "--phase-s", "0.05",
                          "--serve-s", "7")  # fmt: skip
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    line = f"sparkwatch: guard pid {d.proc.pid} has not taken it within 5 s (it is outside the guard's ancestor_pid, "
    assert line + "or the guard does not read this runtime dir): the budget is not enforced\n" in err.decode()
    assert "no guard is running" not in err.decode()


def test_a_guard_says_it_took_only_the_declarations_its_ancestor_pid_holds(tmp_path: Path) -> None:
    """A declaration outside the guard's `ancestor_pid` is still read (its events), never a tree of the guard's:
    so it is not among those the guard publishes as taken, and launch never says "enforced" for it."""
    directory = tmp_path / "launched"
    engines = LaunchedEngines([directory], "/proc", lambda *_a: None)
    me = os.getpid()
    launched.write(directory, _decl(me, os.geteuid()))
    outsider = subprocess.Popen(["sleep", "60"])  # no ancestor of this process
    try:
        engines.poll(time.monotonic())
        key = (me, read_start_ticks("/proc", me))
        assert [d.tree_key for d in engines.live()] == [key]  # no ancestor_pid: every tree is the guard's
        engines.ancestor_pid = outsider.pid
        assert engines.live() == () and [d.tree_key for d in engines.declarations()] == [key]
        engines.ancestor_pid = os.getppid()  # this process descends from it
        assert [d.tree_key for d in engines.live()] == [key]
    finally:
        outsider.kill()
        outsider.wait()


def test_launch_never_says_enforced_for_a_tree_outside_the_guard_s_ancestor_pid(box: Box, tmp_path: Path) -> None:
    """The new owner's case: `ancestor_pid` in the guard's config, a launch outside it with `--budget 300MiB`. The
    guard took the declaration, launch said "its budget 300 MiB is enforced", and the engine grew to 900 MiB
    unkilled. Now the guard does not take it, and launch says the budget is not enforced."""
    outsider = subprocess.Popen(["sleep", "120"])  # the guard's ancestor_pid: the launch does not descend from it
    try:
        env = {"XDG_RUNTIME_DIR": str(box.run_dir), "SPARKWATCH_ANCESTOR_PID": str(outsider.pid)}
        with sparkwatch_run(tmp_path, "--floor", "1GiB", env=env) as d:
            published = box.run_dir / "sparkwatch" / "guard.json"
            model = small_model(tmp_path)
            proc = box.launch("--budget", "300MiB", "--", *small_args(model, fitting_util()), "--phase-s", "0.05",
                              "--serve-s", "7", "--pidfile", str(box.pidfile))  # fmt: skip
            decl = wait_ready(box)
            assert json.loads(published.read_text())["taken"] == [], published.read_text()
            _out, err = proc.communicate(timeout=60)
            pid = d.proc.pid
    finally:
        outsider.kill()
        outsider.wait()
    text = err.decode()
    assert proc.returncode == 0, text
    assert "is enforced" not in text, text
    line = f"sparkwatch: guard pid {pid} has not taken it within 5 s (it is outside the guard's ancestor_pid, or the "
    assert line + "guard does not read this runtime dir): the budget is not enforced\n" in text, text
    # and the plan warned before the start: 300 MiB is under what the plan says this engine takes
    assert "sparkwatch: WARNING: the budget 300 MiB is under the plan's estimate " in text, text
    assert decl["budget_bytes"] == 300 << 20
