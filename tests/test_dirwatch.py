"""The guard's declarations thread sleeps until a declarations directory changes (common.dirwatch, inotify through
common.syscalls): with nothing declared it makes no poll of its own, a declaration is read as soon as it is written,
a directory that appears later (a runtime dir at login, `sparkwatch/launched` on launch's first use) is followed, and
without inotify it polls as before."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sparkwatch.common import launched
from sparkwatch.common.dirwatch import DirWatch
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.core.launch.bootphase import BootPhase
from sparkwatch.guard import launchwatch
from sparkwatch.guard.launchwatch import LaunchedEngines
from tests.conftest import wait_until


def own_declaration() -> launched.Declaration:
    """This test process, declared by its own user: the kernel vouches for it."""
    ticks = read_start_ticks("/proc", os.getpid())
    assert ticks is not None
    now = time.time()
    decl = launched.Declaration(root_pid=os.getpid(), start_ticks=ticks, uid=os.geteuid(), kind="vllm", model="m",
                                key="k", budget_bytes=None, launched_at=now, launcher_pid=os.getpid())  # fmt: skip
    return replace(decl.entered(BootPhase.STARTING, now), launch_id="")


def test_a_directory_that_appears_later_is_followed(tmp_path: Path) -> None:
    target = tmp_path / "run" / "sparkwatch" / "launched"
    stop_r, stop_w = os.pipe()
    watch = DirWatch()
    try:
        assert watch.arm([target])  # only tmp_path exists: watched for what appears in it
        assert not watch.wait(0.2, stop_r)
        (tmp_path / "run").mkdir()
        assert watch.wait(5, stop_r)
        assert watch.arm([target])
        target.mkdir(parents=True)  # run/sparkwatch made: its parent's event, then the rest
        assert watch.wait(5, stop_r)
        assert watch.arm([target])
        assert watch.wait(0.05, stop_r) in (True, False)  # the rest of the mkdir, if it came late
        watch.arm([target])
        (target / "a.json").write_text("{}")
        assert watch.wait(5, stop_r)
        shutil.rmtree(target)
        assert watch.wait(5, stop_r)
        target.mkdir()  # a new inode at the same path: watched again
        watch.arm([target])
        (target / "b.json").write_text("{}")
        assert watch.wait(5, stop_r)
        assert not watch.wait(0.2, stop_r)  # nothing more happened
        os.write(stop_w, b"x")
        assert not watch.wait(5, stop_r)  # the stop pipe ends a wait at once, and is no change
    finally:
        watch.close()
        os.close(stop_r)
        os.close(stop_w)


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "launched").symlink_to(elsewhere)
    stop_r, stop_w = os.pipe()
    watch = DirWatch()
    try:
        watch.arm([tmp_path / "launched"])  # its nearest real directory is tmp_path: the link's target is not watched
        (elsewhere / "a.json").write_text("{}")
        assert not watch.wait(0.3, stop_r)
    finally:
        watch.close()
        os.close(stop_r)
        os.close(stop_w)


def test_the_declarations_thread_sleeps_until_a_declaration_comes(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "sparkwatch" / "launched"
    engines = LaunchedEngines([directory], "/proc", lambda *_a: None)
    engines.start()
    try:
        time.sleep(1.5)
        assert engines.polls_total == 1  # the first look only: nothing declared, nothing changed, no wake-up
        launched.write(directory, own_declaration())
        assert wait_until(lambda: (os.getpid(), own_declaration().start_ticks) in engines.declared(), 5)
        # While a declared root lives, its liveness is looked at about once a second.
        polls = engines.polls_total
        time.sleep(2.5)
        assert 1 <= engines.polls_total - polls <= 6
    finally:
        engines.stop()
    assert engines._thread is not None and not engines._thread.is_alive()


def test_without_inotify_the_thread_polls_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused() -> DirWatch:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(launchwatch, "DirWatch", refused)
    directory = tmp_path / "launched"
    engines = LaunchedEngines([directory], "/proc", lambda *_a: None)
    engines.start()
    try:
        assert wait_until(lambda: engines.polls_total >= 4, 5)  # every POLL_EVERY_S
        launched.write(directory, own_declaration())
        assert wait_until(lambda: (os.getpid(), own_declaration().start_ticks) in engines.declared(), 5)
    finally:
        engines.stop()
