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
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkwatch.core.engines.jit import ninja_object_targets
from sparkwatch.core.enums import JitCacheKind
from sparkwatch.core.model import JitCacheState

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

    def __init__(self, cache: JitCacheKind, version: str, arch: str, path: str) -> None:
        self.cache, self.version, self.arch, self.path = cache, version, arch, path
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


class JitCacheSource:
    """Finds every flashinfer <version>/<arch> under each base, plus vLLM cache dirs, and keeps a CacheTree each."""

    def __init__(self, flashinfer_dirs: list[Path], vllm_dirs: list[Path]) -> None:
        self.flashinfer_dirs = list(flashinfer_dirs)
        self.vllm_dirs = list(vllm_dirs)
        self._trees: dict[str, CacheTree] = {}

    def _roots(self) -> list[tuple[JitCacheKind, str, str, str]]:
        roots: list[tuple[JitCacheKind, str, str, str]] = []
        for base in self.flashinfer_dirs:
            for version in _subdirs(base):
                for arch in _subdirs(version):
                    roots.append(("flashinfer", version.name, arch.name, str(arch)))
        for vdir in self.vllm_dirs:
            if vdir.is_dir():
                roots.append(("vllm", "", "", str(vdir)))
        return roots

    def collect(self, now: float | None = None) -> tuple[JitCacheState, ...]:
        roots = self._roots()
        live = {r[3] for r in roots}
        for path in list(self._trees):
            if path not in live:
                del self._trees[path]  # the cache was deleted (rm -rf ~/.cache/flashinfer): no stale series
        out = []
        for cache, version, arch, path in roots:
            tree = self._trees.get(path)
            if tree is None:
                tree = self._trees[path] = CacheTree(cache, version, arch, path)
            tree.refresh(now)
            if tree.dir_count:
                out.append(tree.state())
        return tuple(out)

    @property
    def stats_last_cycle(self) -> int:
        return sum(t.stats_last_cycle for t in self._trees.values())
