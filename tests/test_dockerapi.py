"""The Docker Engine API client and the container watch, against a real dockerd (tests/dockerd.py), and the label
and socket rules."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sparkwatch.core.container import AfterKill, ContainerFacts, label_asks
from sparkwatch.telemetry.containerwatch import ContainerWatch
from sparkwatch.telemetry.sources.dockerapi import DEFAULT_SOCKET, DockerApi, DockerApiError, DockerEvent, docker_socket
from tests.dockerd import IMAGE, Dockerd, run_args

SLEEP = ("python3", "-c", "import time; time.sleep(600)")


def test_docker_socket_follows_setting_then_docker_host_then_default() -> None:
    assert docker_socket("/srv/podman.sock", {"DOCKER_HOST": "unix:///x.sock"})[0] == "/srv/podman.sock"
    assert docker_socket("", {"DOCKER_HOST": "unix:///run/user/1000/docker.sock"})[0] == "/run/user/1000/docker.sock"
    assert docker_socket("", {})[0] == DEFAULT_SOCKET
    path, why = docker_socket("", {"DOCKER_HOST": "tcp://10.0.0.2:2375"})
    assert path is None and "not a unix socket" in why


def test_labels_parse_and_bad_values_are_named_and_ignored() -> None:
    asks = label_asks(
        {
            "io.sparkwatch.after-kill": "STOP",
            "io.sparkwatch.budget": "60GiB",
            "io.sparkwatch.protect": "true",
            "io.sparkwatch.priority": "-3",
        }
    )
    assert (asks.after_kill, asks.budget_bytes, asks.protect, asks.priority) == (AfterKill.STOP, 60 << 30, True, -3)
    assert asks.problems == ()
    bad = label_asks(
        {"io.sparkwatch.budget": "lots", "io.sparkwatch.after-kill": "pause", "io.sparkwatch.protect": "?"}
    )
    assert (bad.budget_bytes, bad.after_kill, bad.protect) == (None, None, None)
    assert [p.split("=")[0] for p in bad.problems] == [
        "io.sparkwatch.after-kill",
        "io.sparkwatch.budget",
        "io.sparkwatch.protect",
    ]


def test_no_daemon_is_counted_and_said_never_raised(tmp_path: Path) -> None:
    ups: list[bool] = []
    watch = ContainerWatch(
        str(tmp_path / "absent.sock"), "a test socket", retry_s=0.05, on_up=[lambda: ups.append(True)]
    )
    watch.start()
    try:
        deadline = time.monotonic() + 5
        while watch.errors["unreachable"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watch.stop()
    assert watch.errors["unreachable"] >= 2 and not watch.up and watch.error is not None
    assert ups == []  # nobody told of an API that never answered
    with pytest.raises(DockerApiError) as err:
        DockerApi(str(tmp_path / "absent.sock")).ping()
    assert err.value.kind == "unreachable"


@pytest.mark.docker
def test_inspect_names_what_an_owner_looks_for(dockerd: Dockerd, tmp_path: Path) -> None:
    name = "sw-api-inspect"
    dockerd.remove(name)
    flags = ["--restart", "unless-stopped", "-p", "127.0.0.1::8000", "-v", f"{tmp_path}:/models:ro"]
    flags += ["--label", "com.docker.compose.project=spark", "--label", "com.docker.compose.service=vllm"]
    cid = dockerd.docker(*run_args(dockerd, name, *flags, src=False), *SLEEP).stdout.strip()
    api = DockerApi(str(dockerd.socket))
    try:
        assert cid in api.running_ids()
        facts = api.inspect(name)
        assert facts is not None
        assert (facts.id, facts.name, facts.image, facts.state) == (cid, name, IMAGE, "running")
        assert facts.restart_policy == "unless-stopped" and facts.restarts_itself
        assert facts.pid == dockerd.container_pid(name)
        assert (facts.compose_project, facts.compose_service) == ("spark", "vllm")
        assert "spark/vllm" in facts.label()
        [port] = [p for p in facts.ports if p.host_ip == "127.0.0.1"]
        assert port.container_port == 8000 and port.host_port > 0
        [mount] = [m for m in facts.mounts if m.destination == "/models"]
        assert (mount.source, mount.read_write) == (str(tmp_path), False)
        assert facts.ip_addresses and facts.ip_addresses[0].startswith("172.29.")
        assert api.inspect("sw-no-such-container") is None
    finally:
        api.close()
        dockerd.remove(name)


@pytest.mark.docker
def test_watch_follows_a_container_and_the_apis_kill_cancels_its_restart(dockerd: Dockerd) -> None:
    name = "sw-api-watch"
    dockerd.remove(name)
    seen: list[tuple[str, ContainerFacts | None]] = []
    started = threading.Event()

    def on_event(event: DockerEvent, facts: ContainerFacts | None) -> None:
        if facts is not None and facts.name == name:
            seen.append((event.action, facts))
            if event.action == "start":
                started.set()

    came_up = threading.Event()
    watch = ContainerWatch(str(dockerd.socket), "the test daemon", subscribers=[on_event], on_up=[came_up.set])
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while not watch.up and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watch.up, watch.error
        assert came_up.wait(5)  # told, for the after-kill policy's gates left held (it no longer looks)
        cid = dockerd.docker(*run_args(dockerd, name, "--restart", "unless-stopped", src=False), *SLEEP).stdout.strip()
        assert started.wait(10), seen
        facts = watch.facts(cid)
        assert facts is not None and facts.state == "running" and facts in watch.running()

        api = DockerApi(str(dockerd.socket))
        try:
            api.pause(cid)
            assert dockerd.inspect(name)["State"]["Status"] == "paused"  # type: ignore[index]
            api.unpause(cid)
            api.kill(cid)
        finally:
            api.close()
        time.sleep(1.5)  # dockerd's restart delay is 100 ms: a restart would have happened
        state = dockerd.inspect(name)["State"]
        assert isinstance(state, dict) and state["Status"] == "exited", state
        actions = [a for a, _ in seen]
        assert actions.count("start") == 1 and "die" in actions and "pause" in actions
        gone = watch.facts(cid)
        assert gone is not None and gone.state == "exited" and gone not in watch.running()
    finally:
        watch.stop()
        dockerd.remove(name)
