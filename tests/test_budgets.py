"""Per-engine budgets with a real daemon, real processes and real memory (bounded relative to MemAvailable, under the
pressure lock): an engine under its budget is never touched; one that grows past it dies alone, with the pool far
above the floor, while a steady one beside it lives; a config budget applies to an engine not started by launch; a dry
run records the same decision and signals nothing."""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common.eventlog import read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from tests.conftest import Spawner, alive, pids_in, require, require_tool, wait_until
from tests.daemon import scrape, sparkwatch_run, wait_for_event
from tests.grafana_support import alerts_over_scrapes
from tests.launchbox import Box, box_for, fitting_util, small_args, small_model, wait_ready
from tests.receiver import Receiver

pytestmark = pytest.mark.pressure
MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    yield from box_for(tmp_path)


def enough_memory(need: int) -> None:
    with MeminfoReader() as r:
        avail = r.read().available_bytes
    require(
        avail > need + 2 * GiB, f"needs {need >> 20} MiB more than the 2 GiB kept free; {avail >> 20} MiB available"
    )


def kills(events_path: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(events_path) if e["kind"] == "kill"]


def test_an_engine_over_its_budget_dies_alone_far_above_the_floor_and_a_steady_one_lives(
    box: Box, tmp_path: Path
) -> None:
    enough_memory(2 * GiB)
    with sparkwatch_run(tmp_path, env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as daemon:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        steady_model, runaway_model = small_model(tmp_path / "a"), small_model(tmp_path / "b")
        steady = box.launch("--budget", "1GiB", "-q", "--", *small_args(steady_model, fitting_util()),
                            "--phase-mib", "loading_weights=200", "--phase-s", "0.1",
                            "--pidfile", str(box.pidfile))  # fmt: skip
        ready = wait_ready(box)
        runaway = box.launch("--budget", "600MiB", "-q", "--", *small_args(runaway_model, fitting_util()),
                             "--phase-mib", "loading_weights=100", "--phase-s", "0.1", "--grow-mib-per-s", "400",
                             "--grow-limit-mib", "1800", "--pidfile", str(box.pidfile))  # fmt: skip
        _out, err = runaway.communicate(timeout=60)
        assert runaway.returncode == 137, err.decode()
        line = next(x for x in err.decode().splitlines() if "the guard killed" in x)
        assert "trigger budget" in line and "over its budget" in line
        event: dict[str, Any] = wait_for_event(daemon.events_path, "kill")
        assert event["trigger"] == "budget" and event["budget_source"] == "launch"
        assert event["budget_bytes"] == 600 * MiB
        assert event["footprint_bytes"] > 600 * MiB + 256 * MiB  # past budget + margin
        assert event["mem_available_bytes"] > 1 * GiB + event["floor_bytes"]  # far above the floor
        killed = {v["pid"] for v in event["victims"]}
        # The steady engine, under its budget, was never touched and still serves.
        assert alive(int(ready["root_pid"]), int(ready["start_ticks"]))
        assert int(ready["root_pid"]) not in killed
        assert len(kills(daemon.events_path)) == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert f'sparkwatch_engine_budget_bytes{{engine="vllm",name="{steady_model}",pid="{ready["root_pid"]}"' in text
        exited = wait_for_event(daemon.events_path, "engine_exited")
        assert exited["killed_by"] == "sparkwatch" and exited["trigger"] == "budget"
        steady.terminate()
        steady.communicate(timeout=30)


def test_a_config_budget_applies_to_an_engine_not_started_by_launch(tmp_path: Path, spawner: Spawner) -> None:
    enough_memory(1500 * MiB)
    budgets = json.dumps(["400MiB=sw-budget-me"])
    with sparkwatch_run(tmp_path, env={"SPARKWATCH_ENGINE_BUDGETS": budgets}) as daemon:
        spare = tmp_path / "spare.pids"
        spawner.engine("--title", "VLLM::EngineCore_spare", "--hog-rate-mib", "200", "--hog-limit-mib", "200",
                       pidfile=spare, wait_for=2)  # fmt: skip
        pidfile = tmp_path / "tree.pids"
        spawner.engine("--title", "VLLM::EngineCore_sw-budget-me", "--hog-rate-mib", "300",
                       "--hog-limit-mib", "1200", pidfile=pidfile, wait_for=2)  # fmt: skip
        event: dict[str, Any] = wait_for_event(daemon.events_path, "kill", timeout_s=60)
        assert event["trigger"] == "budget" and event["budget_source"] == "config"
        assert event["budget_bytes"] == 400 * MiB
        victims = {v["pid"] for v in event["victims"]}
        assert victims == set(pids_in(pidfile))
        time.sleep(0.5)
        assert all(alive(pid, ticks) for pid, (ticks, _r) in pids_in(spare).items())  # no budget: untouched
        near = wait_for_event(daemon.events_path, "budget_near")
        assert near["root_pid"] in victims


def counters(text: str, family: str) -> dict[str, float]:
    """trigger -> value of one by-trigger counter family in an exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(family + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('trigger="', 1)[1].split('"', 1)[0]] = float(value)
    return out


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def test_a_dry_run_records_the_same_decision_signals_nothing_and_moves_no_kill_counter(
    tmp_path: Path, spawner: Spawner, receiver: Receiver
) -> None:
    """The decision is a `would_kill` (not a `kill`), counted in its own counter and sent to the webhook as a
    warning; the shipped rules, run by promtool over the daemon's own scrapes before and after, raise the warning
    SparkwatchGuardWouldKill and never the critical SparkwatchGuardKilled."""
    promtool = require_tool("promtool")
    enough_memory(1200 * MiB)
    budgets = json.dumps(["300MiB=sw-budget-dry"])
    env = {"SPARKWATCH_ENGINE_BUDGETS": budgets, "SPARKWATCH_WEBHOOK_URL": f"{receiver.url_base}/hook"}
    with sparkwatch_run(tmp_path, "--dry-run", env=env) as daemon:
        before = scrape(daemon.port)
        pidfile = tmp_path / "tree.pids"
        spawner.engine("--title", "VLLM::EngineCore_sw-budget-dry", "--hog-rate-mib", "300",
                       "--hog-limit-mib", "800", pidfile=pidfile, wait_for=2)  # fmt: skip
        event: dict[str, Any] = wait_for_event(daemon.events_path, "would_kill", timeout_s=60)
        assert event["trigger"] == "budget" and event["dry_run"] is True and event["method"] == "dry-run"
        assert event["summary"].startswith("Would have killed")
        assert {v["pid"] for v in event["victims"]} == set(pids_in(pidfile))
        assert wait_until(
            lambda: counters(scrape(daemon.port), "sparkwatch_guard_would_kills_total")["budget"] == 1, 10
        )
        time.sleep(1.0)
        assert all(alive(pid, ticks) for pid, (ticks, _r) in pids_in(pidfile).items())
        events = read_events(daemon.events_path)
        assert [e["kind"] for e in events if e["kind"] in ("kill", "would_kill", "kill_loop")] == ["would_kill"]
        after = scrape(daemon.port)
        # The webhook hears it as a warning (docs/contract.md, Webhook): its own kind, a warning icon, no skull.
        assert wait_until(lambda: any(d.payload["kind"] == "would_kill" for d in receiver.deliveries), 30)
    sent = [d.payload for d in receiver.deliveries]
    assert [p["kind"] for p in sent if p["kind"] in ("kill", "would_kill")] == ["would_kill"]
    assert str(next(p for p in sent if p["kind"] == "would_kill")["text"]).startswith(":warning: sparkwatch on ")
    assert set(counters(after, "sparkwatch_guard_kills_total").values()) == {0.0}  # every trigger, still 0
    assert "sparkwatch_guard_killed_processes_total 0.0" in after
    assert "sparkwatch_guard_last_kill_timestamp_seconds" not in after
    assert counters(after, "sparkwatch_guard_would_kills_total") == {
        t: 1.0 if t == "budget" else 0.0 for t in counters(before, "sparkwatch_guard_would_kills_total")
    }
    result = alerts_over_scrapes(
        [(before, 4), (after, 20)],
        "2m",
        {"SparkwatchGuardWouldKill": ["dut:9847"], "SparkwatchGuardKilled": [], "SparkwatchTPPeerLost": []},
        tmp_path,
        promtool,
    )
    assert result.returncode == 0, result.stdout + result.stderr


HOG = """
import mmap, sys, time
mib = int(sys.argv[1])
maps = []
for _ in range(mib // 32):
    m = mmap.mmap(-1, 32 << 20)
    m.write(b"\\xa5" * (32 << 20))  # every page touched: a real MemAvailable drop
    maps.append(m)
open(sys.argv[2], "w").write("held")
time.sleep(600)
"""


def test_a_hog_beside_a_booting_engine_drops_the_pool_and_the_engine_is_not_killed_for_it(
    box: Box, tmp_path: Path, spawner: Spawner
) -> None:
    """The pool's drop since launch holds everything on the box: a plain process (no engine) that takes 2 GiB beside
    a launched engine that boots steadily at ~150 MiB against a 1 GiB budget may raise budget_near, never a kill."""
    enough_memory(3 * GiB)
    with sparkwatch_run(tmp_path, env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as daemon:
        # Booting for good: it stays in loading_weights (the phase the budget's pool drop applies to) with 150 MiB.
        steady = box.launch("--budget", "1GiB", "-q", "--", *small_args(small_model(tmp_path), fitting_util()),
                            "--phase-mib", "loading_weights=150", "--phase-s", "600",
                            "--pidfile", str(box.pidfile))  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not any(d["phase"] == "loading_weights" for d in box.declarations()) or len(box.pids()) < 2:
                assert time.monotonic() < deadline, box.declarations()
                time.sleep(0.1)
            (decl,) = box.declarations()
            held = tmp_path / "hog-held"
            spawner.popen([sys.executable, "-c", HOG, "2048", str(held)])
            while not held.exists():
                assert time.monotonic() < deadline + 60, "the hog never took its memory"
                time.sleep(0.1)
            near: dict[str, Any] = wait_for_event(daemon.events_path, "budget_near", timeout_s=30)
            with MeminfoReader() as r:
                drop = decl["available_at_launch_bytes"] - r.read().available_bytes
            assert drop > 1 * GiB + 256 * MiB  # past the budget and its margin: the pool-drop rule killed here
            # A kill comes within two budget samples of crossing (the guard samples a budgeted tree at least every
            # poll_max_s = 1 s): four seconds of the hog's drop without one is the answer.
            until = time.monotonic() + 4
            while time.monotonic() < until:
                assert kills(daemon.events_path) == []
                time.sleep(0.2)
            assert steady.poll() is None and all(alive(pid, ticks) for pid, ticks in box.pids())
            assert near["pool_drop_bytes"] >= 0.9 * GiB  # the warning came from the pool's drop...
            assert near["footprint_bytes"] < 600 * MiB and near["footprint_source"] in ("rss", "cgroup")  # ...alone
        finally:
            steady.terminate()
            steady.communicate(timeout=30)


def test_a_child_that_double_forks_out_of_the_tree_counts_in_the_budget_and_dies_with_it(
    box: Box, tmp_path: Path
) -> None:
    """A worker that daemonises (fork, setsid, fork) is reparented to launch, the subreaper: the guard counts it in
    the launched engine's footprint, and the budget kill takes it with the tree."""
    enough_memory(2 * GiB)
    orphan_file = tmp_path / "orphan.pid"
    with sparkwatch_run(tmp_path, env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as daemon:
        engine = box.launch("--budget", "600MiB", "-q", "--", *small_args(small_model(tmp_path), fitting_util()),
                            "--phase-mib", "loading_weights=50", "--phase-s", "0.1", "--grow-in-orphan",
                            str(orphan_file), "--grow-mib-per-s", "300", "--grow-limit-mib", "1500",
                            "--pidfile", str(box.pidfile))  # fmt: skip
        _out, err = engine.communicate(timeout=90)
        assert engine.returncode == 137, err.decode()
        assert "trigger budget" in err.decode()
        event: dict[str, Any] = wait_for_event(daemon.events_path, "kill")
        assert event["trigger"] == "budget" and event["footprint_bytes"] > 600 * MiB + 256 * MiB
        ((orphan, ticks),) = [tuple(map(int, line.split())) for line in orphan_file.read_text().splitlines()]
        assert orphan in {v["pid"] for v in event["victims"]}
        assert not alive(orphan, ticks)


def test_a_launched_engine_over_its_budget_in_dry_run_exits_as_would_have_been_killed(box: Box, tmp_path: Path) -> None:
    """engine_exited after a dry run's decision: killed_by stays null, dry_run is true, and the summary says the
    engine would have been killed (the engine ended by its own SIGTERM, long after the decision)."""
    enough_memory(1500 * MiB)
    with sparkwatch_run(tmp_path, "--dry-run", env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as daemon:
        model = small_model(tmp_path)
        runaway = box.launch("--budget", "400MiB", "-q", "--", *small_args(model, fitting_util()),
                             "--phase-mib", "loading_weights=100", "--phase-s", "0.1", "--grow-mib-per-s", "400",
                             "--grow-limit-mib", "900", "--pidfile", str(box.pidfile))  # fmt: skip
        try:
            event: dict[str, Any] = wait_for_event(daemon.events_path, "would_kill", timeout_s=60)
            assert event["trigger"] == "budget" and event["budget_source"] == "launch"
            assert runaway.poll() is None  # nothing was signalled
        finally:
            runaway.terminate()
            runaway.communicate(timeout=60)
        exited = wait_for_event(daemon.events_path, "engine_exited")
    assert exited["killed_by"] is None and exited["dry_run"] is True and exited["trigger"] == "budget"
    assert "would have been killed by sparkwatch in a dry run (trigger budget)" in str(exited["summary"])
    assert not kills(daemon.events_path)


def test_a_guard_kill_of_a_launched_engine_reaches_its_terminal_as_one_line_without_the_event_log(
    box: Box, tmp_path: Path, spawner: Spawner
) -> None:
    """launch on a pseudo-terminal (its controlling terminal, as a shell gives it), the guard with a state dir of its
    own: launch finds no events.jsonl of the guard's anywhere it could look and learns of the budget kill from the
    guard's published word on its declaration; the guard, whose kill launch reports, writes no line of its own on
    that terminal. The owner reads one line naming the kill."""
    require_tool("setsid")
    enough_memory(1500 * MiB)
    master, slave = os.openpty()
    out: list[bytes] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    return  # EIO: nothing holds the terminal any more
                if not chunk:
                    return
                out.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with sparkwatch_run(tmp_path, env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as daemon:
            env = {**box.env, "SPARKWATCH_STATE_DIR": str(tmp_path / "launch-state")}  # not the guard's state dir
            runaway = spawner.popen(
                ["setsid", "-c", sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0",
                 "--budget", "600MiB", "--", *small_args(small_model(tmp_path), fitting_util()),
                 "--phase-mib", "loading_weights=100", "--phase-s", "0.1", "--grow-mib-per-s", "400",
                 "--grow-limit-mib", "1200", "--pidfile", str(box.pidfile)],
                stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
            )  # fmt: skip
            os.close(slave)
            slave = -1
            assert runaway.wait(60) == 137
            # The kill event comes after the guard's line on the terminal (guard.poolwatch._announce) would have.
            event: dict[str, Any] = wait_for_event(daemon.events_path, "kill")
            assert event["trigger"] == "budget"
            assert not (tmp_path / "launch-state" / "events.jsonl").exists()
            assert wait_until(lambda: b"exited after" in b"".join(out), 10)
    finally:
        done.set()
        reader.join(5)
        if slave >= 0:
            os.close(slave)
        os.close(master)
    text = b"".join(out).decode(errors="replace").replace("\r", "")
    kill_lines = ("sparkwatch: the guard killed", "sparkwatch: killed this", "sparkwatch: vllm (pid ")
    told = [x for x in text.splitlines() if x.startswith(kill_lines)]  # launch's, the guard's, launch's unknown kill
    assert len(told) == 1, text
    assert told[0].startswith("sparkwatch: the guard killed vllm (pid ") and "trigger budget" in told[0], text
    assert "over its budget" in told[0] and "no sparkwatch kill event" not in text, text
