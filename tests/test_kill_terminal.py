"""A foreground engine killed in an interactive shell: the shell must say Killed (exit 137), not Stopped (147), and the
owner's terminal gets one line naming sparkwatch.

Real processes throughout: `bash -i` on a pseudo-terminal (util-linux `setsid -c` makes it the controlling terminal),
a fake engine typed at its prompt, and the killer (or the whole daemon) against it. Every signal goes to processes
this test started.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
from sparkwatch.core.kill.killrecord import KillFacts
from sparkwatch.core.kill.terminal import is_terminal_job_leader, tty_device, tty_major_minor
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import EngineTree, MemInfo
from sparkwatch.guard.killer import Killer, KillJob, Reaper
from sparkwatch.guard.ttynote import tell_terminal
from tests.conftest import FAKE_ENGINE, Spawner, floor_that_fires_at_once, pids_in, require_tool, wait_until
from tests.daemon import sparkwatch_run

RULES = EngineRules.build()
PROMPT = "SWPROMPT$ "


class Terminal:
    """`bash -i` on a pseudo-terminal, with everything it writes collected."""

    def __init__(self, spawner: Spawner, tmp_path: Path) -> None:
        require_tool("setsid")
        self.master, slave = os.openpty()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(tmp_path),
            "TERM": "dumb",
            "PS1": PROMPT,
            "HISTFILE": "/dev/null",
        }
        self.shell = spawner.popen(
            ["setsid", "-c", "bash", "--norc", "--noprofile", "-i"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            close_fds=True,
        )
        os.close(slave)
        self._out: list[bytes] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert wait_until(lambda: PROMPT in self.text(), 20), self.text()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self.master], [], [], 0.2)
                if not ready:
                    if self.shell.poll() is not None:
                        return
                    continue
                chunk = os.read(self.master, 65536)
            except OSError:
                return  # EIO: the shell and everything on the terminal are gone
            if not chunk:
                return
            with self._lock:
                self._out.append(chunk)

    def text(self) -> str:
        with self._lock:
            return b"".join(self._out).decode(errors="replace").replace("\r", "")

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def close(self) -> None:
        # The reader ends before the fd is closed: a reader still selecting on a closed fd number would read the next
        # test's pseudo-terminal, which the kernel gives the same number (it stole that shell's prompt, 1 run in 8).
        self._closed.set()
        self._reader.join(5)
        try:
            os.close(self.master)
        except OSError:
            pass


@pytest.fixture
def terminal(spawner: Spawner, tmp_path: Path) -> Iterator[Terminal]:
    term = Terminal(spawner, tmp_path)
    try:
        yield term
    finally:
        term.close()


WORKERS = 8  # a tree of some size: the stop-then-sweep takes long enough for the shell to see the stop (on main)
MEMBERS = 1 + WORKERS + 3  # the root, its workers, and a ninja -> nvcc -> cicc chain


def start_foreground_engine(term: Terminal, pidfile: Path) -> list[EngineTree]:
    """Type a fake engine (EngineCore, workers, a compiler chain) at the prompt and wait until all of it runs."""
    workers = " ".join(f"--worker VLLM::Worker_TP{i}" for i in range(WORKERS))
    term.type(f"{sys.executable} {FAKE_ENGINE} --title VLLM::EngineCore {workers} --compiler --pidfile {pidfile}")
    assert wait_until(lambda: pidfile.exists() and len(pidfile.read_text().splitlines()) >= MEMBERS, 20), term.text()
    scope = Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=term.shell.pid)
    trees: list[EngineTree] = []

    def found() -> bool:
        nonlocal trees
        trees = find_engine_trees(ProcScanner().scan().procs, RULES, scope)
        return len(trees) == 1 and len(trees[0].members) == MEMBERS

    assert wait_until(found, 10)
    return trees


def exit_status_line(term: Terminal) -> str:
    term.type('echo "rc=$?"')
    assert wait_until(lambda: "rc=1" in term.text().split('echo "rc=$?"')[-1], 10), term.text()
    return term.text()


def test_a_killed_foreground_engine_reads_killed_not_stopped(terminal: Terminal, tmp_path: Path) -> None:
    pidfile = tmp_path / "engine.pids"
    trees = start_foreground_engine(terminal, pidfile)
    killer = Killer(Path("/proc"), RULES, Scope(self_pid=os.getpid(), own_uid=os.geteuid()))
    victims, signaled_at, notes, _method = killer.kill(trees)
    assert signaled_at is not None
    facts = KillFacts(Trigger.FLOOR, MEM, 1 << 31, 0.0, False, tuple(trees), tuple((v.proc, v.engine) for v in victims))
    reaper = Reaper(Path("/proc"), announce=lambda job: None, finish=lambda job, facts: None, settle_s=0.0)
    reaped = reaper.reap(KillJob(facts, victims, time.monotonic(), signaled_at, MEM.available_bytes))
    assert reaped.survivors == ()
    out = exit_status_line(terminal)
    assert "Stopped" not in out, out
    assert "Killed" in out and "rc=137" in out, out
    root = next(v for v in victims if v.proc.pid == trees[0].root.pid)
    assert root.job_leader, "the engine typed at the prompt leads its own job on the terminal"
    assert not any(v.job_leader for v in victims if v is not root), "its workers are stopped first, as before"
    assert any("without SIGSTOP" in n for n in notes)
    # The terminal's number as the kernel gave it is the very pty this shell runs on.
    name = tty_device(root.tty_nr)
    assert name is not None and name.startswith("pts/")
    st = os.stat(f"/dev/{name}")
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == tty_major_minor(root.tty_nr)


def test_the_note_reaches_only_the_victims_own_terminal(terminal: Terminal, tmp_path: Path) -> None:
    term_pid = terminal.shell.pid
    with open(f"/proc/{term_pid}/stat", "rb") as fh:
        tty_nr = int(fh.read().rsplit(b")", 1)[1].split()[4])
    name = tty_device(tty_nr)
    assert name is not None
    owner = os.stat(f"/dev/{name}").st_uid
    assert not tell_terminal(tty_nr, owner + 1, "sparkwatch: NOT FOR YOU")  # another user's terminal: never
    assert tell_terminal(tty_nr, owner, "sparkwatch: a line for the owner")
    assert wait_until(lambda: "a line for the owner" in terminal.text(), 5)
    assert "NOT FOR YOU" not in terminal.text()
    assert not tell_terminal(0, owner, "no terminal")


def test_a_cause_a_peer_named_reaches_the_owner_s_terminal_inert(terminal: Terminal) -> None:
    """The note carries a group's cause, and a peer names it ("killed by sparkwatch on spark-b: …"): an escape
    sequence in it (clear screen, retitle the window, CSI as one C1 byte) arrives as `?`, never as a sequence."""
    with open(f"/proc/{terminal.shell.pid}/stat", "rb") as fh:
        tty_nr = int(fh.read().rsplit(b")", 1)[1].split()[4])
    name = tty_device(tty_nr)
    assert name is not None
    word = "killed by sparkwatch on spark-b: \x1b[2J\x1b]0;owned\x07\x9b2J\u202eevil end-of-note"
    assert tell_terminal(tty_nr, os.stat(f"/dev/{name}").st_uid, f"sparkwatch: {word}")
    assert wait_until(lambda: "end-of-note" in terminal.text(), 5)
    note = terminal.text()[terminal.text().index("sparkwatch: killed by") :]
    assert "\x1b" not in note and "\x07" not in note, repr(note)
    assert "spark-b: ?[2J?]0;owned??2J?evil end-of-note" in note


def test_terminal_job_leaders_are_only_leaders_of_their_own_group_on_a_terminal() -> None:
    assert is_terminal_job_leader(pid=10, pgrp=10, tty_nr=34816, parent_in_tree=False)
    assert not is_terminal_job_leader(pid=10, pgrp=10, tty_nr=0, parent_in_tree=False)  # a daemon's child
    assert not is_terminal_job_leader(pid=11, pgrp=10, tty_nr=34816, parent_in_tree=False)  # a test's child
    assert not is_terminal_job_leader(pid=10, pgrp=10, tty_nr=34816, parent_in_tree=True)  # setsid inside the tree
    assert tty_device(34816) == "pts/0"  # major 136, minor 0
    assert tty_device((137 << 8) | 5) == "pts/261"
    assert tty_device((4 << 8) | 2) == "tty2" and tty_device((4 << 8) | 65) == "ttyS1"
    assert tty_device((136 << 8) | 0x12 | (0x3 << 20)) == f"pts/{0x312}"  # minors past 255 live in bits 20-31
    assert tty_device((5 << 8) | 0) is None  # /dev/tty itself: not a terminal we write to


@pytest.mark.slow
def test_the_daemon_kills_a_foreground_engine_and_says_so_on_its_terminal(
    terminal: Terminal, tmp_path: Path, spawner: Spawner
) -> None:
    pidfile = tmp_path / "engine.pids"
    trees = start_foreground_engine(terminal, pidfile)
    env = {
        "SPARKWATCH_FLOOR": f"{floor_that_fires_at_once()}B",
        "SPARKWATCH_REARM_HEADROOM": "1MiB",
        "SPARKWATCH_MLOCK": "false",
        "SPARKWATCH_ANCESTOR_PID": str(terminal.shell.pid),
    }
    with sparkwatch_run(tmp_path, env=env) as d:
        root = trees[0].root.pid
        assert wait_until(lambda: root not in pids_alive(pidfile), 30), "\n".join(d.stderr_lines)
        assert wait_until(lambda: "Details: sparkwatch events" in terminal.text(), 10), terminal.text()
    out = exit_status_line(terminal)
    assert "Stopped" not in out, out
    assert "rc=137" in out, out
    note = next(line for line in out.splitlines() if line.startswith("sparkwatch: killed this vllm engine"))
    assert f"pid {root}, {MEMBERS} processes" in note and "floor" in note, note


def pids_alive(pidfile: Path) -> set[int]:
    out = set()
    for pid in pids_in(pidfile):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    out.add(pid)
        except OSError:
            pass
    return out


MEM = MemInfo(
    total_bytes=1 << 34,
    available_bytes=1 << 30,
    free_bytes=1 << 30,
    buffers_bytes=0,
    cached_bytes=0,
    swap_total_bytes=0,
    swap_free_bytes=0,
)
