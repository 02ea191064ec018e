"""`sparkwatch launch -- docker run …` and `-- docker-compose up SERVICE` against a real dockerd of the session's own
(tests/dockerd.py): the plan reads the mounted checkpoint on the host, the container's processes are the declared
engine a real guard holds to its budget, and Ctrl-C or a guard kill leaves no container running.

The engine is tests/helpers/boot_engine.py in the test image behind a `vllm` script mounted at /opt/sw (the
container's entrypoint): launch recognises `vllm serve /models/m` as vLLM, the stand-in prints vLLM's log lines and
allocates real memory. The guard sees the containers because the session's dockerd is their subreaper, a descendant
of the test process (tests/dockerd.py): `ancestor_pid` confines it to them and to nothing else on the box.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import sparkwatch_run, wait_for_event
from tests.dockerd import IMAGE, REPO, Dockerd
from tests.launchbox import Box, box_for, fitting_util, small_model, total_bytes, wait_ready

pytestmark = pytest.mark.docker


@pytest.fixture
def box(tmp_path: Path, dockerd: Dockerd) -> Iterator[Box]:
    yield from box_for(tmp_path)


def engine_dir(tmp: Path, *, ignore_int: bool = False) -> Path:
    """/opt/sw in the container: `vllm`, the stand-in engine (with `ignore_int`, deaf to SIGINT from its first
    instruction: Python keeps an ignored SIGINT ignored)."""
    sw = tmp / "sw"
    sw.mkdir()
    trap = "trap '' INT\n" if ignore_int else ""
    (sw / "vllm").write_text(f'#!/bin/sh\n{trap}exec python3 /src/tests/helpers/boot_engine.py --kind vllm "$@"\n')
    (sw / "vllm").chmod(0o755)
    return sw


def docker_env(box: Box, dockerd: Dockerd) -> dict[str, str]:
    return {**box.env, "DOCKER_HOST": dockerd.host}


def run_argv(name: str, sw: Path, model: Path, *flags: str, engine: tuple[str, ...] = ()) -> list[str]:
    """`docker run` of the stand-in vLLM with the model mounted at /models/m (no --init: launch adds it)."""
    return [
        "docker", "run", "--name", name, "--label", "io.sparkwatch.test=1", "--network", "none",
        "-v", f"{REPO}:/src:ro", "-e", "PYTHONDONTWRITEBYTECODE=1", "-v", f"{sw}:/opt/sw:ro",
        "-v", f"{model}:/models/m:ro", "--entrypoint", "/opt/sw/vllm", *flags, IMAGE,
        "serve", "/models/m", "--gpu-memory-utilization", f"{fitting_util():.2f}", "--enforce-eager", *engine,
    ]  # fmt: skip


def state(dockerd: Dockerd, name: str) -> dict[str, object] | None:
    done = dockerd.docker("inspect", "--type", "container", name, check=False)
    if done.returncode != 0:
        return None
    found: dict[str, object] = json.loads(done.stdout)[0]["State"]
    return found


def test_a_mounted_model_that_does_not_fit_is_refused_and_no_container_starts(
    box: Box, dockerd: Dockerd, tmp_path: Path
) -> None:
    """The plan reads the checkpoint on the host through `-v`: 2x the machine in sparse shards, refused (75)."""
    model = tmp_path / "huge"
    model.mkdir()
    shards = 40
    for i in range(shards):
        with open(model / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as fh:
            fh.truncate(2 * total_bytes() // shards)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 80, "num_attention_heads": 64,
                                                    "num_key_value_heads": 8, "hidden_size": 8192}))  # fmt: skip
    name = f"sw-ld-refused-{os.getpid()}"
    argv = run_argv(name, engine_dir(tmp_path), model, "-d", "--rm")
    proc = box.launch("--", *argv, env=docker_env(box, dockerd))
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err.decode()
    text = err.decode()
    assert "plan for vllm /models/m" in text and "does NOT fit" in text, text
    assert "does not fit" in text.strip().splitlines()[-1], text
    assert state(dockerd, name) is None  # never created
    assert box.declarations() == []
    plan = subprocess.run(
        [*box.launch_argv("--plan", "--json"), "--", *argv], env=docker_env(box, dockerd), capture_output=True,
        timeout=120, check=False,
    )  # fmt: skip
    doc = json.loads(plan.stdout)
    assert plan.returncode == 1 and doc["fits"] is False
    assert doc["model"] == "/models/m" and doc["model_source"] == str(model) and doc["weight_files"] == shards


def test_a_budget_kill_by_the_guard_stops_the_container_for_good(box: Box, dockerd: Dockerd, tmp_path: Path) -> None:
    """A real guard holds the container's processes to the launch's budget (the engine grows past it once ready):
    launch says the guard's word and exits 137, and the container stays stopped though its policy would restart it."""
    name = f"sw-ld-budget-{os.getpid()}"
    model = small_model(tmp_path)
    engine = ("--phase-s", "0.1", "--grow-mib-per-s", "400", "--grow-limit-mib", "1200")
    argv = run_argv(name, engine_dir(tmp_path), model, "--restart", "unless-stopped", engine=engine)
    try:
        with sparkwatch_run(tmp_path, "--floor", "1GiB", env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as daemon:
            proc = box.launch("--budget", "256MiB", "--", *argv, env=docker_env(box, dockerd))
            try:
                _out, err = proc.communicate(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
            exited = wait_for_event(daemon.events_path, "engine_exited")
            kill = wait_for_event(daemon.events_path, "kill")
        text = err.decode()
        assert proc.returncode == 137, text
        (decl,) = box.declarations()
        root = decl["root_pid"]
        assert f"sparkwatch: the guard killed vllm (pid {root}), trigger budget: " in text, text
        assert len(decl["container"]) == 64 and decl["launch_id"].startswith(f"{os.geteuid()}-")
        assert kill["trigger"] == "budget" and int(str(kill["footprint_bytes"])) > 256 << 20
        victims = kill["victims"]
        assert isinstance(victims, list) and root in {v["pid"] for v in victims}  # the container's top and below
        assert exited["killed_by"] == "sparkwatch" and exited["root_pid"] == root
        inspected = dockerd.inspect(name)
        assert inspected["Id"] == decl["container"]
        labels = inspected["Config"]["Labels"]  # type: ignore[index]
        assert labels["io.sparkwatch.launch"] == decl["launch_id"] and labels["io.sparkwatch.test"] == "1"
        assert "restart policy unless-stopped: held back while launch watches" in text, text
        time.sleep(3)  # the restart policy's backoff is 100 ms, doubling: it would have come by now
        after = dockerd.inspect(name)
        assert after["RestartCount"] == 0, after["State"]  # never restarted, not even once before launch stopped it
        assert after["State"]["Running"] is False and after["State"]["Restarting"] is False, after["State"]  # type: ignore[index]
    finally:
        dockerd.remove(name)


def test_ctrl_c_stops_the_container_not_just_the_client(box: Box, dockerd: Dockerd, tmp_path: Path) -> None:
    """The engine ignores SIGINT (the client would proxy it and nothing would stop): launch stops the container by
    its id, `--rm` removes it, and the exit code is the engine's (SIGTERM through docker-init)."""
    name = f"sw-ld-int-{os.getpid()}"
    argv = run_argv(name, engine_dir(tmp_path, ignore_int=True), small_model(tmp_path), "--rm",
                    engine=("--phase-s", "0.1", "--ignore-int"))  # fmt: skip
    proc = box.launch("--", *argv, env=docker_env(box, dockerd), start_new_session=True)
    try:
        decl = wait_ready(box, 90)
        assert state(dockerd, name) is not None
        os.kill(proc.pid, signal.SIGINT)  # what the terminal sends launch
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        dockerd.remove(name)
    text = err.decode()
    assert f"SIGINT: docker stop {decl['container'][:12]}" in text, text
    assert proc.returncode == 128 + signal.SIGTERM, text
    deadline = time.monotonic() + 10
    while state(dockerd, name) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state(dockerd, name) is None  # stopped, and removed (--rm)
    (decl,) = box.declarations()
    assert decl["exit_signal"] == signal.SIGTERM and decl["phase"] == "exited"


def test_compose_up_is_planned_labelled_and_adopted(box: Box, dockerd: Dockerd, tmp_path: Path) -> None:
    """docker-compose 1.x: the service's command, image, volumes and labels come from `config`; launch adds its label
    in a file of its own, finds the container by it, and a real guard takes the container as the declared engine."""
    sw, model = engine_dir(tmp_path), small_model(tmp_path)
    project = f"swld{os.getpid()}"
    compose = tmp_path / "docker-compose.yml"
    util, engine = f"{fitting_util():.2f}", ["--phase-s", "0.1", "--serve-s", "4"]
    service = {
        "image": IMAGE,
        "entrypoint": ["/opt/sw/vllm"],
        "command": ["serve", "/models/m", "--gpu-memory-utilization", util, "--enforce-eager", *engine],
        "volumes": [f"{REPO}:/src:ro", f"{sw}:/opt/sw:ro", f"{model}:/models/m:ro"],
        "environment": {"PYTHONDONTWRITEBYTECODE": "1"},
        "labels": {"io.sparkwatch.test": "1", "owner": "the-test"},
        "network_mode": "none",
    }
    compose.write_text(json.dumps({"version": "3.9", "services": {"engine": service}}))
    env = docker_env(box, dockerd)
    try:
        with sparkwatch_run(tmp_path, "--floor", "1GiB", env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as daemon:
            proc = box.launch("--", "docker-compose", "-f", str(compose), "-p", project, "up", "engine", env=env)
            try:
                _out, err = proc.communicate(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
            exited = wait_for_event(daemon.events_path, "engine_exited")
            pid = daemon.proc.pid
        text = err.decode()
        assert proc.returncode == 0, text
        assert "plan for vllm /models/m" in text, text
        assert f"sparkwatch: guard pid {pid} (armed) took it" in text, text
        (decl,) = box.declarations()
        ids = subprocess.run(["docker-compose", "-f", str(compose), "-p", project, "ps", "-q", "engine"], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout.split()  # fmt: skip
        assert ids and decl["container"].startswith(ids[0][:12])
        labels = dockerd.inspect(decl["container"])["Config"]["Labels"]  # type: ignore[index]
        assert labels["owner"] == "the-test" and labels["io.sparkwatch.launch"] == decl["launch_id"]
        assert exited["root_pid"] == decl["root_pid"] and exited["exit_code"] == 0 and exited["killed_by"] is None, (
            exited
        )
        assert decl["kind"] == "vllm" and decl["model"] == "/models/m" and decl["ready_s"] is not None
    finally:
        subprocess.run(["docker-compose", "-f", str(compose), "-p", project, "down", "-t", "1"], env=env,
                       capture_output=True, timeout=120, check=False)  # fmt: skip


def test_detached_launch_returns_at_ready_with_the_id_and_the_container_runs_on_declared(
    box: Box, dockerd: Dockerd, tmp_path: Path
) -> None:
    """`-d`: launch stays through the boot (the container's output on stderr), prints the id on stdout as `docker run
    -d` does once the engine is ready, and leaves the container running under its declaration."""
    name = f"sw-ld-detach-{os.getpid()}"
    argv = run_argv(name, engine_dir(tmp_path), small_model(tmp_path), "-d", "--restart", "unless-stopped",
                    engine=("--phase-s", "0.1"))  # fmt: skip
    try:
        proc = box.launch("--", *argv, env=docker_env(box, dockerd))
        out, err = proc.communicate(timeout=120)
        text = err.decode()
        assert proc.returncode == 0, text
        (decl,) = box.declarations()
        assert out.decode() == f"{decl['container']}\n"
        assert "Loading safetensors checkpoint shards" in text and "vllm runs on after" in text, text
        assert decl["phase"] == "ready" and decl["exited_at"] is None
        running = dockerd.inspect(name)
        assert running["State"]["Running"] is True and running["State"]["Pid"] == decl["root_pid"]  # type: ignore[index]
        assert running["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"  # type: ignore[index]
    finally:
        dockerd.remove(name)
