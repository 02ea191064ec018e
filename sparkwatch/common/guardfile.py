"""The guard's published state file, `guard.json`: where the guard process writes it, and when a reader trusts it.

The guard process writes one small file (core.report.guardstate.GuardState) with common.durable.write_atomic when it
starts, after a reload, and when the set of launched engines it took changes; nothing per tick. It removes the file when
it stops cleanly. Where:
- a guard run as root without XDG_RUNTIME_DIR (the system unit, whose `RuntimeDirectory=sparkwatch` makes the
  directory under ProtectSystem=strict): /run/sparkwatch/guard.json, the directory 0755, the file 0644, so every
  user's `sparkwatch status` and `launch` can read it;
- a user guard: $XDG_RUNTIME_DIR/sparkwatch/guard.json (beside the launched/ declarations, common.launched);
- either, when that directory cannot be written: <state_dir>/guard.json.

It also carries the guard's word on the launched engines it killed (core.report.guardstate.KillWord, keyed by the
declaration): the guard asks for a republish when it kills one it took, and `launch` reads its own there once its
engine died of a SIGKILL it did not send (the one route by which launch learns of a guard kill).

`status`, `doctor` and `launch` read every place a guard of theirs may write (`reader_paths`) with `read_guards`,
which trusts a file only when it is a regular file (never through a symlink), at most MAX_BYTES, owned by root or by
the reader's own uid and writable by nobody else, declares the uid that owns it, and names a live process: its pid
has the start time the file gives, owned by that uid. A dead guard's file (a SIGKILL, a crash, a power loss on a
persistent state dir) is therefore stale, never "running".
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkwatch.common.durable import (
    StateFileError,
    open_dir,
    open_regular,
    private_dir,
    read_regular,
    refuse_foreign,
    write_atomic,
)
from sparkwatch.common.launched import runtime_dir
from sparkwatch.common.sources.procs import read_fd, read_start_ticks
from sparkwatch.common.wiretypes import WireError, from_json, to_json
from sparkwatch.core.report.guardstate import VERSION, GuardState, KillWord

FILE_NAME = "guard.json"
SYSTEM_DIR = Path("/run/sparkwatch")
# A state is ~200 bytes plus ~25 per launched engine taken (common.launched keeps at most 64 per directory) and ~510
# per kill word (core.report.guardstate.KILLS_PUBLISHED of them, each summary cut at SUMMARY_MAX): 5,813 bytes at most.
MAX_BYTES = 8 << 10


def guard_dir(env: Mapping[str, str], state_dir: Path, uid: int | None = None) -> Path:
    """Where a guard of this uid, in this environment, publishes its state."""
    uid = os.geteuid() if uid is None else uid
    if uid == 0 and not env.get("XDG_RUNTIME_DIR"):
        return SYSTEM_DIR
    base = runtime_dir(env, uid)
    return base / "sparkwatch" if base is not None else state_dir


def reader_paths(env: Mapping[str, str], state_dir: Path) -> list[Path]:
    """Every file a guard this user should know of may have written: its own runtime dir's, the system guard's, and
    the state dir's (the fallback)."""
    out: list[Path] = []
    for d in (guard_dir(env, state_dir), SYSTEM_DIR, state_dir):
        if d / FILE_NAME not in out:
            out.append(d / FILE_NAME)
    return out


def encode(state: GuardState) -> bytes:
    return json.dumps(to_json(state), separators=(",", ":")).encode()


def decode(data: bytes, owner_uid: int) -> GuardState:
    """A state from its file's bytes. Raises WireError for anything but one of ours, from its owner."""
    if len(data) > MAX_BYTES:
        raise WireError(f"guard state: over {MAX_BYTES} bytes")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise WireError("guard state: not JSON") from None
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        raise WireError("guard state: not of this version")
    state: GuardState = from_json(GuardState, raw, "guard state")
    if state.uid != owner_uid:
        raise WireError(f"guard state: declares uid {state.uid} in a file owned by uid {owner_uid}")
    return state


def _make_dir(directory: Path) -> None:
    """The system dir is 0755 (users read the state); any other is private, like the state dir (0700)."""
    if directory != SYSTEM_DIR:
        private_dir(directory)
        return
    os.close(open_dir(directory, 0o755))  # a real directory, made without following a link, or StateFileError
    refuse_foreign(directory)


def write(directory: Path, state: GuardState) -> Path:
    """Publish `state` atomically (a reader sees the old file or the new one). Raises OSError."""
    _make_dir(directory)
    path = directory / FILE_NAME
    write_atomic(path, encode(state), mode=0o644)
    return path


def remove(path: Path, pid: int) -> None:
    """Remove the file if it is this guard's (another guard may have published there since)."""
    try:
        data = read_regular(path, MAX_BYTES + 1)
        if json.loads(data).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


class Untrusted(Exception):
    """Why a guard state file is not taken as a running guard's (one line)."""


def read_one(path: Path, proc_root: Path | str = "/proc") -> GuardState:
    """The state in `path` if a live guard wrote it. Raises FileNotFoundError when absent, Untrusted otherwise.
    One open (never through a symlink, never blocking on a FIFO), and the checks on what that open got."""
    try:
        fd = open_regular(path)
    except StateFileError as exc:
        raise Untrusted(f"{path} {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid not in (0, os.geteuid()):
            raise Untrusted(f"{path} is owned by uid {st.st_uid}, neither root nor you")
        if st.st_mode & 0o022:
            raise Untrusted(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})")
        state = decode(read_fd(fd, MAX_BYTES + 1), st.st_uid)
    except (WireError, ValueError) as exc:
        raise Untrusted(f"{path}: {exc}") from None
    except OSError as exc:
        raise Untrusted(f"{path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    ticks = read_start_ticks(proc_root, state.pid)
    try:
        owner = os.stat(f"{proc_root}/{state.pid}").st_uid
    except OSError:
        owner = None
    if ticks != state.start_ticks or owner != state.uid:
        raise Untrusted(f"{path} is stale: its guard (pid {state.pid}) is gone")
    return state


@dataclass(frozen=True, slots=True)
class GuardsSeen:
    """The live guards found (usually none or one), and why any other file found was not taken."""

    states: tuple[GuardState, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def running(self) -> bool:
        return bool(self.states)

    def taken_by(self, key: tuple[int, int]) -> GuardState | None:
        return next((s for s in self.states if s.took(key)), None)

    def killed(self, key: tuple[int, int]) -> KillWord | None:
        """A running guard's word that it killed the launched engine declared as `key`."""
        return next((w for s in self.states if (w := s.killed(key)) is not None), None)


def read_guards(paths: Sequence[Path], proc_root: Path | str = "/proc") -> GuardsSeen:
    states: list[GuardState] = []
    notes: list[str] = []
    for path in paths:
        try:
            state = read_one(path, proc_root)
        except FileNotFoundError:
            continue
        except Untrusted as exc:
            notes.append(str(exc))
            continue
        except OSError as exc:
            notes.append(f"{path}: {exc.strerror or exc}")
            continue
        if all((s.pid, s.start_ticks) != (state.pid, state.start_ticks) for s in states):
            states.append(state)
    return GuardsSeen(tuple(states), tuple(notes))
