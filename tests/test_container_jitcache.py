"""A container's own JIT cache (telemetry/sources/jitcache.py foreign_root, telemetry/loop.py): an engine in a
container builds flashinfer modules under /root/.cache/flashinfer in its own file system, which no host path names;
the "compiling, not hung" view reads it through the engine's /proc/PID/root, and a cache that is a bind mount of a
host cache already watched is watched once.

Real containers under the session's own dockerd (tests/dockerd.py), running tests/helpers/jit_container_engine.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkwatch.config.settings import load_settings
from sparkwatch.core.enums import JitState
from sparkwatch.core.model import JitCacheState, Snapshot
from sparkwatch.telemetry.loop import Telemetry
from sparkwatch.tui.status_view import _cache_name
from tests.dockerd import Dockerd, run_args


@dataclass
class Builder:
    pid: int
    cid: str
    control: Path

    def step(self, name: str) -> None:
        (self.control / name).write_text("")
        deadline = time.monotonic() + 20
        while not (self.control / f"{name}.done").exists():
            assert time.monotonic() < deadline, f"step {name} not done"
            time.sleep(0.05)


@contextmanager
def jit_container(dockerd: Dockerd, tmp_path: Path, name: str, *flags: str) -> Iterator[Builder]:
    control = tmp_path / f"{name}-control"
    control.mkdir(mode=0o777)
    argv = ["python3", "/src/tests/helpers/jit_container_engine.py", "/w"]
    dockerd.remove(name)
    cid = dockerd.docker(*run_args(dockerd, name, "--network", "none", "-v", f"{control}:/w", *flags), *argv)
    try:
        deadline = time.monotonic() + 20
        while not (control / "started").exists():
            assert time.monotonic() < deadline, dockerd.docker("logs", name, check=False).stderr
            time.sleep(0.05)
        yield Builder(dockerd.container_pid(name), cid.stdout.strip(), control)
    finally:
        dockerd.remove(name)


def telemetry(tmp_path: Path, host_cache: Path) -> Telemetry:
    settings = load_settings(
        None,
        {
            "state_dir": tmp_path / "state",
            "probe_interval_s": 0,
            "jit_cache_dirs": [host_cache],
            "vllm_cache_dirs": [tmp_path / "no-vllm"],
        },
    )
    return Telemetry(settings)


def until(t: Telemetry, done: Callable[[Snapshot], bool], timeout_s: float = 20.0) -> Snapshot:
    deadline = time.monotonic() + timeout_s
    snap = t.collect()
    while not done(snap):
        assert time.monotonic() < deadline, f"not done: {snap.jit} {snap.jit_states}"
        time.sleep(0.1)
        snap = t.collect()
    return snap


def caches_of(snap: Snapshot, pid: int) -> list[JitCacheState]:
    """The caches read through this engine's own root."""
    return [j for j in snap.jit if j.path.startswith(f"/proc/{pid}/root/")]


@pytest.mark.docker
def test_a_containers_own_flashinfer_build_is_seen_through_its_root(dockerd: Dockerd, tmp_path: Path) -> None:
    """Objects done, the module linked, the engine compiling while its cache grows; before, no cache at all."""
    host_built = tmp_path / "host-cache" / "0.2.7" / "121a"  # a host cache already watched, quiet
    host_built.mkdir(parents=True)
    (host_built / "old.so").write_bytes(b"\0" * 64)
    t = telemetry(tmp_path, tmp_path / "host-cache")
    try:
        assert [j.version for j in t.collect().jit] == ["0.2.7"]
        with jit_container(dockerd, tmp_path, "sw-jit-own") as box:
            snap = until(t, lambda s: bool(caches_of(s, box.pid)) and any(e.root_pid == box.pid for e in s.jit_states))
            (cache,) = caches_of(snap, box.pid)
            assert cache.path == f"/proc/{box.pid}/root/root/.cache/flashinfer/0.2.8/121a" and cache.root_pid == box.pid
            assert (cache.cache, cache.version, cache.arch, cache.where) == (
                "flashinfer",
                "0.2.8",
                "121a",
                f"container {box.cid[:12]}",
            )
            assert (cache.objects_done, cache.objects_total, cache.modules_built, cache.modules_total) == (0, 2, 0, 1)
            assert _cache_name(cache) == f"flashinfer 0.2.8 121a (container {box.cid[:12]})"
            (state,) = [e for e in snap.jit_states if e.root_pid == box.pid]
            assert state.state == JitState.IDLE, state  # a cache first seen with its engine is not growth
            box.step("small")
            snap = until(t, lambda s: caches_of(s, box.pid)[0].objects_done == 1)
            (state,) = [e for e in snap.jit_states if e.root_pid == box.pid]
            assert state.state == JitState.COMPILING and state.reason == "JIT cache growing", state
            box.step("heavy")
            box.step("link")
            snap = until(t, lambda s: caches_of(s, box.pid)[0].modules_built == 1)
            (cache,) = caches_of(snap, box.pid)
            assert (cache.objects_done, cache.objects_total, cache.modules_total) == (2, 2, 1)
        snap = until(t, lambda s: not caches_of(s, box.pid))  # gone with its engine: no stale series
    finally:
        t.close()


@pytest.mark.docker
def test_a_bind_mounted_host_cache_is_watched_once(dockerd: Dockerd, tmp_path: Path) -> None:
    """`-v ~/.cache/flashinfer:/root/.cache/flashinfer` of a cache the host already watches: one cache, the host's,
    and its progress is seen there."""
    host_cache = tmp_path / "host-cache"
    host_cache.mkdir(mode=0o777)
    t = telemetry(tmp_path, host_cache)
    try:
        with jit_container(dockerd, tmp_path, "sw-jit-bind", "-v", f"{host_cache}:/root/.cache/flashinfer") as box:
            box.step("small")
            snap = until(t, lambda s: any(j.objects_done == 1 for j in s.jit) and bool(s.jit_states))
            (cache,) = snap.jit
            assert cache.path == str(host_cache / "0.2.8" / "121a") and (cache.root_pid, cache.where) == (0, "")
            assert box.pid in {e.root_pid for e in snap.jit_states}
    finally:
        t.close()
