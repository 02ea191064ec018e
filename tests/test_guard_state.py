"""The guard's published state (common.guardfile): a reader takes a file as a running guard only when a live guard
of root's or the reader's own wrote it. Real files, real processes standing in for the guard, and a real other user
(`nobody`, uid 65534, through setpriv) for what another user can plant."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.common import guardfile
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.core.report.guardstate import SUMMARY_MAX, GuardState, KillWord, describe, describe_all

NOBODY = 65534


@pytest.fixture
def stand_in() -> Iterator[subprocess.Popen[bytes]]:
    """A live process to name as the guard (a file is only as alive as the process it names)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(10)


def state_of(pid: int, uid: int | None = None, ticks: int | None = None, **changes: object) -> GuardState:
    start = read_start_ticks("/proc", pid) if ticks is None else ticks
    assert start is not None
    fields: dict[str, object] = {
        "pid": pid,
        "start_ticks": start,
        "uid": os.geteuid() if uid is None else uid,
        "dry_run": False,
        "floor_bytes": 8 << 30,
        "budget_rules": 1,
        "declared_budgets": 1,
        "taken": ((4242, 777),),
        "written_at": time.time(),
    }
    fields.update(changes)
    return GuardState(**fields)  # type: ignore[arg-type]


def test_a_live_guards_file_is_read_and_a_dead_ones_is_stale(tmp_path: Path, stand_in: subprocess.Popen[bytes]) -> None:
    path = guardfile.write(tmp_path / "run" / "sparkwatch", state_of(stand_in.pid))
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    seen = guardfile.read_guards([path])
    assert seen.running and seen.states[0].pid == stand_in.pid and seen.taken_by((4242, 777)) is not None
    assert describe(seen.states[0]).endswith("armed, floor 8.0 GiB, 2 budgets, 1 launched engine")
    # The same pid with another start time: the pid was reused, the guard that wrote it is gone.
    guardfile.write(path.parent, state_of(stand_in.pid, ticks=1))
    seen = guardfile.read_guards([path])
    assert not seen.running and seen.notes == (f"{path} is stale: its guard (pid {stand_in.pid}) is gone",)
    guardfile.write(path.parent, state_of(stand_in.pid))
    stand_in.kill()
    stand_in.wait(10)
    seen = guardfile.read_guards([path])
    assert not seen.running and "is stale" in seen.notes[0]
    assert describe_all(seen.states) == "no guard is running"


def test_remove_takes_only_the_guards_own_file(tmp_path: Path, stand_in: subprocess.Popen[bytes]) -> None:
    path = guardfile.write(tmp_path, state_of(stand_in.pid))
    guardfile.remove(path, stand_in.pid + 1)  # another guard published here since: its file stays
    assert path.exists()
    guardfile.remove(path, stand_in.pid)
    assert not path.exists()


