"""A kill is not undone by a restart policy (issue 38, item 2): a real guard kills the engine that is a container's
PID 1 (`--restart unless-stopped`, spiking over its budget at each start), and telemetry, told of the kill by the
guard and of the restart by a real dockerd, pauses the restarted container until the pool has settled (`gate`),
cancels the restart through the API's kill (`stop`) or lets it run (`allow`); a second kill within the loop window
stops it whatever its policy, with one alert. Then the pure rules (core.containerpolicy), a failing API counted and
never raised, and `status` showing a gated container.

The daemon is confined to this test's own processes (`ancestor_pid`, tests/daemon.py): this session's dockerd is the
subreaper of its containers (tests/dockerd.py), so their engines are this test process's descendants and no other's
engine can be killed. Memory: one engine at a time, 448 MiB at most."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common.eventlog import EventLog, make_event, read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.common.stats import RecentKill
from sparkwatch.config.settings import load_settings
from sparkwatch.core.container import AfterKill, ContainerFacts
from sparkwatch.core.containerpolicy import (
    ContainerKill,
    Gate,
    Need,
    answered_kill,
    decide,
    gate_step,
    kill_footprint,
    need_of,
    note_kill,
)
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill.killloop import LOOP_WINDOW_S
from sparkwatch.core.report.gates import gated_now
from sparkwatch.telemetry.afterkill import AfterKillWatch
from sparkwatch.telemetry.containerwatch import ContainerStore
from sparkwatch.telemetry.sources.dockerapi import DockerEvent
from sparkwatch.tui.status_view import gated_lines
from tests.conftest import require, wait_until, wakeups
from tests.daemon import RunningDaemon, scrape, sparkwatch_run, wait_for_event
from tests.dockerd import Dockerd, fake_engine_argv, run_args
from tests.receiver import Receiver

MiB = 1 << 20
GiB = 1 << 30
CID = "3f2a" * 16
# Killed past 64 MiB + the budget's margin (max(2 %, 256 MiB)): the hog passes 320 MiB ~2.5 s into each start.
BUDGET = "64MiB"
HOG = ("--hog-rate-mib", "128", "--hog-limit-mib", "448")


# --- the rules, pure -----------------------------------------------------------------------------------------------


def kill_at(ts: float, root: int = 100, **kw: Any) -> ContainerKill:
    return ContainerKill(CID, root, ts, "budget", **kw)


def test_a_restart_answers_the_kill_before_it_not_an_owners_start_nor_a_late_one() -> None:
    kills = (kill_at(100.0),)
    assert answered_kill(kills, 100.4, restart_count=1) == kills[0]
    assert answered_kill(kills, 100.4, restart_count=0) is None  # `docker start` resets the count: the owner's
    assert answered_kill(kills, 99.9, restart_count=1) is None  # the run the guard killed started before it
    assert answered_kill(kills, 100.0 + 80, restart_count=3) is None  # moby's backoff is at most a minute
    assert answered_kill((kill_at(100.0, answered=True),), 100.4, restart_count=2) is None


def test_the_label_decides_then_the_config_and_a_second_kill_within_the_window_always_stops() -> None:
    one = (kill_at(100.0),)
    assert decide(one, 100.5, {}, AfterKill.GATE).action == AfterKill.GATE
    by_label = decide(one, 100.5, {"io.sparkwatch.after-kill": "stop"}, AfterKill.GATE)
    assert (by_label.action, by_label.source) == (AfterKill.STOP, "label")
    bad = decide(one, 100.5, {"io.sparkwatch.after-kill": "pause"}, AfterKill.ALLOW)
    assert (bad.action, bad.source) == (AfterKill.ALLOW, "config") and "pause" in bad.problems[0]
    two = (kill_at(100.0), kill_at(160.0, root=200))
    for policy in AfterKill:
        loop = decide(two, 160.5, {"io.sparkwatch.after-kill": policy.value}, policy)
        assert (loop.action, loop.loop, loop.kills) == (AfterKill.STOP, True, 2)
    apart = (kill_at(100.0), kill_at(100.0 + LOOP_WINDOW_S + 1, root=200))
    assert decide(apart, 100.0 + LOOP_WINDOW_S + 1.5, {}, AfterKill.ALLOW).action == AfterKill.ALLOW


def test_one_kill_heard_from_the_state_and_from_its_event_is_one_kill() -> None:
    """The state gives the signal's time; the event, a second later, the footprint: merged, never two kills (two
    would make a loop of one kill)."""
    kills = note_kill({}, kill_at(100.0))
    kills = note_kill(kills, kill_at(100.03, exact=False, footprint_bytes=5 * GiB, confirmed=True))
    [one] = kills[CID]
    assert (one.ts, one.footprint_bytes, one.confirmed, one.exact) == (100.0, 5 * GiB, True, True)
    kills = note_kill(kills, kill_at(130.0, root=200))  # the next run, killed again
    assert len(kills[CID]) == 2


def test_a_gate_opens_once_the_pool_settled_and_the_need_fits() -> None:
    gate = Gate(CID, "vllm", "img", 0.0, 0.0, 100, Need(3 * GiB, "kill footprint"))
    floor = 1 * GiB
    t = 0.0
    release = False
    for t in (0.0, 1.0, 2.0, 3.0):  # one engine process still letting go: never
        gate, release = gate_step(gate, t, letting_go=1, available_bytes=10 * GiB, floor_bytes=floor)
        assert not release
    for t in (4.0, 5.0, 6.0, 7.0, 8.0):  # 5 s steady: settled; 10 GiB - 1 GiB fits 3 GiB
        gate, release = gate_step(gate, t, letting_go=0, available_bytes=10 * GiB, floor_bytes=floor)
    assert gate.settled is False and not release
    gate, release = gate_step(gate, 9.0, letting_go=0, available_bytes=10 * GiB, floor_bytes=floor)
    assert gate.settled and release
    tight = Gate(CID, "vllm", "img", 0.0, 0.0, 100, Need(3 * GiB, "learned peak"))
    for t in range(12):
        tight, release = gate_step(tight, float(t), letting_go=0, available_bytes=3 * GiB, floor_bytes=floor)
    assert tight.settled and not release  # settled, and 2 GiB above the floor does not hold 3 GiB


def test_what_a_gated_engine_needs_is_its_peak_else_its_plan_else_its_kill() -> None:
    assert need_of(70 * GiB, 60 * GiB, 50 * GiB) == Need(70 * GiB, "learned peak")
    assert need_of(None, 60 * GiB, 50 * GiB) == Need(60 * GiB, "plan")
    assert need_of(None, None, 50 * GiB) == Need(50 * GiB, "kill footprint")
    assert need_of(None, None, None) is None
    assert kill_footprint({"victim_rss_bytes": 2 * GiB, "victim_gpu_bytes": 40 * GiB}) == 42 * GiB
    assert (
        kill_footprint({"victim_rss_bytes": 2 * GiB, "victim_gpu_bytes": None, "footprint_bytes": 9 * GiB}) == 9 * GiB
    )


def test_status_shows_a_gated_container_until_its_release() -> None:
    gated = {"kind": "container_gated", "ts": "2026-12-07T12:00:00.000Z", "container_id": CID,
             "container_name": "vllm-qwen", "image": "nvcr.io/nvidia/vllm:25.09", "need_bytes": 61 * GiB,
             "need_source": "kill footprint", "error": None}  # fmt: skip
    failed = {**gated, "container_id": "ab" * 32, "error": "no Docker API"}  # nothing was paused
    [view] = gated_now([gated, failed])
    assert (view.name, view.need_bytes) == ("vllm-qwen", 61 * GiB)
    [line] = gated_lines([view], now=view_ts(gated) + 40)
    assert "vllm-qwen (nvcr.io/nvidia/vllm:25.09, 3f2a3f2a3f2a) paused since" in line.plain
    assert "(40 s)" in line.plain and "61.0 GiB (kill footprint) fits" in line.plain
    assert gated_now([gated, {"kind": "container_released", "container_id": CID}]) == ()
    assert gated_now([gated, {"kind": "container_kill_loop", "container_id": CID}]) == ()


def view_ts(event: dict[str, Any]) -> float:
    from sparkwatch.core.timestamps import parse_rfc3339

    ts = parse_rfc3339(str(event["ts"]))
    assert ts is not None
    return ts


def test_an_api_that_fails_is_counted_and_said_never_raised(tmp_path: Path) -> None:
    """No daemon at the socket: the restart is still answered (recorded, with the failure in words), the failure
    counted, and the worker goes on to the next input."""
    settings = load_settings(None, {"state_dir": tmp_path / "state"})
    events = EventLog(tmp_path / "events.jsonl")
    watch = AfterKillWatch(settings, events, containers=None, socket_path=str(tmp_path / "absent.sock"), where="a test")
    watch.start()
    try:
        now = time.time()
        facts = ContainerFacts(CID, "sw-ak-unit", "img", "running", 4242, "unless-stopped", restart_count=1)
        watch.guard_state([RecentKill(now - 0.5, "budget", "over its budget", (4000,))])
        watch.container_event(DockerEvent("start", CID, 0, {}), facts)  # pid 4242: not the killed tree's
        watch.guard_event(
            make_event(EventKind.KILL, "killed", {"trigger": "budget", "containers": [{"root_pid": 4000, "id": CID}],
                                                  "victim_rss_bytes": 300 * MiB, "signal_to_reaped_ms": 20.0})
        )  # fmt: skip
        assert wait_until(lambda: any(e["kind"] == "container_gated" for e in read_events(events.path)), 10)
        [gated] = [e for e in read_events(events.path) if e["kind"] == "container_gated"]
        assert gated["error"] and "absent.sock" in gated["error"] and gated["restart_to_pause_ms"] is None
        assert watch.counters()["api_errors_unreachable"] + watch.counters()["api_errors_refused"] >= 1
        assert watch.gated() == () and watch.counters()["errors"] == 0
        assert gated_now(read_events(events.path)) == ()  # nothing paused: status shows nothing held
    finally:
        watch.stop()


# --- with a real guard and a real dockerd --------------------------------------------------------------------------


def enough_memory() -> None:
    with MeminfoReader() as r:
        avail = r.read().available_bytes
    require(avail > 3 * GiB, f"needs 3 GiB available; {avail >> 20} MiB")


@pytest.fixture
def agent(
    tmp_path: Path, dockerd: Dockerd, receiver: Receiver, request: pytest.FixtureRequest
) -> Iterator[RunningDaemon]:
    """`sparkwatch run` on this session's dockerd, its config budget on the fake engine's title, its webhook the
    receiver's; the test's parameter `after_kill` (if any) is the config's container_after_kill."""
    enough_memory()
    env = {
        "DOCKER_HOST": dockerd.host,
        "SPARKWATCH_FLOOR": "1GiB",
        "SPARKWATCH_ENGINE_BUDGETS": json.dumps([f"{BUDGET}=VLLM::EngineCore"]),
        "SPARKWATCH_PROBE_INTERVAL_S": "0",
        "SPARKWATCH_WEBHOOK_URL": f"{receiver.url_base}/hook",
    }
    after_kill = getattr(request, "param", None)
    if after_kill:
        env["SPARKWATCH_CONTAINER_AFTER_KILL"] = after_kill
    with sparkwatch_run(tmp_path, env=env) as daemon:
        yield daemon


