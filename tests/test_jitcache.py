"""The JIT cache watcher on real directory trees: totals, progress, incremental cost, and faults mid-walk."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.telemetry.sources import jitcache
from sparkwatch.telemetry.sources.jitcache import CacheTree, JitCacheSource
from tests.helpers.proctree import pin_mtimes, write_module


def only(states: tuple[object, ...]) -> object:
    assert len(states) == 1, states
    return states[0]


def test_totals_and_progress_follow_a_build(tmp_path: Path) -> None:
    base = tmp_path / "flashinfer"
    arch = base / "0.4.1" / "121a"
    mod = write_module(arch, "batch_decode", ["a", "b", "c", "d"], built=[])
    src = JitCacheSource([base], [])
    s = src.collect()[0]
    assert (s.cache, s.version, s.arch) == ("flashinfer", "0.4.1", "121a")
    assert (s.objects_done, s.objects_total, s.modules_total, s.modules_built) == (0, 4, 1, 0)
    files0, bytes0 = s.files, s.bytes
    (mod / "a.cuda.o").write_bytes(b"x" * 1000)
    (mod / "b.cuda.o").write_bytes(b"")  # being written: empty objects are not done
    s = src.collect()[0]
    assert (s.objects_done, s.files, s.bytes) == (1, files0 + 2, bytes0 + 1000)
    with open(mod / "b.cuda.o", "ab") as fh:  # appended in place: the directory mtime does not change
        fh.write(b"y" * 500)
    s = src.collect()[0]
    assert (s.objects_done, s.bytes) == (2, bytes0 + 1500)  # a hot directory is rescanned whole
    for name in ("c", "d"):
        (mod / f"{name}.cuda.o").write_bytes(b"z")
    (mod / "batch_decode.so").write_bytes(b"so")
    s = src.collect()[0]
    assert (s.objects_done, s.objects_total, s.modules_built) == (4, 4, 1)
    assert s.last_change_ts >= time.time() - 60


def test_every_version_and_arch_and_the_vllm_cache(tmp_path: Path) -> None:
    base = tmp_path / "flashinfer"
    write_module(base / "0.2.8" / "90a", "norm", ["norm"], built=["norm"], linked=True)
    write_module(base / "0.4.1" / "121a", "norm", ["norm"], built=[])
    vllm = tmp_path / "vllm" / "torch_compile_cache"
    (vllm / "abc" / "rank_0_0").mkdir(parents=True)
    (vllm / "abc" / "rank_0_0" / "graph.py").write_text("x" * 77)
    states = JitCacheSource([base, tmp_path / "missing"], [vllm, tmp_path / "nope"]).collect()
    keys = {(s.cache, s.version, s.arch): s for s in states}
    assert set(keys) == {("flashinfer", "0.2.8", "90a"), ("flashinfer", "0.4.1", "121a"), ("vllm", "", "")}
    assert keys["vllm", "", ""].bytes == 77
    assert keys["flashinfer", "0.2.8", "90a"].objects_done == 1


def test_cold_trees_cost_a_bounded_number_of_stats(tmp_path: Path) -> None:
    base = tmp_path / "flashinfer"
    arch = base / "0.4.1" / "121a"
    for i in range(600):
        d = arch / "cached_ops" / f"m{i}"
        d.mkdir(parents=True)
        (d / "x.o").write_bytes(b"1")
    pin_mtimes(base, time.time() - 3600)
    src = JitCacheSource([base], [])
    first = only(src.collect())
    assert first.files == 600  # type: ignore[attr-defined]
    src.collect()
    assert src.stats_last_cycle <= jitcache.COLD_STATS_PER_CYCLE + 1
    # A change in a cold directory is seen within one sweep of the ring.
    (arch / "cached_ops" / "m599" / "y.o").write_bytes(b"22")
    sweeps = 0
    while only(src.collect()).files == 600:  # type: ignore[attr-defined]
        sweeps += 1
        assert sweeps <= 600 // jitcache.COLD_STATS_PER_CYCLE + 2
    assert only(src.collect()).bytes == 602  # type: ignore[attr-defined]


def test_a_directory_vanishing_mid_walk(tmp_path: Path) -> None:
    root = tmp_path / "121a"
    for name in ("keep", "gone"):
        (root / "cached_ops" / name).mkdir(parents=True)
        (root / "cached_ops" / name / "x.o").write_bytes(b"12345")

    class Racy(CacheTree):
        """Deletes `gone` after it was listed by its parent and before it is scanned: flashinfer's tmp dirs do."""

        def _scan_dir(self, path: str, st: os.stat_result) -> jitcache._Dir:
            if path.endswith("/gone"):
                shutil.rmtree(path)
            return super()._scan_dir(path, st)

    tree = Racy("flashinfer", "0.4.1", "121a", str(root))
    tree.refresh()
    s = tree.state()
    assert (s.files, s.bytes, s.error) == (1, 5, None)
    shutil.rmtree(root / "cached_ops")  # the whole subtree between two cycles
    tree.refresh()
    assert (tree.state().files, tree.state().error) == (0, None)
    shutil.rmtree(root)  # and the root itself
    tree.refresh()
    assert tree.state().files == 0