def test_what_is_not_a_plain_small_private_file_is_refused(tmp_path: Path, stand_in: subprocess.Popen[bytes]) -> None:
    good = guardfile.write(tmp_path / "real", state_of(stand_in.pid))
    link = tmp_path / "link.json"
    link.symlink_to(good)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    writable = tmp_path / "writable.json"
    writable.write_bytes(good.read_bytes())
    writable.chmod(0o666)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (guardfile.MAX_BYTES + 1))
    other_version = tmp_path / "v2.json"
    other_version.write_text(json.dumps({**json.loads(good.read_text()), "version": 2}))
    for path in (link, fifo, writable, big, other_version):
        seen = guardfile.read_guards([path])
        assert not seen.running and len(seen.notes) == 1 and str(path) in seen.notes[0], (path, seen)
    assert "writable by others" in guardfile.read_guards([writable]).notes[0]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as another user"
)
def test_another_user_can_neither_plant_a_guard_nor_claim_to_be_root(stand_in: subprocess.Popen[bytes]) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="sw-guardstate-", dir="/tmp"))
    try:
        scratch.chmod(0o755)
        planted = scratch / "guard.json"
        # nobody's file naming root's live guard: root's reader takes only root's own files.
        planted.write_bytes(guardfile.encode(state_of(stand_in.pid, uid=0)))
        os.chown(planted, NOBODY, NOBODY)
        seen = guardfile.read_guards([planted])
        assert not seen.running and "owned by uid 65534, neither root nor you" in seen.notes[0]
        # nobody's reader of nobody's own file that claims uid 0: refused too (a file speaks for its owner only). The
        # reader's code is loaded as root, then the process is nobody's before it reads: the checkout may sit where
        # nobody may not enter (a clone under a 0700 mktemp -d).
        probe = (
            "import os, sys; from pathlib import Path; from sparkwatch.common import guardfile as guardstate; "
            f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); "
            "s = guardstate.read_guards([Path(sys.argv[1])]); print(os.getuid(), s.running, s.notes)"
        )
        cmd = [sys.executable, "-c", probe]
        done = subprocess.run([*cmd, str(planted)], capture_output=True, text=True, timeout=60, check=True)
        assert done.stdout.startswith(f"{NOBODY} ")
        done.stdout = done.stdout.split(" ", 1)[1]
        assert done.stdout.startswith("False") and "declares uid 0 in a file owned by uid 65534" in done.stdout
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_the_guard_publishes_where_readers_look() -> None:
    state_dir = Path("/var/lib/sparkwatch")
    user = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    assert guardfile.guard_dir(user, state_dir, uid=1000) == Path("/run/user/1000/sparkwatch")
    assert guardfile.guard_dir({}, state_dir, uid=0) == Path("/run/sparkwatch")  # the system unit
    for env in (user, {}):
        # Every reader looks in its own runtime dir, the system guard's and the state dir (the writer's fallback).
        paths = guardfile.reader_paths(env, state_dir)
        assert guardfile.SYSTEM_DIR / "guard.json" in paths and state_dir / "guard.json" in paths
        assert guardfile.guard_dir(env, state_dir) / "guard.json" in paths


def test_a_real_guard_publishes_its_state_again_after_a_reload_and_removes_it_on_stop(tmp_path: Path) -> None:
    from tests.conftest import wait_until
    from tests.daemon import sparkwatch_run

    config = tmp_path / "config.toml"
    config.write_text('floor = "1GiB"\ndry_run = true\nengine_budgets = ["2GiB=sw-guard-state"]\n')
    with sparkwatch_run(tmp_path, "--config", str(config)) as daemon:
        published = tmp_path / "run" / "sparkwatch" / "guard.json"  # the daemon's runtime dir (tests/daemon.py)
        env = {"XDG_RUNTIME_DIR": str(tmp_path / "run")}
        # Found where every reader looks (another guard on this machine, the system unit's, may be found there too).
        seen = guardfile.read_guards(guardfile.reader_paths(env, daemon.state_dir)).states
        (state,) = [s for s in seen if s.pid == daemon.proc.pid]
        assert (state.pid, state.uid, state.dry_run) == (daemon.proc.pid, os.geteuid(), True)
        assert (state.floor_bytes, state.budget_rules, state.taken) == (1 << 30, 1, ())
        config.write_text('floor = "2GiB"\ndry_run = false\n')
        daemon.proc.send_signal(signal.SIGHUP)

        def reloaded() -> bool:
            seen = guardfile.read_guards([published]).states
            return bool(seen) and (seen[0].floor_bytes, seen[0].dry_run, seen[0].budgets) == (2 << 30, False, 0)

        assert wait_until(reloaded, 30), published.read_text()
    assert not published.exists()


def test_the_guards_word_on_a_launched_engine_it_killed_is_read_by_its_declaration(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    """launch's one route to a kill (core.report.guardstate.KillWord): keyed by (root pid, start ticks), never by pid
    alone; the fullest state (64 engines taken, KILLS_PUBLISHED words of SUMMARY_MAX characters) stays within
    MAX_BYTES."""
    taken = tuple((4_194_304 + i, 10**12 + i) for i in range(64))
    words = tuple(KillWord(pid, ticks, "driver_alloc_failed", "x" * SUMMARY_MAX, False) for pid, ticks in taken[:8])
    path = guardfile.write(tmp_path, state_of(stand_in.pid, taken=taken, kills=words))
    assert path.stat().st_size <= guardfile.MAX_BYTES
    seen = guardfile.read_guards([path])
    assert seen.killed(taken[3]) == words[3]
    assert seen.killed((taken[3][0], taken[3][1] + 1)) is None  # the same pid, another process: not this kill
    assert seen.killed(taken[20]) is None  # taken, not killed