def alerts(receiver: Receiver, kind: str) -> list[dict[str, object]]:
    return [d.payload for d in receiver.deliveries if d.payload["kind"] == kind]


def kinds(daemon: RunningDaemon, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(daemon.events_path) if e["kind"] == kind]


def status_of(dockerd: Dockerd, name: str) -> str:
    state = dockerd.inspect(name)["State"]
    assert isinstance(state, dict)
    return str(state["Status"])


def watch_states(dockerd: Dockerd, name: str, stop: threading.Event, seen: list[str]) -> None:
    """The container's status as `docker inspect` says it, each change (a thread)."""
    while not stop.is_set():
        done = dockerd.docker("inspect", "-f", "{{.State.Status}}", name, check=False, timeout_s=10)
        status = done.stdout.strip()
        if status and (not seen or seen[-1] != status):
            seen.append(status)
        stop.wait(0.05)


def run_engine(dockerd: Dockerd, name: str, *labels: str) -> str:
    dockerd.remove(name)
    flags = ["--restart", "unless-stopped", "--network", "none", *labels]
    return dockerd.docker(*run_args(dockerd, name, *flags), *fake_engine_argv(*HOG)).stdout.strip()


@pytest.mark.docker
def test_gate_pauses_the_restart_releases_it_once_settled_and_a_second_kill_stops_it(
    dockerd: Dockerd, agent: RunningDaemon, receiver: Receiver
) -> None:
    name = "sw-ak-gate"
    seen: list[str] = []
    stop = threading.Event()
    cid = run_engine(dockerd, name)
    watcher = threading.Thread(target=watch_states, args=(dockerd, name, stop, seen), daemon=True)
    watcher.start()
    try:
        first: dict[str, Any] = wait_for_event(agent.events_path, "kill", timeout_s=60)
        # The kill line and event name the container
        assert first["trigger"] == "budget" and [c["id"] for c in first["containers"]] == [cid]
        assert any("in container " in line and cid[:12] in line and "KILL" in line for line in agent.stderr_lines)
        gated: dict[str, Any] = wait_for_event(agent.events_path, "container_gated", timeout_s=30)
        assert (gated["container_id"], gated["container_name"], gated["error"]) == (cid, name, None)
        assert gated["policy_source"] == "config" and gated["kill_trigger"] == "budget"
        assert gated["need_source"] == "kill footprint" or gated["need_bytes"] is None
        # paused soon after dockerd's restart: before the engine could reach its spike
        assert gated["restart_to_pause_ms"] < 2000, gated
        assert wait_until(lambda: "paused" in seen, 5), seen
        metrics = scrape(agent.port)
        assert f'sparkwatch_container_gated{{id="{cid[:12]}",name="{name}"}} 1.0' in metrics
        released: dict[str, Any] = wait_for_event(agent.events_path, "container_released", timeout_s=60)
        assert (released["by"], released["error"], released["container_id"]) == ("sparkwatch", None, cid)
        assert released["gated_s"] >= 4.0  # the settle's quiet period
        assert wait_until(lambda: seen[-1] == "running" and seen.count("paused") == 1, 10), seen
        assert "sparkwatch_container_gated{" not in scrape(agent.port)
        # Running again, it spikes again: the second kill within the window is a loop, which always stops
        loop: dict[str, Any] = wait_for_event(agent.events_path, "container_kill_loop", timeout_s=60)
        assert (loop["container_id"], loop["stopped"], loop["kills"]) == (cid, True, 2)
        assert name in loop["fix"] and "budget" in loop["fix"]
        assert wait_until(lambda: status_of(dockerd, name) == "exited", 10), seen
        time.sleep(3)  # dockerd's restart delay is 100 ms: a restart would have come
        assert status_of(dockerd, name) == "exited"
        assert len(kinds(agent, "kill")) == 2
        assert len(kinds(agent, "container_gated")) == 1 and len(kinds(agent, "container_kill_loop")) == 1
        assert wait_until(lambda: len(alerts(receiver, "container_kill_loop")) == 1, 10), receiver.deliveries
        [alert] = alerts(receiver, "container_kill_loop")
        assert name in str(alert["text"]) and "Fix:" in str(alert["text"])
        assert not alerts(receiver, "container_gated")  # a gate is recorded, not alerted
    finally:
        stop.set()
        watcher.join(15)
        dockerd.remove(name)


