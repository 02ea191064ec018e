"""Engines in containers under a real dockerd (tests/dockerd.py) and a real `sparkwatch run`: the guard enforces a
container's io.sparkwatch.budget and io.sparkwatch.protect labels (telemetry reads them, the guard matches its own
trees by the container id in their cgroup paths), and the kill line, the kill event, `sparkwatch engines` and
/metrics name the container as `docker ps` does. Memory stays bounded: budgets of 300 MiB, engines of at most
800 MiB.

The session's dockerd is the subreaper of its containers' shims (tests/dockerd.py), so their processes descend from the
test and the daemon, confined to the test's descendants, may kill them and nothing else."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common.eventlog import read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from tests.conftest import alive, require, wait_until
from tests.daemon import RunningDaemon, scrape, sparkwatch_run, wait_for_event
from tests.dockerd import IMAGE, Dockerd, fake_engine_argv, run_args

pytestmark = [pytest.mark.docker, pytest.mark.pressure]
MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parent.parent


def enough_memory(need: int) -> None:
    with MeminfoReader() as r:
        avail = r.read().available_bytes
    require(
        avail > need + 2 * GiB, f"needs {need >> 20} MiB more than the 2 GiB kept free; {avail >> 20} MiB available"
    )


class Containers:
    """The containers a test started, removed at the end."""

    def __init__(self, dockerd: Dockerd) -> None:
        self.dockerd = dockerd
        self.names: list[str] = []

    def run(self, name: str, *flags: str, engine: tuple[str, ...]) -> tuple[str, int]:
        """Start one: (its id, its PID 1 on the host)."""
        self.dockerd.remove(name)
        self.names.append(name)
        cid = self.dockerd.docker(*run_args(self.dockerd, name, "--restart", "no", *flags), *engine).stdout.strip()
        return cid, self.dockerd.container_pid(cid)

    def close(self) -> None:
        self.dockerd.remove(*self.names)


@pytest.fixture
def containers(dockerd: Dockerd) -> Iterator[Containers]:
    c = Containers(dockerd)
    try:
        yield c
    finally:
        c.close()


def engine(title: str, *hog: str) -> tuple[str, ...]:
    return tuple(fake_engine_argv("--title", title, *hog))


def state_of(dockerd: Dockerd, name: str) -> dict[str, Any]:
    state = dockerd.inspect(name)["State"]
    assert isinstance(state, dict)
    return state


def line_with(daemon: RunningDaemon, *parts: str, timeout_s: float = 15.0) -> str:
    """The daemon's first stderr line holding every one of `parts`, waited for."""

    def find() -> str | None:
        return next((x for x in daemon.stderr_lines if all(p in x for p in parts)), None)

    wait_until(lambda: find() is not None, timeout_s)
    found = find()
    assert found is not None, f"no line with {parts}:\n" + "\n".join(daemon.stderr_lines[-50:])
    return found


def kills(daemon: RunningDaemon) -> list[dict[str, Any]]:
    return [e for e in read_events(daemon.events_path) if e["kind"] == "kill"]


def test_a_containers_budget_label_kills_its_engine_alone_and_the_record_names_the_container(
    dockerd: Dockerd, containers: Containers, tmp_path: Path
) -> None:
    """`--label io.sparkwatch.budget=300MiB` on a container whose engine (its PID 1) grows to 800 MiB: the guard kills
    it alone (budget source `label`), far above the floor; the kill line, the summary and the event's `containers`
    name it by name, image and compose service; `--restart no` leaves it exited."""
    enough_memory(1200 * MiB)
    name = "sw-lbl-budget"
    with sparkwatch_run(tmp_path, env={"DOCKER_HOST": dockerd.host}) as daemon:
        cid, pid = containers.run(
            name,
            "--label", "io.sparkwatch.budget=300MiB",
            "--label", "com.docker.compose.project=spark",
            "--label", "com.docker.compose.service=vllm",
            engine=engine("VLLM::EngineCore", "--hog-rate-mib", "150", "--hog-limit-mib", "800"),
        )  # fmt: skip
        event: dict[str, Any] = wait_for_event(daemon.events_path, "kill", timeout_s=60)
        assert event["trigger"] == "budget" and event["budget_source"] == "label", event
        assert event["budget_bytes"] == 300 * MiB and event["footprint_bytes"] > 300 * MiB + 256 * MiB
        assert event["mem_available_bytes"] > event["floor_bytes"] + 1 * GiB  # the label did it, not the floor
        assert {v["pid"] for v in event["victims"]} >= {pid}
        assert event["containers"] == [
            {
                "root_pid": pid,
                "runtime": "docker",
                "id": cid,
                "name": name,
                "image": IMAGE,
                "compose_project": "spark",
                "compose_service": "vllm",
            }
        ]
        words = f"in container {name} ({IMAGE} spark/vllm; {cid[:12]})"
        assert words in event["summary"]
        line = line_with(daemon, "KILL vllm tree")
        assert f"root={pid} {words}" in line and "(label)" in line, line
        assert wait_until(lambda: state_of(dockerd, name)["Status"] == "exited", 10)
        time.sleep(1.0)
        assert state_of(dockerd, name)["Status"] == "exited" and len(kills(daemon)) == 1


