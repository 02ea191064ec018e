"""Which container a process runs in, from its cgroup path alone: pure, no I/O, a few µs a tree (bench/).

The guard names the container of every tree it may kill without asking any daemon: the id is in the path
/proc/PID/cgroup gives (`Proc.cgroup`, the v2 line, which a hybrid host has too), in each runtime's shape:

| runtime    | cgroup driver    | path component(s)                                                      |
| ---------- | ---------------- | ---------------------------------------------------------------------- |
| docker     | systemd (DGX OS) | `system.slice/docker-<id>.scope`                                       |
| docker     | cgroupfs         | `/docker/<id>` (v1, or v2 with `--exec-opt native.cgroupdriver=cgroupfs`) |
| containerd | systemd (CRI)    | `kubepods-….slice/cri-containerd-<id>.scope`                           |
| cri-o      | systemd          | `crio-<id>.scope` (never `crio-conmon-<id>.scope`: the monitor)        |
| podman     | systemd / cgroupfs | `libpod-<id>.scope` / `libpod_parent/libpod-<id>` (never `libpod-conmon-`) |
| kubernetes | cgroupfs         | `/kubepods/<qos>/pod<uid>/<id>`                                        |

A container started inside another one (docker in docker) has both ids in its path: the outer one is the container the
host's runtime knows, so the first match wins. Ids are 64 hex digits; anything else is not a container.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The token `sparkwatch launch` puts in the environment of a container it starts (cli.launch.docker), as in its label
# (core.container.LABEL_LAUNCH): the guard reads it in /proc to believe a declaration of that container
# (common.launched.in_container).
LAUNCH_ENV = "SPARKWATCH_LAUNCH"
_ID = r"([0-9a-f]{64})"
ID_RE = re.compile(r"[0-9a-f]{64}")
# A whole path component, each runtime's systemd-driver unit or its cgroupfs directory.
_SCOPE = re.compile(rf"^(docker|libpod|cri-containerd|crio)-{_ID}(?:\.scope)?$")
_BARE = re.compile(rf"^{_ID}$")
_RUNTIME_OF_SCOPE = {"docker": "docker", "libpod": "podman", "cri-containerd": "containerd", "crio": "cri-o"}


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """A container as its runtime names it: the runtime and the full id."""

    runtime: str  # docker, podman, containerd, cri-o, kubernetes
    id: str  # 64 hex digits

    @property
    def short_id(self) -> str:
        """The 12 digits `docker ps` shows."""
        return self.id[:12]


def container_of(cgroup: str | None) -> ContainerRef | None:
    """The container whose cgroup is `cgroup` (or below it), or None for a process outside any container."""
    if not cgroup or len(cgroup) < 64:
        return None
    parent = ""
    kube = False
    for part in cgroup.split("/"):
        if not part:
            continue
        if part.startswith("kubepods"):
            kube = True
        m = _SCOPE.match(part)
        if m is not None:
            return ContainerRef(_RUNTIME_OF_SCOPE[m.group(1)], m.group(2))
        if len(part) == 64 and _BARE.match(part) is not None:
            if parent == "docker":
                return ContainerRef("docker", part)
            if kube:
                return ContainerRef("kubernetes", part)
        parent = part
    return None