@pytest.mark.docker
def test_stop_by_label_cancels_the_restart_after_the_first_kill(dockerd: Dockerd, agent: RunningDaemon) -> None:
    name = "sw-ak-stop"
    cid = run_engine(dockerd, name, "--label", "io.sparkwatch.after-kill=stop")
    try:
        kill: dict[str, Any] = wait_for_event(agent.events_path, "kill", timeout_s=60)
        assert [c["id"] for c in kill["containers"]] == [cid]
        stopped: dict[str, Any] = wait_for_event(agent.events_path, "container_stopped", timeout_s=30)
        assert (stopped["container_id"], stopped["policy_source"], stopped["error"]) == (cid, "label", None)
        assert wait_until(lambda: status_of(dockerd, name) == "exited", 10)
        time.sleep(3)
        assert status_of(dockerd, name) == "exited"
        policy = dockerd.inspect(name)["HostConfig"]
        assert isinstance(policy, dict) and policy["RestartPolicy"]["Name"] == "unless-stopped"  # left as written
        assert len(kinds(agent, "kill")) == 1
        assert not kinds(agent, "container_gated")
    finally:
        dockerd.remove(name)


@pytest.mark.docker
@pytest.mark.parametrize("agent", ["allow"], indirect=True)
def test_allow_lets_the_restart_run_named_and_the_loop_still_stops_it(dockerd: Dockerd, agent: RunningDaemon) -> None:
    name = "sw-ak-allow"
    cid = run_engine(dockerd, name)
    try:
        allowed: dict[str, Any] = wait_for_event(agent.events_path, "container_allowed", timeout_s=60)
        assert (allowed["container_id"], allowed["container_name"], allowed["policy_source"]) == (cid, name, "config")
        loop: dict[str, Any] = wait_for_event(agent.events_path, "container_kill_loop", timeout_s=60)
        assert loop["container_id"] == cid and loop["stopped"]
        assert wait_until(lambda: status_of(dockerd, name) == "exited", 10)
        time.sleep(3)
        assert status_of(dockerd, name) == "exited"
        assert len(kinds(agent, "kill")) == 2
    finally:
        dockerd.remove(name)


