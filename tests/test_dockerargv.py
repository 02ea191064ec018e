"""`docker run …` and `docker compose up …` as `sparkwatch launch` reads them (core.launch.dockerargv), the plan of the
engine inside through its mounts (no daemon needed: the image's entrypoint comes from the known images), and what the
guard believes of a container's declaration (common.launched)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sparkwatch.common import launched
from sparkwatch.common.wiretypes import WireError
from sparkwatch.core.launch import containerspec as cs
from sparkwatch.core.launch import dockerargv as dk
from sparkwatch.core.launch.bootphase import BootPhase
from tests.planbox import model_dir, plan

CID = "ab" * 32
OTHER = "cd" * 32


def run(*words: str) -> dk.DockerRun:
    parsed = dk.parse(["docker", *words])
    assert isinstance(parsed, dk.DockerRun)
    return parsed


def test_options_that_take_a_value_and_booleans_are_read_as_docker_reads_them() -> None:
    r = run("-H", "unix:///x", "run", "--rm", "-dit", "--gpus", "all", "-v", "/h/m:/models/m:ro", "-p8000:8000",
            "-e=HF_HOME=/hf", "--ipc=host", "--name", "eng", "--shm-size", "16g", "--ulimit", "memlock=-1",
            "--init=false", "--restart", "unless-stopped", "img:1", "--model", "/models/m")  # fmt: skip
    assert r.docker == ("docker", "-H", "unix:///x") and r.run == ("run",)
    assert r.image == "img:1" and r.command == ("--model", "/models/m")
    assert r.detach and r.on("rm") is True and r.on("init") is False and r.on("interactive") is True
    assert r.values("volume") == ["/h/m:/models/m:ro"] and r.values("env") == ["HF_HOME=/hf"]
    assert r.last("name") == "eng" and r.last("shm-size") == "16g" and r.restart == "unless-stopped"
    assert r.values("publish") == ["8000:8000"] and r.last("ulimit") == "memlock=-1"
    # options end at the image: what follows is the command, flags and all
    r = run("container", "run", "-dp", "80:80", "--", "img", "-d", "--rm")
    assert r.run == ("container", "run") and r.values("publish") == ["80:80"] and r.command == ("-d", "--rm")


@pytest.mark.parametrize(
    ("words", "error"),
    [
        (("run", "--frob", "img"), "--frob is not an option sparkwatch launch knows: write it --frob=VALUE"),
        (("run", "-Z", "img"), "-Z is not an option"),
        (("run", "--rm"), "no image named"),
        (("run", "--name"), "--name needs a value"),
    ],
)
def test_what_cannot_be_read_is_one_line(words: tuple[str, ...], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        dk.parse(["docker", *words])


def test_an_unknown_option_written_with_its_value_is_kept_and_other_commands_are_not_containers() -> None:
    assert run("run", "--frob=x", "img").last("frob") == "x"
    assert dk.parse(["docker", "ps"]) is None and dk.parse(["vllm", "serve", "m"]) is None
    assert dk.parse(["docker", "compose", "down"]) is None and dk.parse([]) is None


def test_compose_up_v1_and_v2() -> None:
    v1 = dk.parse(["docker-compose", "-H", "unix:///x", "-f", "a.yml", "--project-name", "p", "up", "-d", "svc"])
    assert isinstance(v1, dk.ComposeUp) and v1.tool == ("docker-compose",)
    assert v1.docker == ("docker", "--host=unix:///x") and v1.files == ["a.yml"] and v1.detach
    assert v1.services == ("svc",)
    v2 = dk.parse(["/usr/bin/docker", "--context", "c", "compose", "-f", "a.yml", "up", "--build", "svc", "-t", "3"])
    assert isinstance(v2, dk.ComposeUp) and v2.tool == ("/usr/bin/docker", "--context", "c", "compose")
    assert v2.services == ("svc",) and v2.last("timeout") == "3" and not v2.detach
    argv = dk.launch_compose_argv(v1, ["a.yml"], "/run/o.json", "svc")
    assert argv == ["docker-compose", "--host=unix:///x", "--project-name=p", "--file=a.yml", "--file=/run/o.json",
                    "up", "svc"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "engine"),
    [
        (("vllm", "serve", "--model", "m"), ("vllm", "serve", "--model", "m")),
        (("/opt/nvidia/nvidia_entrypoint.sh", "vllm", "serve", "m"), ("vllm", "serve", "m")),
        (("tini", "-s", "--", "python3", "-m", "sglang.launch_server"), ("python3", "-m", "sglang.launch_server")),
        (("/bin/bash", "-c", "cd /app && exec vllm serve /m --port 9"), ("vllm", "serve", "/m", "--port", "9")),
        (("sh", "-c", "pip install x; vllm serve 'a b'"), ("vllm", "serve", "a b")),
    ],
)
def test_the_engine_is_found_through_the_wrappers_that_run_it(argv: tuple[str, ...], engine: tuple[str, ...]) -> None:
    assert cs.engine_argv(argv) == engine


def test_entrypoint_and_command_compose_as_docker_composes_them() -> None:
    image = (("vllm", "serve"), ("--model", "default"))
    assert cs.entry_and_command(None, (), *image) == ("vllm", "serve", "--model", "default")
    assert cs.entry_and_command(None, ("/m",), *image) == ("vllm", "serve", "/m")  # the command replaces CMD
    assert cs.entry_and_command("/bin/x", (), *image) == ("/bin/x",)  # --entrypoint resets the image's command
    assert cs.entry_and_command("", ("vllm", "serve", "m"), *image) == ("vllm", "serve", "m")
    assert cs.repository("docker.io/vllm/vllm-openai:v0.11.0@sha256:00") == "vllm/vllm-openai"
    assert cs.repository("localhost:5000/team/img:1") == "localhost:5000/team/img"
    assert cs.KNOWN_IMAGES[cs.repository("vllm/vllm-openai:latest")][0] == ("vllm", "serve")


def test_container_paths_are_read_at_their_host_path_through_the_deepest_mount() -> None:
    mounts = cs.bind_mounts(
        ["/data:/models", "/fast/qwen:/models/qwen:ro", "./rel:/rel", "hf:/root/.cache/huggingface", "/anon"],
        ["type=bind,source=/srv/ckpt,target=/ckpt,readonly", '"type=volume","src=vol","dst=/vol"'],
        "/home/me",
    )
    assert cs.host_path(mounts, "/models/llama/config.json") == "/data/llama/config.json"
    assert cs.host_path(mounts, "/models/qwen") == "/fast/qwen"
    assert cs.host_path(mounts, "/models/qwen/x/../y") == "/fast/qwen/y"
    assert cs.host_path(mounts, "/rel/m") == "/home/me/rel/m"
    assert cs.host_path(mounts, "/ckpt/a") == "/srv/ckpt/a"
    for unread in ("/root/.cache/huggingface/hub", "/vol/m", "/anon/m", "/opt/model", "/modelsX"):
        assert cs.host_path(mounts, unread) is None, unread


def test_the_containers_environment_is_the_images_then_env_files_then_e() -> None:
    entries = [*cs.env_file_entries("# comment\n\n  A=file\nB=file\nFROM_HOST\nMISSING\n"), "B=flag"]
    env = cs.container_env(["A=image", "PATH=/usr/bin"], entries, {"FROM_HOST": "h"})
    assert env == {"A": "file", "PATH": "/usr/bin", "B": "flag", "FROM_HOST": "h"}


def test_what_launch_adds_to_docker_run() -> None:
    r = run("run", "-dit", "--restart=always", "-e", "A=1", "--name", "x", "img", "serve", "m")
    argv = dk.launch_run_argv(r, token="1000-ab", cidfile="/run/cid", env=[("MAX_JOBS", "2")])
    assert argv == ["docker", "run", "--label=io.sparkwatch.launch=1000-ab", "--env=SPARKWATCH_LAUNCH=1000-ab",
                    "--cidfile=/run/cid", "--init", "--env=MAX_JOBS=2", "--env=A=1", "--name=x", "img",
                    "serve", "m"]  # fmt: skip
    own = run("run", "--init=false", "--cidfile", "/mine", "img")
    argv = dk.launch_run_argv(own, token="t", cidfile="/run/cid", env=[])
    assert "--init" not in argv and "--init=false" in argv and "--cidfile=/mine" in argv
    assert not any(a.startswith("--cidfile=/run") for a in argv)


def test_a_compose_service_from_its_config_and_launchs_own_file() -> None:
    v1 = {  # docker-compose 1.29's `config`: short volume syntax, a command as written
        "version": "3.4",
        "services": {"engine": {"image": "img", "command": "serve /models/m --port 9", "restart": "always",
                                "volumes": ["/data/m:/models/m:ro", {"type": "bind", "source": "/hf",
                                                                       "target": "/root/.cache/huggingface"}],
                                "environment": {"HF_HOME": "/hf", "EMPTY": None}}},
    }  # fmt: skip
    svc = cs.service_of(v1, None, "/p")
    assert svc.name == "engine" and svc.command == ("serve", "/models/m", "--port", "9") and svc.entrypoint is None
    assert svc.restart == "always" and svc.environment == {"HF_HOME": "/hf", "EMPTY": ""}
    assert cs.host_path(svc.mounts, "/models/m") == "/data/m"
    assert cs.host_path(svc.mounts, "/root/.cache/huggingface/hub") == "/hf/hub"
    doc = cs.compose_override(svc, token="0-ab", env=[("MAX_JOBS", "1")], version="3.4")
    body = {"labels": {"io.sparkwatch.launch": "0-ab"}, "environment": {"SPARKWATCH_LAUNCH": "0-ab", "MAX_JOBS": "1"},
            "restart": "no"}  # fmt: skip
    assert doc == {"version": "3.4", "services": {"engine": body}}
    assert cs.compose_override(svc, token="t", env=[], version=None)["services"]["engine"]["init"] is True  # type: ignore[index]
    assert [cs.init_allowed(v) for v in ("2.1", "2.2", "3.6", "3.7", "3", None, "x")] == [
        False, True, False, True, False, True, False]  # fmt: skip
    with pytest.raises(ValueError, match="name the service"):
        cs.service_of({"services": {"a": {}, "b": {}}}, None, "/p")


# --- the plan of the engine inside, no daemon needed


def test_the_plan_reads_the_mounted_checkpoint_on_the_host(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "ckpt", 3 << 30)
    env = {"DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"}  # no image to inspect: the known image's entrypoint
    args = ["docker", "run", "--gpus", "all", "-v", f"{model}:/models/m:ro", "vllm/vllm-openai:latest", "/models/m",
            "--gpu-memory-utilization", "0.3"]  # fmt: skip
    done = plan(tmp_path, "--json", "--", *args, env=env, available_gib=100)
    doc = json.loads(done.stdout)
    assert doc["kind"] == "vllm" and doc["model"] == "/models/m" and doc["model_source"] == str(model)
    assert next(t for t in doc["terms"] if t["name"] == "weights")["bytes"] == 3 << 30
    # Not under a mount: nothing read on the host, and the plan says why.
    done = plan(tmp_path, "--", "docker", "run", "vllm/vllm-openai", str(model), env=env, available_gib=100)
    assert f"{model}: in the container under no bind mount (-v): its files are not read" in done.stdout, done.stdout


def test_a_hugging_face_id_is_read_in_the_containers_mounted_cache(tmp_path: Path) -> None:
    hub = tmp_path / "hf" / "hub"
    snap = hub / "models--Org--Small" / "snapshots" / ("0" * 40)
    model_dir(snap, 2 << 30)
    (hub / "models--Org--Small" / "refs").mkdir()
    (hub / "models--Org--Small" / "refs" / "main").write_text("0" * 40)
    env = {"DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"}
    args = ["docker", "run", "-e", "HF_HOME=/cache", "-v", f"{tmp_path / 'hf'}:/cache", "vllm/vllm-openai",
            "--model", "Org/Small"]  # fmt: skip
    doc = json.loads(plan(tmp_path, "--json", "--", *args, env=env, available_gib=100).stdout)
    assert doc["model"] == "Org/Small" and doc["model_source"] == str(snap)
    unmounted = ["docker", "run", "vllm/vllm-openai", "--model", "Org/Small"]
    doc = json.loads(plan(tmp_path, "--json", "--", *unmounted, env=env, available_gib=100).stdout)
    assert doc["weight_files"] == 0 and doc["model_source"] == "Org/Small"


def test_a_docker_command_launch_cannot_read_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = plan(tmp_path, "--", "docker", "run", "--frob", "vllm/vllm-openai", "m")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--frob is not an option" in done.stderr


# --- what the guard believes of a container's declaration


def _proc(root: Path, pid: int, ticks: int, cgroup: str, environ: dict[str, str] | None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} (docker-init) S " + " ".join(["1"] * 18) + f" {ticks} 0 0\n")
    (d / "cgroup").write_text(f"0::{cgroup}\n")
    if environ is not None:
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))


def _decl(pid: int, token: str, container: str = CID, uid: int | None = None) -> launched.Declaration:
    return launched.Declaration(
        root_pid=pid, start_ticks=77, uid=os.geteuid() if uid is None else uid, kind="vllm", model="/models/m",
        key="k", budget_bytes=1 << 30, launched_at=1.0, launcher_pid=1, container=container, launch_id=token,
    ).entered(BootPhase.STARTING, 1.0)  # fmt: skip


def test_a_containers_declaration_counts_only_with_its_token_in_that_containers_first_process(tmp_path: Path) -> None:
    me = os.geteuid()
    token = f"{me}-00ff"
    _proc(tmp_path, 10, 77, f"/system.slice/docker-{CID}.scope", {"PATH": "/bin", "SPARKWATCH_LAUNCH": token})
    _proc(tmp_path, 11, 77, f"/docker/{OTHER}", {"SPARKWATCH_LAUNCH": token})  # another container
    _proc(tmp_path, 12, 77, f"/docker/{CID}", {"SPARKWATCH_LAUNCH": f"{me}-other"})  # another launch's token
    _proc(tmp_path, 13, 77, f"/docker/{CID}", None)  # its environment unreadable
    _proc(tmp_path, 14, 77, "/user.slice/session-1.scope", {"SPARKWATCH_LAUNCH": token})  # in no container
    assert launched.vouched(_decl(10, token), tmp_path)
    for pid in (11, 12, 13, 14):
        assert not launched.vouched(_decl(pid, token), tmp_path), pid
    assert not launched.vouched(_decl(10, ""), tmp_path)  # a container's declaration without a token: never


def test_a_container_declaration_may_name_roots_process_only_with_a_token_of_its_owners_making() -> None:
    def file_of(decl: launched.Declaration) -> bytes:
        return launched.encode(decl)

    assert launched.decode(file_of(_decl(10, "1000-ab", uid=0)), 1000).uid == 0  # a docker user's root container
    with pytest.raises(WireError, match="declares uid 0"):
        launched.decode(file_of(_decl(10, "1001-ab", uid=0)), 1000)  # another user's token
    with pytest.raises(WireError, match="declares uid 0"):
        launched.decode(file_of(_decl(10, "1000-ab", container="", uid=0)), 1000)  # no container: its own uid only
    with pytest.raises(WireError, match="64-digit"):
        launched.decode(file_of(_decl(10, "1000-ab", container="abc", uid=0)), 1000)
