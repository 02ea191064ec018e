"""The one durable-write helper's directory rule: state dirs become 0700, shared (sticky) directories are refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sparkwatch.common.durable import StateFileError, append_durable, private_dir, read_regular


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
