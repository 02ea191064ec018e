"""A non-root engineer reads the record of a root daemon: `events_group` shares events.jsonl with a group, and
`sparkwatch events` finds the system unit's record when the user has none of their own.

Real processes as real users: the daemon runs as root (this test's own uid; it skips otherwise) and kills a real
process; the reader is the real `sparkwatch events` run as a second uid (nobody, group nogroup): its code is loaded
as root and the process then drops to that uid, so the test passes wherever the checkout lives.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import make_event
from sparkwatch.core.eventkinds import EventKind
from tests.conftest import Spawner, floor_that_fires_at_once, wait_until
from tests.daemon import sparkwatch_run

REPO = Path(__file__).resolve().parent.parent
SECOND_USER = "nobody"
SECOND_GROUP = "nogroup"


def second_uid() -> tuple[int, int]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the daemon must write as one uid and be read as another")
    try:
        return pwd.getpwnam(SECOND_USER).pw_uid, grp.getgrnam(SECOND_GROUP).gr_gid
    except KeyError:
        pytest.skip(f"no {SECOND_USER}/{SECOND_GROUP} account on this machine")


# The reader's code is loaded while still root, then the process drops to the second uid before the run that counts:
# wherever the checkout and its venv live (root's home, a 0700 `mktemp -d`), the second uid never has to read them,
# and every file the command then opens is opened as that uid. The warm-up run (same arguments, output discarded)
# imports whatever the command imports lazily.
_AS_SECOND_USER = """
import contextlib, io, os, sys
from sparkwatch.entry import main
uid, gid, args = int(sys.argv[1]), int(sys.argv[2]), ["events", *sys.argv[3:]]
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main(args)
    except SystemExit:
        pass
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
assert (os.getuid(), os.geteuid(), os.getgid(), os.getgroups()) == (uid, uid, gid, [])
sys.exit(main(args))
"""


def events_as(uid: int, gid: int, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `sparkwatch events`, run as `uid` (no supplementary groups) after its code was loaded as root."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    env["XDG_CONFIG_HOME"] = env["XDG_STATE_HOME"] = "/nonexistent"
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-c", _AS_SECOND_USER, str(uid), str(gid), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd="/",
    )


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A directory the second uid may enter (pytest's tmp_path lives under a 0700 directory of root's)."""
    base = Path(tempfile.mkdtemp(prefix="sparkwatch-sharing-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def kill_one_engine(spawner: Spawner, tmp_path: Path, state: Path, extra: dict[str, str]) -> None:
    engine = spawner.popen(
        [sys.executable, "-c", "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); "
         "time.sleep(120)"]
    )  # fmt: skip
    assert wait_until(lambda: Path(f"/proc/{engine.pid}/cmdline").read_bytes().startswith(b"VLLM::"), 10)
    env = {
        "SPARKWATCH_FLOOR": f"{floor_that_fires_at_once()}B",
        "SPARKWATCH_REARM_HEADROOM": "1MiB",
        "SPARKWATCH_MLOCK": "false",
        "SPARKWATCH_STATE_DIR": str(state),
        **extra,
    }
    with sparkwatch_run(tmp_path, env=env) as d:
        assert wait_until(lambda: engine.poll() is not None, 30), "\n".join(d.stderr_lines)
        events = state / "events.jsonl"
        assert wait_until(lambda: events.exists() and '"kind":"kill"' in events.read_text(), 15)


@pytest.mark.slow
def test_a_group_member_reads_the_root_daemons_events_and_nobody_else_does(
    spawner: Spawner, tmp_path: Path, open_base: Path
) -> None:
    uid, gid = second_uid()
    shared = open_base / "shared"
    kill_one_engine(spawner, tmp_path / "a", shared, {"SPARKWATCH_EVENTS_GROUP": SECOND_GROUP})
    for path, mode in ((shared, 0o750), (shared / "events.jsonl", 0o640)):
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, 0, gid), path
    res = events_as(uid, gid, "--state-dir", str(shared))
    assert res.returncode == 0, res.stderr
    assert "kill" in res.stdout and "vllm" in res.stdout, res.stdout
    assert "sparkwatch: error" not in res.stderr

    private = open_base / "private"
    kill_one_engine(spawner, tmp_path / "b", private, {})
    for path, mode in ((private, 0o700), (private / "events.jsonl", 0o600)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    denied = events_as(uid, gid, "--state-dir", str(private))
    assert denied.returncode == 2, (denied.stdout, denied.stderr)
    assert denied.stderr.count("\n") == 1 and "permission denied" in denied.stderr and "events_group" in denied.stderr


def test_an_unset_events_group_takes_the_sharing_back(tmp_path: Path) -> None:
    """The daemon decides the modes at each start: shared with the key, private again without it."""
    from sparkwatch.common.eventlog import EventLog

    second_uid()
    state = tmp_path / "state"
    gid = grp.getgrnam(SECOND_GROUP).gr_gid
    EventLog(state / "events.jsonl", group=gid).append(make_event(EventKind.KILL, "one"))
    assert stat.S_IMODE((state / "events.jsonl").stat().st_mode) == 0o640
    EventLog(state / "events.jsonl").append(make_event(EventKind.KILL, "two"))
    assert stat.S_IMODE((state / "events.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


def write_events(path: Path, *summaries: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        for summary in summaries:
            fh.write(json.dumps(make_event(EventKind.KILL, summary, node="n").to_json_dict()) + "\n")


def cli_events(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "own-state")
    env["XDG_CONFIG_HOME"] = str(tmp_path / "own-config")
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", "events", "--root", str(tmp_path / "root"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_events_finds_the_system_units_record_and_says_whose_it_shows(tmp_path: Path) -> None:
    system = tmp_path / "root" / "var" / "lib" / "sparkwatch" / "events.jsonl"
    write_events(system, "killed by the system unit")
    res = cli_events(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "killed by the system unit" in res.stdout
    assert "the system unit's" in res.stderr and str(system) in res.stderr

    write_events(tmp_path / "own-state" / "sparkwatch" / "events.jsonl", "killed by my user unit")
    res = cli_events(tmp_path)
    assert "killed by my user unit" in res.stdout and "killed by the system unit" not in res.stdout
    assert "sparkwatch events --system" in res.stderr

    res = cli_events(tmp_path, "--system")
    assert "killed by the system unit" in res.stdout and "killed by my user unit" not in res.stdout

    # A state_dir in the system unit's own config file moves its record; events follows it.
    moved = tmp_path / "root" / "srv" / "sw" / "events.jsonl"
    write_events(moved, "killed after a move")
    conf = tmp_path / "root" / "etc" / "sparkwatch" / "config.toml"
    conf.parent.mkdir(parents=True)
    conf.write_text('state_dir = "/srv/sw"\n', encoding="utf-8")
    assert "killed after a move" in cli_events(tmp_path, "--system").stdout


def test_system_shows_the_system_units_record_whatever_this_users_state_dir(tmp_path: Path) -> None:
    """`--system` names whose record: a state_dir in the user's environment or config file does not turn it back into
    the user's own (it did: the configured state_dir won, silently)."""
    write_events(tmp_path / "root" / "var" / "lib" / "sparkwatch" / "events.jsonl", "killed by the system unit")
    mine = tmp_path / "mine"
    write_events(mine / "events.jsonl", "killed by my user unit")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env |= {"XDG_CONFIG_HOME": str(tmp_path / "own-config"), "SPARKWATCH_STATE_DIR": str(mine)}
    res = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "events", "--root", str(tmp_path / "root"), "--system"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "killed by the system unit" in res.stdout and "killed by my user unit" not in res.stdout
    assert "the system unit's events" in res.stderr
