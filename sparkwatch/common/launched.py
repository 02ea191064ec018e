"""The engines `sparkwatch launch` started, declared in small JSON files: who they are and which boot phase they are in.

One file per launched engine, `<root pid>-<start ticks>.json`, in a per-user directory:
`$XDG_RUNTIME_DIR/sparkwatch/launched/` (/run/user/UID/… where the user manager made it); root without one
(`sudo sparkwatch launch`: sudo drops XDG_RUNTIME_DIR) `/run/sparkwatch/launched/`, root's own, which the system unit
reads; anyone else `<state_dir>/launched/`. `sparkwatch launch` writes it (common.durable.write_atomic: a reader sees
the old file or the new one, never half of one) when the engine starts, on every boot phase, and once more when it
exits (phase `exited`, with its exit code or signal); it removes exited declarations older than EXITED_KEEP_S.

Readers (the guard on a thread of its own, telemetry, the flight recorder, launch, engines, wait-settled) hold a
LaunchedWatch and call `poll()`: it stats each directory and reads its files again only when the directory's mtime
changed (an atomic rename changes it), so an idle poll is one stat per directory; a root reader lists /run/user again
whenever its mtime changes (a user who logs in later is read). The files are other users' to write, so what a reader
believes comes from the kernel, never from a file (docs/security.md, "What a launch declaration may and may not
change"):
- the declarer is the file's owner: a declaration of another uid than its owner's is skipped (root's may declare any);
- a declaration counts only for a live process with its pid and start time that the kernel says the declared uid
  owns (`vouched`). A container's declaration (`container`: launch started the engine with `docker run` or compose)
  names the container's top process, often root's: it counts only while that process is in that container's cgroup
  and its environment carries the declaration's token (`launch_id`, SPARKWATCH_LAUNCH), which launch put in the
  container it created, and the token names the file's owner (`<uid>-…`): another user can neither name a container
  they did not start nor copy someone else's token (`in_container`); per tree, the directory vouched for while the
  engine ran keeps its say (its exit included), and a declaration from elsewhere counts only when vouched itself.
  Exits are heard only from the first;
- reading is bounded whatever a user put there: the `sparkwatch` and `launched` directories are never reached
  through a symlink, at most MAX_ENTRIES entries are looked at (os.scandir stops there), MAX_DECLARATIONS files and
  MAX_DIR_BYTES read, each at most DECLARATION_MAX_BYTES, never through a symlink nor blocking on a FIFO;
- a bad file (any decoding failure: a number too big for a float, JSON nested too deep) is counted, skipped and
  said in the log once per file per watch (one line per directory read names the new ones).

How to read it (the guard, telemetry and the flight recorder do exactly this):

    watch = LaunchedWatch.of(os.environ, state_dir, proc_root)
    for decl in watch.poll():          # cheap: re-reads only what changed; only what the kernel vouches for
        decl.root_pid, decl.start_ticks, decl.kind, decl.model, decl.phase, decl.budget_bytes, decl.phases
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.durable import StateFileError, open_dir, private_dir, write_atomic
from sparkwatch.common.sources.environ import read_environ
from sparkwatch.common.sources.procs import read_cgroup, read_fd, read_start_ticks
from sparkwatch.common.wiretypes import WireError, from_json, to_json
from sparkwatch.core.containerid import ID_RE, LAUNCH_ENV, container_of
from sparkwatch.core.launch.bootphase import BOOTING, BootPhase

VERSION = 1
DECLARATION_MAX_BYTES = 16 << 10  # a declaration is ~600 bytes; a long phase timeline stays well under this
MAX_DECLARATIONS = 64  # per directory: a box runs a handful of engines
MAX_ENTRIES = 256  # directory entries looked at per read (os.scandir stops there, whatever the directory holds)
MAX_DIR_BYTES = 256 << 10  # declaration bytes read per directory per read
MAX_USERS = 4096  # runtime dirs under /run/user read by a root reader
LOGGED_MAX = 1024  # skipped files said in the log (each once, ever), per watch
LOGGED_PER_LINE = 3  # one log line per directory read names at most this many new ones (the rest counted)
RECHECK_S = 1.0  # a declaration the kernel did not vouch for is looked at again this often, not on every poll
USERS_ROOT = Path("/run/user")
SYSTEM_LAUNCHED_DIR = Path("/run/sparkwatch/launched")  # root's launches without a runtime dir; root's own
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
EXITED_KEEP_S = 60.0  # an exited declaration stays this long so every reader sees the exit
PHASES_KEPT = 32
log = logs.get("launched")
RECENT_NS = 50_000_000  # phase changes kept in the timeline (an engine flipping between JIT and profiling)


@dataclass(frozen=True, slots=True)
class Declaration:
    """One launched engine, as `sparkwatch launch` declares it. Times are wall-clock seconds."""

    root_pid: int
    start_ticks: int
    uid: int
    kind: str
    model: str  # the model as the command names it ("" when unknown)
    key: str  # the learned-peaks key (core.launch.peaks.peak_key)
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
    probe_url: str = ""  # `launch --probe URL`: where the serving probe asks instead of the command line's port
    first_token_s: float | None = None  # launch to the first good one-token completion (engine_ready comes with it)
    # `--budget worker=SIZE` for an engine over Ray: the budget of its ranks on the other nodes, which Ray starts there
    # (this node's agent tells theirs: telemetry.peerdoc `budgets`; their guards enforce it)
    worker_budget_bytes: int | None = None
    # An engine in a container (`launch -- docker run …`, compose): the container's id (64 hex digits; the root is its
    # top process, whose uid `uid` is) and the token launch put in its environment and label (`<declarer uid>-<hex>`)
    container: str = ""
    launch_id: str = ""
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


def vouched(decl: Declaration, proc_root: str | Path = "/proc") -> bool:
    """Whether the kernel vouches for `decl` now: the process at root_pid has the declared start time and is owned
    by the declared uid, which decode() already held against the file's owner (root's files may declare any uid);
    a container's, also `in_container`."""
    if read_start_ticks(proc_root, decl.root_pid) != decl.start_ticks:
        return False
    try:
        owned = os.stat(f"{proc_root}/{decl.root_pid}").st_uid == decl.uid
    except OSError:
        return False
    return owned and (not decl.container or in_container(decl, proc_root))


