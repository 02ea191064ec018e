"""JIT caches on disk: flashinfer's <base>/<version>/<arch>/ trees and vLLM's torch compile cache.

Cheap by construction: on Sparks, a `du` loop every 10 s churned the page cache a 79 GB model needed resident.
A warm flashinfer cache holds ~100,000 files in a few thousand directories; re-walking it every second would cost
tens of milliseconds and touch every inode. Instead every directory's totals are cached, keyed on its mtime (which
changes when an entry is added, removed or renamed), and each cycle stats only:
- directories that changed recently ("hot", mtime within HOT_S): rescanned whole, because a compiler appending to an
  object does not bump the directory's mtime;
- a rolling slice of the cold ones (COLD_STATS_PER_CYCLE), so a change anywhere is seen within a sweep period
  (5,000 directories: ~20 cycles).
File contents are never read, except build.ninja files (a few KiB) when their mtime or size changes.

Errors never raise out of `collect`: a directory that vanishes mid-walk is dropped (flashinfer deletes its tmp dirs),
an unreadable one keeps its last totals and is reported in `JitCacheState.error`.

A container's own caches. An engine in a container writes its JIT cache in its own file system (`/root/.cache/
flashinfer` inside), which no host path names. For each engine whose root directory is not ours (`foreign_root`:
/proc/PID/root is another directory than /proc/self/root), its caches are found where its own environment puts them
(FLASHINFER_WORKSPACE_BASE, VLLM_CACHE_ROOT, HOME of the first member whose environment reads; else its user's home
in the container's /etc/passwd) and read through /proc/PID/root, which resolves the container's own mounts: a cache
that is a bind mount of a host directory is that directory. One that is the same directory (device and inode) as a
cache already watched (a host path in `jit_cache_dirs`, another engine of the same container) is watched once. Same
rules as the host's: a tree per cache, walked once, then hot and a slice of the cold directories each cycle; the
first sight of one is a walk, while its engine runs; it is dropped with it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkwatch.core.engines.jit import ninja_object_targets
from sparkwatch.core.enums import JitCacheKind
from sparkwatch.core.model import JitCacheState
from sparkwatch.telemetry.sources.environ import read_environ

HOT_S = 120.0
COLD_STATS_PER_CYCLE = 256
NINJA_MAX_BYTES = 1 << 20  # a flashinfer build.ninja is a few KiB; a bigger one is not read


@dataclass(slots=True)
class _Dir:
    mtime_ns: int
    bytes: int = 0
    files: int = 0
    newest_ns: int = 0
    subdirs: tuple[str, ...] = ()
    outputs: dict[str, int] = field(default_factory=dict)  # *.o / *.so name -> size
    ninja_key: tuple[int, int] | None = None  # (mtime_ns, size) of build.ninja when parsed
    targets: tuple[str, ...] = ()  # object targets, absolute paths
    error: str | None = None


class CacheTree:
    """One cache root and the cached state of every directory under it."""

    def __init__(
        self, cache: JitCacheKind, version: str, arch: str, path: str, *, root_pid: int = 0, where: str = ""
    ) -> None:
        self.cache, self.version, self.arch, self.path = cache, version, arch, path
        self.root_pid, self.where = root_pid, where
        self._dirs: dict[str, _Dir] = {}
        self._ring: list[str] = []
        self._ring_pos = 0
        self.stats_last_cycle = 0
        self._state: JitCacheState | None = None  # recomputed only after a directory changed

    # --- walking
    def _scan_dir(self, path: str, st: os.stat_result) -> _Dir:
        rec = _Dir(mtime_ns=st.st_mtime_ns, newest_ns=st.st_mtime_ns)
        subdirs = []
        ninja: os.stat_result | None = None
        with os.scandir(path) as it:
            for entry in it:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.path)
                        continue
                    est = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed between readdir and stat
                rec.bytes += est.st_size
                rec.files += 1
                rec.newest_ns = max(rec.newest_ns, est.st_mtime_ns)
                name = entry.name
                if name.endswith((".o", ".so")):
                    rec.outputs[name] = est.st_size
                elif name == "build.ninja":
                    ninja = est
        rec.subdirs = tuple(subdirs)
        old = self._dirs.get(path)
        if ninja is not None:
            key = (ninja.st_mtime_ns, ninja.st_size)
            if old is not None and old.ninja_key == key:
                rec.ninja_key, rec.targets = key, old.targets
            elif ninja.st_size <= NINJA_MAX_BYTES:
                rec.ninja_key = key
                rec.targets = self._read_targets(path)
        return rec

    def _read_targets(self, path: str) -> tuple[str, ...]:
        try:
            with open(os.path.join(path, "build.ninja"), encoding="utf-8", errors="replace") as fh:
                text = fh.read(NINJA_MAX_BYTES)
        except OSError:
            return ()
        # ninja runs in the build directory (flashinfer: `ninja -C <module dir>`), so relative targets start there.
        return tuple(os.path.normpath(os.path.join(path, t)) for t in ninja_object_targets(text))

    def _visit(self, path: str, now_ns: int, force: bool) -> None:
        """Stat one directory; rescan it if it changed or is hot; descend into new subdirectories."""
        self.stats_last_cycle += 1
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            self._drop(path)
            return
        old = self._dirs.get(path)
        hot = now_ns - st.st_mtime_ns < HOT_S * 1e9
        if old is not None and old.mtime_ns == st.st_mtime_ns and not hot and not force and old.error is None:
            return
        try:
            rec = self._scan_dir(path, st)
        except FileNotFoundError:
            self._drop(path)
            return
        except OSError as exc:
            kept = old if old is not None else _Dir(mtime_ns=st.st_mtime_ns)
            kept.error = f"{path}: {exc.strerror or exc}"
            kept.mtime_ns = -1  # retry next time it is visited
            self._dirs[path] = kept
            self._state = None
            if old is None:
                self._ring.append(path)
            return
        if old is None:
            self._ring.append(path)
        self._dirs[path] = rec
        self._state = None
        gone = set(old.subdirs) - set(rec.subdirs) if old is not None else set()
        for sub in gone:
            self._drop(sub)
        for sub in rec.subdirs:
            if sub not in self._dirs:
                self._visit(sub, now_ns, force=True)

    def _drop(self, path: str) -> None:
        rec = self._dirs.pop(path, None)
        if rec is None:
            return
        self._state = None
        for sub in rec.subdirs:
            self._drop(sub)

    def refresh(self, now: float | None = None) -> None:
        now_ns = int((time.time() if now is None else now) * 1e9)
        self.stats_last_cycle = 0
        if self.path not in self._dirs:
            self._visit(self.path, now_ns, force=True)
            self._ring = [p for p in self._ring if p in self._dirs]
            return
        # Hot directories every cycle; a slice of the rest in turn.
        hot = [p for p, d in self._dirs.items() if now_ns - d.newest_ns < HOT_S * 1e9 or d.error is not None]
        for p in hot:
            if p in self._dirs:
                self._visit(p, now_ns, force=False)
        if len(self._ring) > 2 * len(self._dirs) + 64:
            self._ring = [p for p in self._ring if p in self._dirs]
            self._ring_pos = 0
        ring = self._ring
        budget = min(COLD_STATS_PER_CYCLE, len(ring))
        for _ in range(budget):
            if not ring:
                break
            self._ring_pos %= len(ring)
            p = ring[self._ring_pos]
            self._ring_pos += 1
            if p in self._dirs:
                self._visit(p, now_ns, force=False)
        if self.path not in self._dirs:
            self._visit(self.path, now_ns, force=True)

    # --- reading
    def state(self) -> JitCacheState:
        if self._state is None:
            self._state = self._compute_state()
        return self._state

    def _compute_state(self) -> JitCacheState:
        total_bytes = files = 0
        newest = 0
        errors = []
        done = total = modules = built = 0
        for path, rec in self._dirs.items():
            total_bytes += rec.bytes
            files += rec.files
            newest = max(newest, rec.newest_ns)
            if rec.error:
                errors.append(rec.error)
            if rec.ninja_key is None:
                continue
            modules += 1
            n = len(rec.targets)
            total += n
            if os.path.basename(path) + ".so" in rec.outputs:
                built += 1
                done += n
                continue
            for target in rec.targets:
                d, name = os.path.split(target)
                owner = rec if d == path else self._dirs.get(d)
                if owner is not None and owner.outputs.get(name, 0) > 0:
                    done += 1
        return JitCacheState(
            cache=self.cache,
            version=self.version,
            arch=self.arch,
            path=self.path,
            bytes=total_bytes,
            files=files,
            last_change_ts=newest / 1e9,
            objects_done=done,
            objects_total=total,
            modules_total=modules,
            modules_built=built,
            error="; ".join(sorted(errors)[:3]) + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else "")
            if errors
            else None,
            root_pid=self.root_pid,
            where=self.where,
        )

    @property
    def dir_count(self) -> int:
        return len(self._dirs)


def _subdirs(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as it:
            return sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


ENVIRON_MEMBERS_MAX = 8  # members whose environment is read to find a container's caches (once per engine)
PASSWD_MAX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ForeignRoot:
    """An engine whose root directory is not ours (a container's): its caches, as paths that read them from here."""

    root_pid: int
    where: str  # "container 4f4f4f4f4f4f", or "pid 1234's root"
    flashinfer: tuple[Path, ...]
    vllm: tuple[Path, ...]


def _passwd_home(passwd: str, uid: int) -> str | None:
    try:
        with open(passwd, encoding="utf-8", errors="replace") as fh:
            text = fh.read(PASSWD_MAX_BYTES)
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split(":")
        if len(f) >= 6 and f[2] == str(uid) and f[5].startswith("/"):
            return f[5]
    return None


def foreign_root(
    proc_root: Path | str, root_pid: int, member_pids: tuple[int, ...], uid: int, where: str
) -> ForeignRoot | None:
    """The caches of an engine whose root directory is not ours, read through /proc/PID/root; None for an engine
    that shares our root (its caches are the host's paths) or whose root cannot be looked at (another user's)."""
    root = f"{proc_root}/{root_pid}/root"
    try:
        theirs, ours = os.stat(root), os.stat(f"{proc_root}/self/root")
    except OSError:
        return None
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return None
    env: dict[str, str] = {}
    for pid in member_pids[:ENVIRON_MEMBERS_MAX]:
        read = read_environ(proc_root, pid) or {}  # a retitled process (setproctitle) has lost its environ area
        if "HOME" in read or "FLASHINFER_WORKSPACE_BASE" in read or "VLLM_CACHE_ROOT" in read:
            env = read
            break
    home = env.get("HOME") or _passwd_home(f"{root}/etc/passwd", uid)
    flashinfer_base = env.get("FLASHINFER_WORKSPACE_BASE") or home
    vllm_base = env.get("VLLM_CACHE_ROOT") or (f"{home}/.cache/vllm" if home else None)

    def inside(path: str) -> Path:
        """A path inside the container, as it is read from here."""
        return Path(root + os.path.normpath("/" + path))

    return ForeignRoot(
        root_pid,
        where,
        (inside(f"{flashinfer_base}/.cache/flashinfer"),) if flashinfer_base else (),
        (inside(f"{vllm_base}/torch_compile_cache"),) if vllm_base else (),
    )


@dataclass(frozen=True, slots=True)
class _Root:
    cache: JitCacheKind
    version: str
    arch: str
    path: str
    root_pid: int = 0
    where: str = ""


def _dir_key(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class JitCacheSource:
    """Finds every flashinfer <version>/<arch> under each base, plus vLLM cache dirs, and keeps a CacheTree each; also
    those of the engines in containers it is handed (ForeignRoot)."""

    def __init__(self, flashinfer_dirs: list[Path], vllm_dirs: list[Path]) -> None:
        self.flashinfer_dirs = list(flashinfer_dirs)
        self.vllm_dirs = list(vllm_dirs)
        self._trees: dict[str, CacheTree] = {}

    def _roots(self, foreign: tuple[ForeignRoot, ...]) -> list[_Root]:
        roots: list[_Root] = []
        # A directory reached twice (a container's bind mount of a host cache, two engines of one container) is
        # watched once, first as the host's. Without containers nothing is stat'ed for this.
        seen: set[tuple[int, int]] = set()
        flashinfer = [(b, 0, "") for b in self.flashinfer_dirs]
        vllm = [(v, 0, "") for v in self.vllm_dirs]
        for f in foreign:
            flashinfer += [(b, f.root_pid, f.where) for b in f.flashinfer]
            vllm += [(v, f.root_pid, f.where) for v in f.vllm]
        for base, root_pid, where in flashinfer:
            key = _dir_key(base) if foreign else None
            if key is not None and key in seen:
                continue
            if key is not None:
                seen.add(key)
            for version in _subdirs(base):
                for arch in _subdirs(version):
                    roots.append(_Root("flashinfer", version.name, arch.name, str(arch), root_pid, where))
        for vdir, root_pid, where in vllm:
            key = _dir_key(vdir) if foreign else None
            if key is not None and key in seen:
                continue
            if key is not None:
                seen.add(key)
            if vdir.is_dir():
                roots.append(_Root("vllm", "", "", str(vdir), root_pid, where))
        return roots

    def collect(self, now: float | None = None, foreign: tuple[ForeignRoot, ...] = ()) -> tuple[JitCacheState, ...]:
        roots = self._roots(foreign)
        live = {r.path for r in roots}
        for path in list(self._trees):
            if path not in live:
                del self._trees[path]  # the cache was deleted (rm -rf ~/.cache/flashinfer), its engine gone: no series
        out = []
        for r in roots:
            tree = self._trees.get(r.path)
            if tree is None:
                tree = self._trees[r.path] = CacheTree(
                    r.cache, r.version, r.arch, r.path, root_pid=r.root_pid, where=r.where
                )
            tree.refresh(now)
            if tree.dir_count:
                out.append(tree.state())
        return tuple(out)

    @property
    def stats_last_cycle(self) -> int:
        return sum(t.stats_last_cycle for t in self._trees.values())