def store_of(*facts: ContainerFacts) -> ContainerStore:
    """The containers as the watch would have them once up: each container's facts."""
    store = ContainerStore()
    store.replace({f.id: f for f in facts})
    store.up = True
    return store


def test_a_telemetry_that_starts_again_takes_up_the_gates_still_paused(tmp_path: Path) -> None:
    """The event log says what a previous telemetry process held: a container still paused is held again (and
    released by the gate's rule), one no longer paused is recorded as no longer held, so `status` stops showing it."""
    settings = load_settings(None, {"state_dir": tmp_path / "state"})
    events = EventLog(settings.events_path)
    other = "ab" * 32
    for cid, name in ((CID, "sw-still"), (other, "sw-gone")):
        fields = {"container_id": cid, "container_name": name, "image": "img", "need_bytes": 1 * GiB,
                  "need_source": "kill footprint", "error": None}  # fmt: skip
        events.append(make_event(EventKind.CONTAINER_GATED, "paused", fields))
    assert len(gated_now(read_events(settings.events_path))) == 2
    still = ContainerFacts(CID, "sw-still", "img", "paused", 4242, "unless-stopped", restart_count=1)
    gone = ContainerFacts(other, "sw-gone", "img", "running", 4343, "unless-stopped", restart_count=1)
    watch = AfterKillWatch(
        settings,
        events,
        containers=store_of(still, gone),
        socket_path=None,
        where="a test",
    )
    watch.start()
    try:
        assert wait_until(lambda: [g.container_id for g in watch.gated()] == [CID], 10)
        [held] = watch.gated()
        assert held.need == Need(1 * GiB, "kill footprint")
        [view] = gated_now(read_events(settings.events_path))
        assert view.container_id == CID
        [released] = [e for e in read_events(settings.events_path) if e["kind"] == "container_released"]
        assert (released["container_id"], released["by"]) == (other, "owner")
    finally:
        watch.stop()