def in_container(decl: Declaration, proc_root: str | Path = "/proc") -> bool:
    """A container's declaration, proven: its root is in that container (the kernel's cgroup of the process,
    core.containerid) and started with the declaration's token in its environment (what `docker run -e` or compose
    gave the container's first process: only whoever created the container could put it there)."""
    ref = container_of(read_cgroup(proc_root, decl.root_pid))
    if ref is None or ref.id != decl.container or not decl.launch_id:
        return False
    env = read_environ(proc_root, decl.root_pid)
    return env is not None and env.get(LAUNCH_ENV) == decl.launch_id


def runtime_dir(env: Mapping[str, str], uid: int) -> Path | None:
    """$XDG_RUNTIME_DIR, else /run/user/UID where it exists."""
    base = env.get("XDG_RUNTIME_DIR")
    if base and os.path.isabs(base):
        return Path(base)
    default = USERS_ROOT / str(uid)
    return default if default.is_dir() else None


def launched_dir(env: Mapping[str, str], state_dir: Path, uid: int | None = None) -> Path:
    """Where this user's launches declare their engines: the runtime dir; root without one (`sudo sparkwatch
    launch`: sudo drops XDG_RUNTIME_DIR, and /run/user/0 exists only while root is logged in) the system runtime dir
    SYSTEM_LAUNCHED_DIR, which the system unit reads; anyone else the state dir."""
    uid = os.geteuid() if uid is None else uid
    base = runtime_dir(env, uid)
    if base is not None:
        return base / "sparkwatch" / "launched"
    return SYSTEM_LAUNCHED_DIR if uid == 0 else state_dir / "launched"


def launched_dirs(env: Mapping[str, str], state_dir: Path) -> list[Path]:
    """The directories a reader scans besides every user's under /run/user (LaunchedWatch.of lists those, again
    whenever /run/user changes): this user's (runtime dir and state dir), and as root the system runtime dir."""
    uid = os.geteuid()
    dirs = [launched_dir(env, state_dir, uid), state_dir / "launched"]
    if uid == 0:
        dirs.append(SYSTEM_LAUNCHED_DIR)
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def user_dirs(users_root: Path) -> list[Path]:
    """`<users_root>/UID/sparkwatch/launched` for at most MAX_USERS numeric entries (users_root is root's)."""
    out = []
    try:
        with os.scandir(users_root) as it:
            for entry in it:
                if entry.name.isdigit():
                    out.append(users_root / entry.name / "sparkwatch" / "launched")
                if len(out) >= MAX_USERS:
                    break
    except OSError:
        return []
    return sorted(out, key=lambda p: int(p.parent.parent.name))


def encode(decl: Declaration) -> bytes:
    return json.dumps(to_json(decl), separators=(",", ":")).encode()


