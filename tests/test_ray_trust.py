"""A Ray cluster belongs to a user (issue 37; docs/security.md): tried as another local user (uid 65534, nobody)
against an agent running as root, with real processes and real sockets.

- a process of theirs that only calls itself `raylet` is no raylet (the executable decides, not the name);
- the placement-group helper, whose interpreter comes from a raylet's command line, runs as that raylet's user, its
  groups, a clean environment, and only from an interpreter that user or root owns: never as root;
- a dashboard on this node speaks for the user whose process holds its port, so Ray's state served by another user's
  process moves nothing for root's raylets.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.config.settings import load_settings
from sparkwatch.core.kill import raygroup
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.raywatch import NoPeers, RayWatch
from sparkwatch.telemetry.sources.listeners import connected_to
from sparkwatch.telemetry.sources.raylets import RAYLET_EXE_SUFFIX, LocalRaylet, local_raylets
from sparkwatch.telemetry.sources.raystate import cluster_owner, dashboard_owner, local_dashboard_url, start_remove_pg
from tests.conftest import require, wait_until

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # the suite's own interpreter may sit under root's home, which nobody cannot reach
NODE_ID = "a" * 56
LISTEN = """
import socket, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


def _as(uid: int) -> dict[str, object]:
    return {"user": uid, "group": uid, "extra_groups": []}


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A directory another user can reach and write (pytest's own tmp dirs are under root's 0700 one)."""
    require(os.geteuid() == 0, "acting as another user needs root (CI runs as root)")
    out = Path(tempfile.mkdtemp(prefix="sparkwatch-nobody-"))
    out.chmod(0o1777)
    try:
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes a test started (and only those are ever signalled)."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(5)
        if p.stdout is not None:
            p.stdout.close()


def _raylet_argv(python: str) -> list[str]:
    return [f"--node_id={NODE_ID}", "--gcs-address=127.0.0.1:6379", f"--python_worker_command={python} worker.py"]


def test_a_process_of_another_user_named_raylet_is_no_raylet(
    world_dir: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """Named `raylet` (its comm: the executable's name) with a raylet's command line, run by nobody: not a raylet.
    The same program at Ray's own path is a raylet, and nobody's: its cluster is nobody's."""
    fake = world_dir / "raylet"
    shutil.copy("/bin/sh", fake)  # a shell that stays (two commands: no exec of the last)
    shaped = world_dir / RAYLET_EXE_SUFFIX.lstrip("/")
    shaped.parent.mkdir(parents=True)
    shutil.copy("/bin/sh", shaped)
    for exe in (fake, shaped):
        argv = [str(exe), "-c", "sleep 60; exit 0", "raylet", *_raylet_argv("/tmp/evil")]
        started.append(subprocess.Popen(argv, **_as(NOBODY)))  # type: ignore[call-overload]
    pids = {p.pid for p in started}
    assert wait_until(lambda: all(Path(f"/proc/{pid}/comm").read_text().strip() == "raylet" for pid in pids))
    assert all(p.poll() is None for p in started)
    table = ProcScanner(Path("/proc")).scan().procs
    found = [r for r in local_raylets(table, Path("/proc")) if r.pid in pids]
    assert [(r.pid, r.uid) for r in found] == [(started[1].pid, NOBODY)]


def _recorder(world_dir: Path, owner: int) -> tuple[Path, Path]:
    """An "interpreter" that records who ran it and with what environment (a shell script, owned by `owner`)."""
    script = world_dir / f"python-{owner}"
    out = world_dir / f"ran-{owner}"
    script.write_text(f'#!/bin/sh\n{{ id -u; id -g; id -G; env; pwd; }} > "{out}"\n')
    script.chmod(0o755)
    os.chown(script, owner, owner)
    return script, out


def test_the_placement_group_helper_runs_as_the_raylet_s_user_never_as_root(
    world_dir: Path, started: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On today's main the helper ran the path on the raylet's command line as root, with root's environment."""
    monkeypatch.setenv("SPARKWATCH_WEBHOOK_SECRET", "s3cret-of-root")
    raylet = subprocess.Popen(["sleep", "60"], **_as(NOBODY))  # type: ignore[call-overload]
    started.append(raylet)
    script, out = _recorder(world_dir, NOBODY)
    helper = start_remove_pg(LocalRaylet(raylet.pid, NODE_ID, "127.0.0.1:6379", str(script), uid=NOBODY), "ab" * 9)
    assert helper.wait(10) == 0
    uid, gid, groups, *rest = out.read_text().splitlines()
    assert (int(uid), int(gid), groups.split()) == (NOBODY, NOBODY, [str(NOBODY)])
    env = dict(line.split("=", 1) for line in rest if "=" in line)
    assert "SPARKWATCH_WEBHOOK_SECRET" not in env and env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert rest[-1] == "/"


def test_the_helper_never_runs_a_third_user_s_interpreter_nor_for_a_raylet_gone(
    world_dir: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """The raylet's user is nobody; an interpreter owned by uid 12345 would be a third user's code: refused, not run.
    A raylet that is no longer that user's process (gone, or its pid reused) is refused too."""
    raylet = subprocess.Popen(["sleep", "60"], **_as(NOBODY))  # type: ignore[call-overload]
    started.append(raylet)
    script, out = _recorder(world_dir, 12345)
    with pytest.raises(PermissionError, match="uid 12345"):
        start_remove_pg(LocalRaylet(raylet.pid, NODE_ID, "127.0.0.1:6379", str(script), uid=NOBODY), "ab" * 9)
    with pytest.raises(PermissionError, match="absolute"):
        start_remove_pg(LocalRaylet(raylet.pid, NODE_ID, "127.0.0.1:6379", "python3", uid=NOBODY), "ab" * 9)
    root_script, _ = _recorder(world_dir, 0)
    with pytest.raises(OSError, match="no longer"):  # the pid is nobody's, not root's
        start_remove_pg(LocalRaylet(raylet.pid, NODE_ID, "127.0.0.1:6379", str(root_script), uid=0), "ab" * 9)
    assert not out.exists()


def test_a_dashboard_port_held_by_another_user_moves_nothing_for_root_s_raylets(
    world_dir: Path, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """Any user may bind the dashboard's port while Ray's dashboard is down and answer Ray's state API. Its answer
    is that user's word: root's raylets take no cluster from it (no teardown, budget or removal), and a port held by
    the raylets' own user is believed."""
    listeners = {}
    for uid in (NOBODY, os.geteuid()):
        p = subprocess.Popen([SYSTEM_PYTHON, "-c", LISTEN], stdout=subprocess.PIPE, **_as(uid))  # type: ignore[call-overload]
        started.append(p)
        assert p.stdout is not None
        listeners[uid] = int(p.stdout.readline())
    theirs, ours = (f"http://127.0.0.1:{listeners[u]}" for u in (NOBODY, os.geteuid()))
    assert dashboard_owner(theirs, "/proc").uid == NOBODY
    assert dashboard_owner(ours, "/proc").uid == os.geteuid()
    nothing = dashboard_owner("http://127.0.0.1:9", "/proc")
    assert nothing.uid is None and "nothing listens" in nothing.why
    roots = (LocalRaylet(os.getpid(), NODE_ID, "127.0.0.1:6379", sys.executable, uid=os.geteuid()),)
    assert cluster_owner(theirs, "/proc") == (NOBODY, None)

    def watch_for(url: str) -> RayWatch:
        settings = load_settings(None, {"state_dir": tmp_path, "ray_dashboard_url": url}, check_memory=False)
        watch = RayWatch(settings, lambda msg: None)
        watch.raylets = roots
        watch._trust()
        return watch

    assert watch_for(theirs).cluster is None
    assert "65534" in (watch_for(theirs).untrusted_why or "")
    assert watch_for(ours).cluster == raygroup.Cluster(frozenset({NODE_ID}), os.geteuid(), frozenset({os.getpid()}))
    # another host's dashboard: the cluster of this node's raylets whose GCS is on that host, and none other
    assert cluster_owner("http://192.0.2.7:8265", "/proc")[0] is None


DASHBOARD = """
import socket, sys, time
port = int(next(a for a in sys.argv if a.startswith("--port=")).split("=")[1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.listen()
print("up", flush=True)
time.sleep(60)
"""


def test_the_raylets_user_s_own_dashboard_is_found_on_another_port(
    world_dir: Path, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """`ray start --head --dashboard-port N`: the dashboard the raylets' own user started (Ray's dashboard.py, its
    `--port=`, its socket that user's) is read without `ray_dashboard_url`; another user's process of that shape
    and port is never taken for it."""
    script = world_dir / "ray" / "dashboard" / "dashboard.py"
    script.parent.mkdir(parents=True)
    script.write_text(DASHBOARD)
    script.chmod(0o755)
    ports = {}
    for uid in (NOBODY, os.geteuid()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports[uid] = s.getsockname()[1]
        argv = [SYSTEM_PYTHON, "-u", str(script), "--host=0.0.0.0", f"--port={ports[uid]}", "--port-retries=0"]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, **_as(uid))  # type: ignore[call-overload]
        started.append(p)
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
    table = ProcScanner(Path("/proc")).scan().procs
    assert local_dashboard_url(table, os.geteuid(), "/proc") == f"http://127.0.0.1:{ports[os.geteuid()]}"
    assert local_dashboard_url(table, NOBODY, "/proc") == f"http://127.0.0.1:{ports[NOBODY]}"
    assert local_dashboard_url(table, 4321, "/proc") is None
    settings = load_settings(
        None, {"state_dir": tmp_path, "ray_dashboard_url": "http://127.0.0.1:9"}, check_memory=False
    )
    watch = RayWatch(settings, lambda msg: None)
    watch.raylets = (LocalRaylet(os.getpid(), NODE_ID, "127.0.0.1:6379", sys.executable, uid=os.geteuid()),)
    watch._trust(tuple(p for p in table if p.uid == NOBODY))  # only nobody's: never root's cluster
    assert watch.cluster is None and watch.source.conn.base_url == "http://127.0.0.1:9"
    watch._trust(table)
    cluster: raygroup.Cluster | None = watch.cluster  # (mypy keeps the None narrowed across the call)
    assert cluster is not None and cluster.uid == os.geteuid()
    assert watch.source.conn.base_url == f"http://127.0.0.1:{ports[os.geteuid()]}"


class _Relaying(NoPeers):
    """The peer watch as the group watch asks it, relaying one proven document's Ray state (peerdoc.RayRelay)."""

    def __init__(self, relay: peerdoc.RayRelay | None) -> None:
        self.relay = relay
        self.asked: list[frozenset[str]] = []

    def ray_state(self, gcs_addresses: frozenset[str]) -> peerdoc.RayRelay | None:
        self.asked.append(gcs_addresses)
        return self.relay


def _state() -> raygroup.RayState:
    return raygroup.RayState(
        nodes=(raygroup.RayNode(NODE_ID, "10.0.0.2", True), raygroup.RayNode("b" * 56, "10.0.0.1", True)),
        jobs=(raygroup.RayJob("01000000", 100, "10.0.0.1", True), raygroup.RayJob("02000000", 7, "10.0.0.1", False)),
        actors=(
            raygroup.RayActor("x1", "RayWorkerWrapper", "DEAD", "01000000", NODE_ID, 300, "pg1"),
            raygroup.RayActor("x2", "RayWorkerWrapper", "ALIVE", "01000000", "b" * 56, 200, "pg1"),
            raygroup.RayActor("x3", "Other", "DEAD", "02000000", "b" * 56, 9, None),
        ),
        placement_groups=(
            raygroup.RayPlacementGroup("pg1", "01000000", "CREATED", (NODE_ID, "b" * 56)),
            raygroup.RayPlacementGroup("pg0", "02000000", "REMOVED", ()),
        ),
    )


def test_another_host_s_ray_state_moves_this_node_only_as_a_proven_peer_relays_it(tmp_path: Path) -> None:
    """A worker node reads the head's dashboard over the link: plain HTTP that any host there can answer. Its word
    is display-only; the state the head's agent relays in its proven document speaks for this node's raylets of that
    cluster (its GCS, its user), and for no other user's."""
    settings = load_settings(
        None, {"state_dir": tmp_path, "ray_dashboard_url": "http://192.0.2.7:8265"}, check_memory=False
    )
    mine = LocalRaylet(os.getpid(), NODE_ID, "10.0.0.1:6379", sys.executable, "10.0.0.2", uid=os.geteuid())
    relay = peerdoc.relay("10.0.0.1:6379", os.geteuid(), _state())
    assert relay is not None and [a.actor_id for a in relay.actors] == ["x1", "x2"]  # the live groups' only
    assert [g.placement_group_id for g in relay.placement_groups] == ["pg1"] and len(relay.jobs) == 1
    for told, cluster in (
        (None, None),
        (replace(relay, uid=NOBODY), None),  # the relayed cluster is another user's
        (replace(relay, gcs_address="10.0.0.9:6379"), None),  # another cluster's (asked by GCS: never returned)
        (relay, raygroup.Cluster(frozenset({NODE_ID}), os.geteuid(), frozenset({os.getpid()}))),
    ):
        peers = _Relaying(told if told is None or told.gcs_address == mine.gcs_address else None)
        watch = RayWatch(settings, lambda msg: None, peers=peers)
        watch.raylets = (mine,)
        watch._trust()
        assert watch.remote and watch.cluster is None
        state = watch._relayed()
        assert peers.asked == [frozenset({"10.0.0.1:6379"})]
        assert watch.cluster == cluster
        assert (state is not None) == (cluster is not None)
        assert (watch.untrusted_why is None) == (cluster is not None)
        if state is not None:
            assert state == relay.state
    # the relay travels inside the peer document, held to its caps
    body = peerdoc.build("spark-a", (NODE_ID,), None, (), (), ray=relay)
    assert peerdoc.parse(body).ray == relay
    crowded = replace(relay, actors=relay.actors * 200)
    with pytest.raises(ValueError, match="ray: 400 actors"):
        peerdoc.parse(peerdoc.build("spark-a", (NODE_ID,), None, (), (), ray=crowded))
    assert peerdoc.relay("10.0.0.1:6379", 0, replace(_state(), actors=_state().actors * 200)) is None


CLIENT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("up", flush=True)
time.sleep(60)
"""


def test_a_driver_is_one_only_while_it_holds_a_connection_to_its_cluster_s_gcs(
    started: list[subprocess.Popen[bytes]],
) -> None:
    """Ray's state names a job's driver by pid; the group watch takes it for a member only while that process holds
    an established connection to the GCS its raylets name (a Ray driver keeps one open while it runs)."""
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        port = gcs.getsockname()[1]
        driver = subprocess.Popen([SYSTEM_PYTHON, "-c", CLIENT, str(port)], stdout=subprocess.PIPE)
        bystander = subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE)
        started += [driver, bystander]
        assert driver.stdout is not None and driver.stdout.readline() == b"up\n"
        conn, _addr = gcs.accept()
        with conn:
            assert connected_to("/proc", driver.pid, "127.0.0.1", port)
            assert not connected_to("/proc", bystander.pid, "127.0.0.1", port)
            assert not connected_to("/proc", driver.pid, "127.0.0.1", port + 1 if port < 65535 else port - 1)
            assert not connected_to("/proc", driver.pid, "not-an-address", port)


def test_a_box_without_a_raylet_asks_nothing_of_who_holds_the_dashboard_s_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group watch looks for raylets when telemetry's table shows one; finding none, it ties no cluster and asks
    the kernel nothing (no sock_diag dump, no route lookup): a watch with nothing to watch costs nothing."""
    from sparkwatch.telemetry import raywatch

    asked: list[str] = []

    def cluster_owner(url: str, proc_root: object) -> tuple[int | None, str | None]:
        asked.append(url)
        return None, "nothing listens"

    def is_local_url(url: str) -> bool:
        asked.append(url)
        return True

    monkeypatch.setattr(raywatch, "cluster_owner", cluster_owner)
    monkeypatch.setattr(raywatch, "is_local_url", is_local_url)
    settings = load_settings(None, {"state_dir": tmp_path}, check_memory=False)
    watch = RayWatch(settings, lambda msg: None)
    watch._trust(())
    assert asked == [] and watch.cluster is None and not watch.remote and watch.untrusted_why is None
    watch.raylets = (LocalRaylet(os.getpid(), NODE_ID, "127.0.0.1:6379", sys.executable, uid=os.geteuid()),)
    watch._trust(())
    assert asked  # with a raylet, the port's owner is asked