def test_without_docker_the_worker_sleeps_and_takes_up_the_gates_once_the_api_answers(tmp_path: Path) -> None:
    """A node without Docker never wakes the worker (it looked once a second for the watch, two minutes after each
    start); the container watch's word that the API answers (`containers_up`) brings the gates left held."""
    settings = load_settings(None, {"state_dir": tmp_path / "state"})
    events = EventLog(settings.events_path)
    fields = {"container_id": CID, "container_name": "sw-still", "image": "img", "need_bytes": 1 * GiB,
              "need_source": "kill footprint", "error": None}  # fmt: skip
    events.append(make_event(EventKind.CONTAINER_GATED, "paused", fields))
    store = ContainerStore()  # as the watch has it while no daemon answers
    watch = AfterKillWatch(settings, events, containers=store, socket_path=None, where="a test")
    watch.start()
    try:
        time.sleep(0.3)  # started, and asleep
        before = wakeups(watch._thread)
        time.sleep(3.0)
        assert wakeups(watch._thread) - before <= 1  # looking once a second it woke 3 times
        assert watch.gated() == ()
        still = ContainerFacts(CID, "sw-still", "img", "paused", 4242, "unless-stopped", restart_count=1)
        store.replace({CID: still})
        store.up = True
        watch.containers_up()  # the watch's on_up (telemetry/telemetryprocess.py wires it)
        assert wait_until(lambda: [g.container_id for g in watch.gated()] == [CID], 10)
    finally:
        watch.stop()