def decode(data: bytes, owner_uid: int) -> Declaration:
    """A declaration from its file, whose owner (`owner_uid`, as the kernel reports it) is the declarer. Raises
    WireError for anything but one of ours, declaring its owner's uid (root's may declare any uid): whatever the bytes,
    never another exception (a number too big for a float, JSON nested too deep)."""
    if len(data) > DECLARATION_MAX_BYTES:
        raise WireError(f"declaration: {len(data)} bytes, over {DECLARATION_MAX_BYTES}")
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("version") != VERSION:
            raise WireError("declaration: not of this version")
        decl: Declaration = from_json(Declaration, raw, "declaration")
    except WireError:
        raise
    except (ArithmeticError, RecursionError, TypeError, ValueError) as exc:
        raise WireError(f"declaration: {type(exc).__name__}") from None
    if decl.container and not ID_RE.fullmatch(decl.container):
        raise WireError("declaration: container is not a 64-digit id")
    # A container's top process is often root's: its declaration may name another uid, with a token of its owner's
    # making (in_container then holds the container to it).
    theirs = bool(decl.container) and decl.launch_id.startswith(f"{owner_uid}-")
    if decl.uid != owner_uid and owner_uid != 0 and not theirs:
        raise WireError(f"declaration: declares uid {decl.uid} in a file owned by uid {owner_uid}")
    if len(decl.phases) > PHASES_KEPT:
        raise WireError("declaration: phase timeline too long")
    return decl


def write(directory: Path, decl: Declaration) -> Path:
    """Declare (or update) one engine, atomically."""
    if directory == SYSTEM_LAUNCHED_DIR:
        # /run/sparkwatch is shared with other system files of sparkwatch's: made 0755 if missing, never tightened.
        os.close(open_dir(directory.parent, 0o755))
    else:
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
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _read_at(dir_fd, path.name)[0]
    finally:
        os.close(dir_fd)