def test_cache_deleted_between_cycles_drops_its_series(tmp_path: Path) -> None:
    base = tmp_path / "flashinfer"
    write_module(base / "0.4.1" / "121a", "norm", ["norm"], built=["norm"])
    src = JitCacheSource([base], [])
    assert len(src.collect()) == 1
    shutil.rmtree(base)
    assert src.collect() == ()


def test_churn_while_walking(tmp_path: Path) -> None:
    """Directories created and deleted as fast as possible while the watcher walks: it never raises."""
    base = tmp_path / "flashinfer"
    arch = base / "0.4.1" / "121a" / "cached_ops"
    arch.mkdir(parents=True)
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            d = arch / f"tmp{i % 20}"
            try:
                d.mkdir(exist_ok=True)
                (d / "obj.o").write_bytes(b"x")
                (d / "sub").mkdir(exist_ok=True)
                shutil.rmtree(d)
            except FileNotFoundError:
                pass
            i += 1

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        src = JitCacheSource([base], [])
        deadline = time.monotonic() + 1.0
        cycles = 0
        while time.monotonic() < deadline:
            states = src.collect()
            assert all(s.error is None for s in states), states
            cycles += 1
    finally:
        stop.set()
        worker.join()
    assert cycles > 10
    assert only(src.collect()).files == 0  # type: ignore[attr-defined]


def collect_as(uid: int, base: Path) -> list[dict[str, object]]:
    """Run the walker in a forked child that dropped to `uid` (the interpreter itself is not executable by nobody)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            states = JitCacheSource([base], []).collect()
            data = json.dumps([{"files": x.files, "bytes": x.bytes, "error": x.error} for x in states])
            os.write(w, data.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        raw = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result: list[dict[str, object]] = json.loads(raw)
    return result


@pytest.fixture
def world_tmp() -> Iterator[Path]:
    """A temp dir another user can traverse (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="sw-jit-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the walker as another user")
def test_unreadable_directory_is_reported_not_fatal(world_tmp: Path) -> None:
    """Root reads everything, so the walker runs as nobody over a tree with one directory it may not open."""
    base = world_tmp / "flashinfer"
    arch = base / "0.4.1" / "121a"
    write_module(arch, "ok", ["a"], built=["a"])
    secret = write_module(arch, "secret", ["b"], built=["b"])
    for d in [world_tmp, *[p for p in world_tmp.rglob("*") if p.is_dir()]]:
        d.chmod(0o755)
    for f in world_tmp.rglob("*"):
        if f.is_file():
            f.chmod(0o644)
    secret.chmod(0o700)
    (state,) = collect_as(65534, base)
    assert isinstance(state["error"], str) and "secret" in state["error"]
    assert isinstance(state["files"], int) and state["files"] >= 2  # the readable module is still counted
