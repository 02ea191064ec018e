"""The one durable-write helper's directory rule: state dirs become 0700, shared (sticky) directories never change."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sparkwatch.common.durable import private_dir


def test_a_state_dir_is_made_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    private_dir(state)
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    private_dir(tmp_path / "new" / "deeper")
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper").st_mode) == 0o700


def test_a_shared_sticky_directory_is_never_tightened(tmp_path: Path) -> None:
    """/tmp-like: a root daemon whose outbox sits directly under it must not lock every other user out of it."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    private_dir(shared)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
