"""Every engine tree knows its container (core.containerid): the id from the cgroup path in each runtime's shape, and
the same id a real dockerd reports for an engine that is the container's PID 1."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sparkwatch.common.sources.enginetrees import EngineFinder
from sparkwatch.core.containerid import ContainerRef, container_of
from tests.dockerd import Dockerd, fake_engine_argv, run_args
from tests.helpers.configs import guard_config_with

ID = "4f" * 32
ID2 = "0a1b" * 16


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        (f"/system.slice/docker-{ID}.scope", ContainerRef("docker", ID)),  # systemd driver, cgroup v2 (DGX OS)
        (f"/docker/{ID}", ContainerRef("docker", ID)),  # cgroupfs
        (f"/docker/{ID}/inner", ContainerRef("docker", ID)),
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-{ID}.scope",
            ContainerRef("containerd", ID),
        ),
        (f"/machine.slice/libpod-{ID}.scope", ContainerRef("podman", ID)),
        (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope", ContainerRef("podman", ID)),
        (f"/libpod_parent/libpod-{ID}", ContainerRef("podman", ID)),
        (f"/kubepods/burstable/pod0c5e-11/{ID}", ContainerRef("kubernetes", ID)),
        (f"/system.slice/crio-{ID}.scope", ContainerRef("cri-o", ID)),
        (f"/system.slice/docker-{ID}.scope/docker/{ID2}", ContainerRef("docker", ID)),  # docker in docker: the outer
        (f"/machine.slice/libpod-conmon-{ID}.scope", None),  # podman's monitor, not the container
        (f"/system.slice/crio-conmon-{ID}.scope", None),
        ("/user.slice/user-1000.slice/session-3.scope", None),
        (f"/system.slice/sparkwatch-launch-{ID[:8]}.scope", None),
        (f"/opt/{ID}", None),  # 64 hex digits outside any runtime's directory
        (f"/docker/{ID[:63]}", None),
        ("/", None),
        (None, None),
    ],
)
def test_container_of_each_runtime_shape(cgroup: str | None, expected: ContainerRef | None) -> None:
    assert container_of(cgroup) == expected


def test_short_id_is_what_docker_ps_shows() -> None:
    assert ContainerRef("docker", ID).short_id == ID[:12]


@pytest.mark.docker
def test_an_engine_as_a_containers_pid_1_carries_its_container_id(dockerd: Dockerd, tmp_path: Path) -> None:
    name = "sw-ident-pid1"
    dockerd.remove(name)
    cid = dockerd.docker(*run_args(dockerd, name, "--network", "none"), *fake_engine_argv()).stdout.strip()
    try:
        pid = dockerd.container_pid(name)
        finder = EngineFinder.from_settings(guard_config_with(), Path("/proc"), any_user=True)
        deadline = time.monotonic() + 20
        trees = []
        while time.monotonic() < deadline:
            trees = [t for t in finder.find() if t.root.pid == pid]
            if trees and trees[0].root.argv[:1] == ("VLLM::EngineCore",):
                break
            time.sleep(0.2)
        assert trees, f"no engine tree rooted at the container's PID 1 ({pid})"
        tree = trees[0]
        assert tree.container == ContainerRef("docker", cid), tree.root.cgroup
        assert tree.container is not None and tree.container.short_id == cid[:12]
    finally:
        dockerd.remove(name)
