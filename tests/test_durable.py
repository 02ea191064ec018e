"""The one durable-write helper's directory rule: state dirs become 0700, shared (sticky) directories are refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sparkwatch.common import guardfile
from sparkwatch.common.durable import StateFileError, append_durable, private_dir, read_regular
from sparkwatch.common.eventlog import EventLog, EventLogError, make_event
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.report.guardstate import GuardState


def test_a_state_dir_is_made_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    private_dir(state)
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    private_dir(tmp_path / "new" / "deeper")
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper").st_mode) == 0o700


def test_a_shared_sticky_directory_is_refused_and_never_tightened(tmp_path: Path) -> None:
    """/tmp-like: a root daemon whose outbox sits directly under it must not lock every other user out of it, nor
    trust what they put there: refused, left as it is."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(StateFileError, match=r"is writable by others \(mode 1777\)"):
        private_dir(shared)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_files_another_user_owns_are_never_appended_to_or_trusted(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('{"kind":"kill","summary":"forged"}\n')
    os.chown(events, 65534, 65534)
    with pytest.raises(StateFileError, match="is owned by uid 65534, not by this daemon's user"):
        append_durable(events, b"{}\n")
    with pytest.raises(StateFileError, match="is owned by uid 65534"):
        read_regular(events, 4096, owned=True)
    assert read_regular(events, 4096) == b'{"kind":"kill","summary":"forged"}\n'  # a reader that only shows it may
    os.chown(events, 0, 0)
    events.chmod(0o660)
    with pytest.raises(StateFileError, match=r"is writable by its group \(mode 0660\)"):
        append_durable(events, b"{}\n")
    events.chmod(0o640)  # group-readable is fine: only writes by others are refused
    append_durable(events, b"{}\n")


def _planted_by_nobody(tmp_path: Path) -> tuple[Path, Path]:
    """A directory nobody owns (a user's runtime dir, as /run/user/UID is theirs) in which nobody planted `run`, a
    link to a directory of root's (standing for /etc)."""
    home = tmp_path / "x-nobody"
    home.mkdir()
    os.chown(home, 65534, 65534)
    target = tmp_path / "etc"
    target.mkdir()
    link = home / "run"
    link.symlink_to(target)
    os.lchown(link, 65534, 65534)  # as `ln -s` run by nobody leaves it
    return link, target


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_state_dir_is_never_made_through_a_link_another_user_planted(tmp_path: Path) -> None:
    """A root daemon's state dir under a user's dir: a link that user planted above it is refused, naming it, and
    nothing is made where it points (`mkdir -p` made <target>/sparkwatch, root's and 0700, and the check of the last
    component passed it)."""
    link, target = _planted_by_nobody(tmp_path)
    with pytest.raises(StateFileError, match=rf"{link.parent} is owned by uid 65534") as caught:
        private_dir(link / "sparkwatch" / "outbox")
    assert caught.value.filename == str(link.parent)  # the component nobody controls, where the link is
    assert list(target.iterdir()) == []
    # In a directory all may write but only root owns, sticky as /tmp is: the link itself is named and refused.
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    planted = sticky / "run"
    planted.symlink_to(target)
    os.lchown(planted, 65534, 65534)
    with pytest.raises(StateFileError, match=rf"{planted} is a symlink and is owned by uid 65534") as caught:
        private_dir(planted / "sparkwatch")
    assert caught.value.filename == str(planted)
    assert list(target.iterdir()) == []
    # The event log and guard.json, the real writers, are refused the same way and make nothing either.
    with pytest.raises(EventLogError):
        EventLog(link / "sparkwatch" / "events.jsonl").append(make_event(EventKind.NO_VICTIM, "up"))
    with pytest.raises(StateFileError, match=str(link)):
        guardfile.write(link / "sparkwatch", guardfile_state())
    assert list(target.iterdir()) == []


def guardfile_state() -> GuardState:
    return GuardState(
        pid=os.getpid(),
        start_ticks=1,
        uid=0,
        dry_run=False,
        floor_bytes=1,
        budget_rules=0,
        declared_budgets=0,
        taken=(),
        written_at=0.0,
        kills=(),
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_root_state_dir_under_another_user_s_directory_is_refused_there(tmp_path: Path) -> None:
    """No link at all: a directory another user owns lets them swap what is below it later; root makes nothing in
    it. A directory only root may write, and a link root made, are walked."""
    home = tmp_path / "x-nobody"
    home.mkdir()
    os.chown(home, 65534, 65534)
    with pytest.raises(StateFileError, match=rf"{home} is owned by uid 65534"):
        private_dir(home / "sparkwatch")
    assert list(home.iterdir()) == []
    writable = tmp_path / "shared"
    writable.mkdir()
    writable.chmod(0o777)  # not sticky: anyone may rename what is in it
    with pytest.raises(StateFileError, match=rf"{writable} is writable by every user"):
        private_dir(writable / "sparkwatch")
    # The legitimate path: several components missing, made one by one, and a link root owns on the way.
    (tmp_path / "data").mkdir()
    (tmp_path / "state").symlink_to(tmp_path / "data")
    private_dir(tmp_path / "state" / "a" / "b" / "sparkwatch")
    made = tmp_path / "data" / "a" / "b" / "sparkwatch"
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "data" / "a").st_mode) == 0o755 & ~_umask()
    # The state dir itself as a link stays refused, as before.
    (tmp_path / "alias").symlink_to(made)
    with pytest.raises(StateFileError, match="is a symlink; the state dir must be a real directory"):
        private_dir(tmp_path / "alias")


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