def _read_at(dir_fd: int, name: str) -> tuple[Declaration, int]:
    """The declaration `name` in the directory `dir_fd`, and its size: never through a symlink, never blocking on a
    FIFO, at most DECLARATION_MAX_BYTES. Raises OSError or WireError."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError(0, "is not a regular file", name)
        data = read_fd(fd, DECLARATION_MAX_BYTES + 1)
    finally:
        os.close(fd)
    return decode(data, st.st_uid), len(data)


def prune(directory: Path, now: float, alive: Iterable[int] = ()) -> int:
    """Remove this user's exited declarations older than EXITED_KEEP_S, and those whose launcher is gone while the
    engine is too (a launcher killed with SIGKILL leaves its file behind). Returns how many went."""
    gone = 0
    keep_launchers = set(alive)
    for decl in scan(directory).declarations:
        stale = decl.exited_at is not None and now - decl.exited_at > EXITED_KEEP_S
        orphan = decl.exited_at is None and not _alive(decl.launcher_pid) and decl.launcher_pid not in keep_launchers
        if (stale or orphan) and (decl.uid == os.geteuid() or decl.launch_id.startswith(f"{os.geteuid()}-")):
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
    bad: tuple[tuple[str, str], ...] = ()  # (file name, or "" for the directory itself; why it was skipped)


def _open_dir(directory: Path) -> int:
    """An fd of `directory` whose last two components (`sparkwatch/launched`) are never reached through a symlink:
    a user who links either elsewhere (a directory of 500,000 entries, another user's) is refused."""
    fd = os.open(directory.parent.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in (directory.parent.name, directory.name):
            inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return "is a symlink"
    if isinstance(exc, OSError) and exc.errno == errno.ENOTDIR:
        return "is a symlink or not a directory"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc)[:200]


def scan(directory: Path) -> ScanResult:
    """Every valid declaration in one directory, bounded whatever its owner put there: at most MAX_ENTRIES entries
    looked at (os.scandir stops there: listing a directory of 500,000 entries took ~1 s), MAX_DECLARATIONS files and
    MAX_DIR_BYTES read. Bad files are counted and named in `bad`, never fatal: whatever a file holds, decoding it
    raises nothing but what is caught here."""
    try:
        dir_fd = _open_dir(directory)
    except FileNotFoundError:
        return ScanResult()
    except OSError as exc:
        return ScanResult(errors=1, bad=(("", _why(exc)),))
    out: list[Declaration] = []
    bad: list[tuple[str, str]] = []
    try:
        names: list[str] = []
        with os.scandir(dir_fd) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_ENTRIES:
                    bad.append(("", f"over {MAX_ENTRIES} entries: the rest is not read"))
                    break
                if entry.name.endswith(".json") and not entry.name.startswith("."):
                    names.append(entry.name)
        names.sort()
        read_bytes = 0
        for n, name in enumerate(names):
            if n >= MAX_DECLARATIONS or read_bytes > MAX_DIR_BYTES:
                bad += [(skipped, "over the directory's cap") for skipped in names[n:]]
                break
            try:
                decl, size = _read_at(dir_fd, name)
            except Exception as exc:  # another user's bytes: any failure is one bad entry, never ours
                bad.append((name, _why(exc)))
                continue
            read_bytes += size
            out.append(decl)
    except OSError as exc:
        bad.append(("", _why(exc)))
    finally:
        os.close(dir_fd)
    return ScanResult(tuple(out), len(bad), tuple(bad))


@dataclass
class LaunchedWatch:
    """The declarations the kernel vouches for in `dirs` (and, with `users_root`, in every user's runtime dir under
    it, listed again whenever its mtime changes: a user who logs in later is read). A directory is read again only
    when its mtime changes. Not thread-safe: one per thread.

    Per engine tree (root pid, start time) one declaration counts: the one from the directory whose declaration the
    kernel vouched for while the engine ran (its later updates, the exit included, count), else the first that
    `vouched` now. So another user's file never shadows, replaces, lowers or raises a budget, and an exit is heard
    only from whoever declared the engine while it was alive."""

    dirs: Sequence[Path]
    users_root: Path | None = None
    proc_root: str = "/proc"
    errors_total: int = 0
    reads_total: int = 0
    _seen: dict[Path, tuple[int, ScanResult]] = field(default_factory=dict)
    _users: tuple[int | None, list[Path]] | None = None
    _sources: dict[tuple[int, int], tuple[Path, int]] = field(default_factory=dict)
    _refused: dict[tuple[Path, Declaration], float] = field(default_factory=dict)
    _logged: set[tuple[Path, str]] = field(default_factory=set)

    @classmethod
    def of(
        cls, env: Mapping[str, str], state_dir: Path, proc_root: str | Path = "/proc", *, all_users: bool | None = None
    ) -> LaunchedWatch:
        """This user's directories; as root (or with all_users) every user's under /run/user too."""
        every = os.geteuid() == 0 if all_users is None else all_users
        return cls(launched_dirs(env, state_dir), USERS_ROOT if every else None, str(proc_root))

    def all_dirs(self) -> list[Path]:
        dirs = list(self.dirs)
        if self.users_root is not None:
            try:
                mtime: int | None = os.stat(self.users_root).st_mtime_ns
            except OSError:
                mtime = None
            if self._users is None or self._users[0] != mtime:
                self._users = (mtime, user_dirs(self.users_root))
            dirs += [d for d in self._users[1] if d not in dirs]
        return dirs

    def poll(self) -> tuple[Declaration, ...]:
        dirs = self.all_dirs()
        candidates: dict[tuple[int, int], list[tuple[Path, Declaration]]] = {}
        for directory in dirs:
            for decl in self._read(directory).declarations:
                candidates.setdefault(decl.tree_key, []).append((directory, decl))
        for gone in [d for d in self._seen if d not in dirs]:
            del self._seen[gone]
        now = time.monotonic()
        refused = self._refused
        self._refused = {}
        sources: dict[tuple[int, int], tuple[Path, int]] = {}
        out: list[Declaration] = []
        for key, found in candidates.items():
            chosen = self._choose(key, found, refused, now)
            if chosen is not None:
                sources[key] = (chosen[0], chosen[1].uid)
                out.append(chosen[1])
        self._sources = sources
        return tuple(out)

    def _read(self, directory: Path) -> ScanResult:
        try:
            mtime = os.stat(directory).st_mtime_ns
        except OSError:
            self._seen.pop(directory, None)
            return ScanResult()
        seen = self._seen.get(directory)
        # A directory's mtime has the kernel's coarse clock (a few ms): two renames within one tick leave the same
        # mtime, so a directory changed within the last RECENT_NS is read again on the next poll as well.
        recent = time.time_ns() - mtime < RECENT_NS
        if seen is not None and seen[0] == mtime and not recent:
            return seen[1]
        result = scan(directory)
        self.reads_total += 1
        self.errors_total += result.errors
        self._seen[directory] = (mtime, result)
        new = [(name, why) for name, why in result.bad if (directory, name) not in self._logged]
        if new and len(self._logged) < LOGGED_MAX:
            self._logged.update((directory, name) for name, _why in new)  # each file said once, not on every read
            named = "; ".join(f"{name or '.'!a}: {why!a}" for name, why in new[:LOGGED_PER_LINE])
            more = f" (and {len(new) - LOGGED_PER_LINE} more)" if len(new) > LOGGED_PER_LINE else ""
            log.warning("declarations: skipped in %s: %s%s", ascii(str(directory)), named, more)
        return result

    def _choose(
        self,
        key: tuple[int, int],
        found: list[tuple[Path, Declaration]],
        refused: dict[tuple[Path, Declaration], float],
        now: float,
    ) -> tuple[Path, Declaration] | None:
        source = self._sources.get(key)
        for directory, decl in found:
            if (directory, decl.uid) == source:
                return directory, decl
        for directory, decl in found:
            if decl.exited_at is not None:
                continue  # an exit counts only from whoever declared the engine while the kernel saw it alive
            since = refused.get((directory, decl))
            if since is not None and now - since < RECHECK_S:
                self._refused[(directory, decl)] = since
                continue
            if vouched(decl, self.proc_root):
                return directory, decl
            self._refused[(directory, decl)] = now
        return None
