"""The engines `sparkwatch launch` started, declared in small JSON files: who they are and which boot phase they are in.

One file per launched engine, `<root pid>-<start ticks>.json`, in a per-user directory:
`$XDG_RUNTIME_DIR/sparkwatch/launched/` (/run/user/UID/… where the user manager made it), else
`<state_dir>/launched/`. `sparkwatch launch` writes it (common.durable.write_atomic: a reader sees the old file or
the new one, never half of one) when the engine starts, on every boot phase, and once more when it exits
(phase `exited`, with its exit code or signal); it removes exited declarations older than EXITED_KEEP_S.

Readers (the guard, telemetry, the flight recorder) hold a LaunchedWatch and call `poll()` on their own tick: it
stats each directory and reads its files again only when the directory's mtime changed (an atomic rename changes
it), so an idle poll is one stat per directory. Nothing here is trusted blindly:
- a file is at most DECLARATION_MAX_BYTES, a directory yields at most MAX_DECLARATIONS, and a file that is not
  a regular file, is a symlink, or fails strict decoding (common.wiretypes.from_json) is skipped and counted;
- a declaration is kept only when the file's owner is the uid it declares (so a user cannot declare for another);
- whoever acts on one checks that the process at `root_pid` has that start time and is owned by that uid
  (`matches`): a declaration never names another user's, or root's, process into a tree.

How to read it (the guard, telemetry and the flight recorder do exactly this):

    watch = LaunchedWatch(launched_dirs(os.environ, state_dir))
    for decl in watch.poll():          # cheap: re-reads only what changed
        decl.root_pid, decl.start_ticks, decl.kind, decl.model, decl.phase, decl.budget_bytes, decl.phases
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparkwatch.common.durable import StateFileError, private_dir, read_regular, write_atomic
from sparkwatch.common.wiretypes import WireError, from_json, to_json
from sparkwatch.core.bootphase import BOOTING, BootPhase

VERSION = 1
DECLARATION_MAX_BYTES = 16 << 10  # a declaration is ~600 bytes; a long phase timeline stays well under this
MAX_DECLARATIONS = 64  # per directory: a box runs a handful of engines
EXITED_KEEP_S = 60.0  # an exited declaration stays this long so every reader sees the exit
PHASES_KEPT = 32
RECENT_NS = 50_000_000  # phase changes kept in the timeline (an engine flipping between JIT and profiling)


@dataclass(frozen=True, slots=True)
class Declaration:
    """One launched engine, as `sparkwatch launch` declares it. Times are wall-clock seconds."""

    root_pid: int
    start_ticks: int
    uid: int
    kind: str
    model: str  # the model as the command names it ("" when unknown)
    key: str  # the learned-peaks key (core.peaks.peak_key)
    budget_bytes: int | None
    launched_at: float
    launcher_pid: int
    phase: BootPhase = BootPhase.STARTING
    phase_since: float = 0.0
    phases: tuple[tuple[BootPhase, float], ...] = ()  # (phase, entered at), oldest first
    available_at_launch_bytes: int = 0  # MemAvailable just before the command started (the pool-drop baseline)
    estimate_bytes: int | None = None  # the plan's estimate
    peak_bytes: int | None = None  # the largest footprint launch measured so far
    ready_s: float | None = None  # launch to ready
    exit_code: int | None = None
    exit_signal: int | None = None
    exited_at: float | None = None
    cgroup: str | None = None  # the scope's cgroup path when launch ran it in a systemd scope
    version: int = VERSION

    @property
    def tree_key(self) -> tuple[int, int]:
        return (self.root_pid, self.start_ticks)

    @property
    def booting(self) -> bool:
        return self.phase in BOOTING

    @property
    def file_name(self) -> str:
        return f"{self.root_pid}-{self.start_ticks}.json"

    def entered(self, phase: BootPhase, at: float) -> Declaration:
        """This declaration in `phase` from `at` on (the timeline keeps the last PHASES_KEPT changes)."""
        timeline = (*self.phases, (phase, at))[-PHASES_KEPT:]
        ready = self.ready_s
        if phase == BootPhase.READY and ready is None:
            ready = max(at - self.launched_at, 0.0)
        return replace(self, phase=phase, phase_since=at, phases=timeline, ready_s=ready)


def matches(decl: Declaration, pid: int, start_ticks: int, uid: int) -> bool:
    """Whether the process (pid, start_ticks, uid) is the one `decl` declares (never another user's)."""
    return decl.root_pid == pid and decl.start_ticks == start_ticks and decl.uid == uid


def runtime_dir(env: Mapping[str, str], uid: int) -> Path | None:
    """$XDG_RUNTIME_DIR, else /run/user/UID where it exists."""
    base = env.get("XDG_RUNTIME_DIR")
    if base and os.path.isabs(base):
        return Path(base)
    default = Path(f"/run/user/{uid}")
    return default if default.is_dir() else None


def launched_dir(env: Mapping[str, str], state_dir: Path, uid: int | None = None) -> Path:
    """Where this user's launches declare their engines."""
    uid = os.geteuid() if uid is None else uid
    base = runtime_dir(env, uid)
    return (base / "sparkwatch" / "launched") if base is not None else (state_dir / "launched")


def launched_dirs(env: Mapping[str, str], state_dir: Path, *, all_users: bool | None = None) -> list[Path]:
    """Every directory a reader scans: this user's (runtime dir and state dir), and as root every user's runtime
    dir under /run/user/*/ (a system unit guards every user's engines)."""
    uid = os.geteuid()
    dirs = [launched_dir(env, state_dir, uid), state_dir / "launched"]
    if all_users if all_users is not None else uid == 0:
        try:
            users = sorted(os.listdir("/run/user"))
        except OSError:
            users = []
        dirs += [Path("/run/user") / u / "sparkwatch" / "launched" for u in users if u.isdigit()]
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def encode(decl: Declaration) -> bytes:
    return json.dumps(to_json(decl), separators=(",", ":")).encode()


def decode(data: bytes, owner_uid: int) -> Declaration:
    """A declaration from its file. Raises WireError (or ValueError) for anything but one of ours, from its owner."""
    if len(data) > DECLARATION_MAX_BYTES:
        raise WireError(f"declaration: {len(data)} bytes, over {DECLARATION_MAX_BYTES}")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise WireError("declaration: not JSON") from None
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        raise WireError("declaration: not of this version")
    decl: Declaration = from_json(Declaration, raw, "declaration")
    if decl.uid != owner_uid:
        raise WireError(f"declaration: declares uid {decl.uid} in a file owned by uid {owner_uid}")
    if len(decl.phases) > PHASES_KEPT:
        raise WireError("declaration: phase timeline too long")
    return decl


def write(directory: Path, decl: Declaration) -> Path:
    """Declare (or update) one engine, atomically."""
    private_dir(directory.parent)
    private_dir(directory)
    path = directory / decl.file_name
    write_atomic(path, encode(decl), mode=0o644)
    return path


def remove(directory: Path, decl: Declaration) -> None:
    try:
        (directory / decl.file_name).unlink()
    except FileNotFoundError:
        pass


def read_one(path: Path) -> Declaration:
    """One declaration file (bounded, never through a symlink). Raises OSError or WireError."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise StateFileError(0, "is not a regular file", str(path))
    return decode(read_regular(path, DECLARATION_MAX_BYTES + 1), st.st_uid)


def prune(directory: Path, now: float, alive: Iterable[int] = ()) -> int:
    """Remove this user's exited declarations older than EXITED_KEEP_S, and those whose launcher is gone while the
    engine is too (a launcher killed with SIGKILL leaves its file behind). Returns how many went."""
    gone = 0
    keep_launchers = set(alive)
    for decl in scan(directory).declarations:
        stale = decl.exited_at is not None and now - decl.exited_at > EXITED_KEEP_S
        orphan = decl.exited_at is None and not _alive(decl.launcher_pid) and decl.launcher_pid not in keep_launchers
        if (stale or orphan) and decl.uid == os.geteuid():
            if orphan and _alive(decl.root_pid):
                continue
            remove(directory, decl)
            gone += 1
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class ScanResult:
    declarations: tuple[Declaration, ...] = ()
    errors: int = 0


def scan(directory: Path) -> ScanResult:
    """Every valid declaration in one directory (at most MAX_DECLARATIONS); bad files are counted, never fatal."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    except OSError:
        return ScanResult()
    out: list[Declaration] = []
    errors = 0
    for name in names[:MAX_DECLARATIONS]:
        try:
            out.append(read_one(directory / name))
        except (OSError, WireError, ValueError):
            errors += 1
    errors += max(len(names) - MAX_DECLARATIONS, 0)
    return ScanResult(tuple(out), errors)


@dataclass
class LaunchedWatch:
    """The declarations in `dirs`, re-read only when a directory's mtime changes. Not thread-safe: one per thread."""

    dirs: Sequence[Path]
    _seen: dict[Path, tuple[int, ScanResult]] = field(default_factory=dict)
    errors_total: int = 0
    reads_total: int = 0

    def poll(self) -> tuple[Declaration, ...]:
        out: list[Declaration] = []
        keys: set[tuple[int, int]] = set()
        for directory in self.dirs:
            try:
                mtime = os.stat(directory).st_mtime_ns
            except OSError:
                self._seen.pop(directory, None)
                continue
            seen = self._seen.get(directory)
            # A directory's mtime has the kernel's coarse clock (a few ms): two renames within one tick leave the same
            # mtime, so a directory changed within the last RECENT_NS is read again on the next poll as well.
            recent = time.time_ns() - mtime < RECENT_NS
            if seen is None or seen[0] != mtime or recent:
                result = scan(directory)
                self.reads_total += 1
                self.errors_total += result.errors
                self._seen[directory] = (mtime, result)
            else:
                result = seen[1]
            for decl in result.declarations:
                if decl.tree_key not in keys:
                    keys.add(decl.tree_key)
                    out.append(decl)
        return tuple(out)