def test_a_protected_container_is_not_killed_under_the_budget_that_kills_its_twin(
    dockerd: Dockerd, containers: Containers, tmp_path: Path
) -> None:
    """Two containers run the same engine, growing past the config's budget (300 MiB) to 700 MiB: the one labelled
    io.sparkwatch.protect=true lives, held past its budget and its margin, and the log says once why it is not held;
    its twin, unlabelled, dies of that same budget (the pressure was real)."""
    enough_memory(1800 * MiB)
    budgets = json.dumps(["300MiB=sw-twin"])
    with sparkwatch_run(tmp_path, env={"DOCKER_HOST": dockerd.host, "SPARKWATCH_ENGINE_BUDGETS": budgets}) as daemon:
        hog = ("--hog-rate-mib", "150", "--hog-limit-mib", "700")
        _kept_id, kept = containers.run(
            "sw-lbl-protected", "--label", "io.sparkwatch.protect=true", engine=engine("VLLM::EngineCore_sw-twin", *hog)
        )
        _twin_id, twin = containers.run("sw-lbl-twin", engine=engine("VLLM::EngineCore_sw-twin", *hog))
        event: dict[str, Any] = wait_for_event(daemon.events_path, "kill", timeout_s=60)
        assert event["trigger"] == "budget" and event["budget_source"] == "config"
        assert twin in {v["pid"] for v in event["victims"]} and kept not in {v["pid"] for v in event["victims"]}
        said = line_with(daemon, f"root={kept}", "is protected")
        assert "container sw-lbl-protected" in said and "io.sparkwatch.protect=true" in said and "(config)" in said
        # Held past budget + margin for longer than the guard's debounce, still alive.
        assert wait_until(lambda: tree_rss(kept) > 300 * MiB + 256 * MiB + 64 * MiB, 20), tree_rss(kept)
        time.sleep(3.0)
        assert alive(kept) and state_of(dockerd, "sw-lbl-protected")["Status"] == "running"
        assert all(kept not in {v["pid"] for v in e["victims"]} for e in kills(daemon))
        assert sum(1 for x in daemon.stderr_lines if f"root={kept}" in x and "is protected" in x) == 1  # once


def info_series(text: str) -> list[dict[str, str]]:
    """The label sets of every sparkwatch_container_info series of value 1 in an exposition."""
    out = []
    for line in text.splitlines():
        if line.startswith("sparkwatch_container_info{") and line.endswith("} 1.0"):
            body = line[len("sparkwatch_container_info{") : -len("} 1.0")]
            out.append(dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', body)))
    return out


def tree_rss(pid: int) -> int:
    """RSS of a process and its children (the fake engine and its hog), from /proc."""
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for task in Path(f"/proc/{p}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


NAMED = (
    "--label",
    "com.docker.compose.project=spark",
    "--label",
    "com.docker.compose.service=chat",
    "--network",
    "none",
)


def test_metrics_name_the_container_an_engine_runs_in(dockerd: Dockerd, containers: Containers, tmp_path: Path) -> None:
    """The daemon's /metrics has one `sparkwatch_container_info` series for the container an engine runs in, with its
    name, image, compose project and service, restart policy and network mode."""
    name = "sw-lbl-metric"
    with sparkwatch_run(tmp_path, env={"DOCKER_HOST": dockerd.host}) as daemon:
        cid, _pid = containers.run(name, *NAMED, engine=engine("VLLM::EngineCore"))
        want = {
            "id": cid,
            "name": name,
            "image": IMAGE,
            "compose_project": "spark",
            "compose_service": "chat",
            "restart_policy": "no",
            "network_mode": "none",
        }
        assert wait_until(lambda: want in info_series(scrape(daemon.port)), 20), info_series(scrape(daemon.port))


def test_engines_names_the_container_and_says_once_when_the_socket_cannot_be_read(
    dockerd: Dockerd, containers: Containers, tmp_path: Path
) -> None:
    """`sparkwatch engines --json` reads the Docker API itself (no daemon needed): the engine's `container` has its
    id and runtime from the cgroup path and its name, image, compose service, restart policy and network mode from
    the API; with a socket that cannot be read, the id alone, and `containers_note` says why, once."""
    name = "sw-lbl-engines"
    cid, pid = containers.run(name, *NAMED, engine=engine("VLLM::EngineCore"))

    def engines(host: str) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
        env.update(DOCKER_HOST=host, XDG_CONFIG_HOME=str(tmp_path / "xdg"))
        deadline = time.monotonic() + 20
        while True:  # until the engine has set its title (an engine tree from then on)
            done = subprocess.run(
                [sys.executable, "-m", "sparkwatch", "engines", "--json", "--no-probe", "--window", "0"],
                env=env, capture_output=True, text=True, timeout=60, check=True, cwd=REPO,
            )  # fmt: skip
            out: dict[str, Any] = json.loads(done.stdout)
            if any(e["root_pid"] == pid for e in out["engines"]) or time.monotonic() > deadline:
                return out
            time.sleep(0.2)

    out = engines(dockerd.host)
    [mine] = [e for e in out["engines"] if e["root_pid"] == pid]
    assert mine["container"] == {
        "id": cid,
        "runtime": "docker",
        "name": name,
        "image": IMAGE,
        "compose_project": "spark",
        "compose_service": "chat",
        "restart_policy": "no",
        "network_mode": "none",
    }
    assert out["containers_note"] is None
    blind = engines(f"unix://{tmp_path}/no-docker.sock")
    [mine] = [e for e in blind["engines"] if e["root_pid"] == pid]
    assert mine["container"] == {"id": cid, "runtime": "docker"}
    assert "named by id only" in blind["containers_note"]
    # `status` names it too, where the root's parent (the runtime's shim) would be
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(DOCKER_HOST=dockerd.host, XDG_CONFIG_HOME=str(tmp_path / "xdg"), COLUMNS="400")
    env.update(SPARKWATCH_STATE_DIR=str(tmp_path / "state"), SPARKWATCH_PROBE_INTERVAL_S="0")
    frame = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "status", "--once"],
        env=env, capture_output=True, text=True, timeout=60, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    [line] = [x for x in frame.splitlines() if f"vllm {pid} ·" in x]
    assert f"in container {name} ({IMAGE} spark/chat; {cid[:12]}), restart no" in line, line
