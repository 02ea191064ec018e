"""The process table, read straight from <proc_root>/<pid>/{stat,cmdline}.

Why not psutil here: the guard scans on the kill path and the telemetry every second, and psutil costs ~50-100 µs a
process for the fields we need (ppid, uid, comm, state, start time, RSS, argv): 100-200 ms for 2,000 processes.
Reading cmdline is the dear part (the kernel walks the target's memory): measured here, a cold scan of 113 processes
took 16.4 ms and a warm one 3.9 ms. So argv is cached per process (pid, start time) for one program image and title:
the entry holds while comm and the argv span (stat fields 48-49, where the kernel put this image's argv) stay what
they were, and kernel threads are never asked for one.

- setproctitle changes comm along with argv, so a new title invalidates the entry;
- an exec gives a new argv span even when the new program has the old one's name (python3 that fork-execs python3,
  a shell that runs a shell): comm alone kept the parent's pre-exec argv for the child's whole life (CI's likeliest
  reading of an unadopted offline EngineCore: its `python offline_infer.py` parent, read between pytest's fork and
  its exec, kept pytest's argv);
- in the exec window the kernel has set the new comm but not yet the argv (span 0 0, cmdline empty): an empty argv
  of a live process is never cached, or `/usr/bin/tail -f vllm.log` read there stayed argv-less for good.

The same cache keeps what protection and identity need that a user cannot forge: the executable (readlink
/proc/PID/exe), the cgroup v2 path, and, only for generic launchers (`core.engines.identity.wants_maps`: an mpi4py
worker), the first engine library found in /proc/PID/maps (read in bounded chunks), all read again with argv.

The maps of one more kind of process are read, once each: the plain Python parent of a process titled like an engine
that adopts its parent (`core.engines.identity.wants_parent_maps`: an EngineCore, an SGLang scheduler). Adoption needs
the engine's own native module mapped in that parent as evidence (core.engines.identity._adoptable_parent). The read
happens when such a child is first read (a new title is a new comm, so the child is read again), after the scan's loop,
so it costs one maps read per engine parent and nothing per scan for anyone else.

The executable is unforgeable only in the initial namespaces: any user may `unshare -Urm` and bind-mount python3 over
/usr/bin/systemd-cat. So for the few processes whose exe would protect them (`core.engines.identity.exe_protects`: sshd,
systemd, tmux, …) the scanner also stats /proc/PID/ns/user and ns/mnt and compares them with PID 1's
(`outside_initial_ns`). Two stat calls for each such process, once in its life (cached with the rest); nothing for
any other process.

Every error on a single process (it exited mid-scan, another user's process denies us) drops that process and the
scan goes on; the count is reported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from sparkwatch.core.engines.identity import (
    ENGINE_LIBRARIES,
    exe_protects,
    parent_wants_maps,
    wants_maps,
    wants_parent_maps,
)
from sparkwatch.core.livecache import LiveCache
from sparkwatch.core.model import Proc

PF_KTHREAD = 0x00200000
PF_EXITING = 0x00000004  # include/linux/sched.h: getting shut down (do_exit), memory not all released yet
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_CMDLINE_MAX = 8192  # enough for any identity; cmdlines of 100 KiB exist and are not worth reading whole
_MAPS_MAX = 4 << 20  # a torch + TensorRT-LLM worker maps ~3,000 regions (~300 KiB of maps); stop well past that
_MAPS_CHUNK = 256 << 10


Image = tuple[str, bytes, bytes]  # comm, arg_start, arg_end as stat shows them: the argv cache's validity


class _Facts(NamedTuple):
    """What is read once per program image and title of a process and kept: the costly or privileged reads.
    Valid while the process shows the same comm and argv span (`image`)."""

    image: Image  # comm, arg_start, arg_end when read
    argv: tuple[str, ...]
    exe: str | None
    cgroup: str | None
    engine_lib: str | None
    maps_read: bool = False  # /proc/PID/maps was looked at (engine_lib None then means: no engine library)
    outside_initial_ns: bool = False


# include/linux/proc_ns.h: the initial user namespace has this fixed inode. The reference when PID 1's own namespaces
# cannot be read (a user unit: /proc/1/ns/* needs ptrace access to PID 1; some containers deny it to root as well).
PROC_USER_INIT_INO = 0xEFFFFFFD


def _ns_ino(path: str) -> int | None:
    """The namespace's inode (stat follows the ns link); None when the file is absent (a fixture tree, or gone)."""
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def initial_namespaces(proc_root: str) -> tuple[int, int | None]:
    """(user ns, mount ns or None) of PID 1 under proc_root: the initial ones. Unreadable: the initial user
    namespace's fixed inode, and no mount reference. An unprivileged user gets a mount namespace of its own only
    inside a user namespace of its own, so the user namespace alone still catches `unshare -Urm`."""
    try:
        user = _ns_ino(f"{proc_root}/1/ns/user")
        mnt = _ns_ino(f"{proc_root}/1/ns/mnt")
    except OSError:
        return PROC_USER_INIT_INO, None
    return (PROC_USER_INIT_INO if user is None else user), mnt


def outside_namespaces(base: str, initial: tuple[int, int | None]) -> bool:
    """Whether the process at `base` lives outside the initial user or mount namespace. A namespace that cannot be
    read (but the exe could) counts as outside: only a proof of the initial ones lets the executable protect."""
    user_ref, mnt_ref = initial
    try:
        user = _ns_ino(f"{base}/ns/user")
        if user is None:
            return False  # no ns files: a fixture tree (a live process on procfs always has them)
        if user != user_ref:
            return True
        if mnt_ref is not None:
            mnt = _ns_ino(f"{base}/ns/mnt")
            return mnt is not None and mnt != mnt_ref
    except OSError:
        return True
    return False


def _read(path: str, size: int = 4096) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


_CHILDREN_MAX = 4 << 20  # 4 MiB: a pid list of half a million children; more is not a process tree


def read_fd(fd: int, limit: int) -> bytes:
    """What `fd` holds up to EOF, at most `limit` bytes (the caller closes it). The one bounded read loop: procfs seq
    files hand out at most one page (4 KiB) a read, so a single read of /proc/PID/task/TID/children stops at ~680
    children and misses the newest ones; state files are read the same way with their own limits."""
    chunks = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _read_all(path: str, limit: int = _CHILDREN_MAX) -> bytes:
    """The whole file, read until EOF (see read_fd)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_fd(fd, limit)
    finally:
        os.close(fd)


class ProcParseError(ValueError):
    pass


def parse_stat(pid: int, data: bytes) -> tuple[str, str, int, int, int, int]:
    """(comm, state, ppid, flags, start_ticks, rss_pages) from /proc/<pid>/stat.

    comm may hold spaces and parentheses (`foo) Z `): it runs from the first '(' to the *last* ')'.
    """
    return _parse_stat(pid, data)[:6]


def _parse_stat(pid: int, data: bytes) -> tuple[str, str, int, int, int, int, Image]:
    """parse_stat's fields and the image: which program image and title the process shows.

    arg_start and arg_end (stat fields 48-49, Linux 3.5+) are where exec put this image's argv: a new image gets a
    new span under ASLR even with the old name. They read 0 0 in the exec window before the kernel set them, and for a
    process we may not ptrace-read (another user's, as non-root: not one the guard may signal); comm tells alone then.
    They are compared as the bytes stat shows, never parsed: this runs for every process of every scan.
    """
    open_i = data.find(b"(")
    close_i = data.rfind(b")")
    if open_i < 0 or close_i < open_i:
        raise ProcParseError(f"/proc/{pid}/stat: no comm")
    comm = data[open_i + 1 : close_i].decode(errors="replace")
    fields = data[close_i + 2 :].split()
    if len(fields) < 22:
        raise ProcParseError(f"/proc/{pid}/stat: {len(fields)} fields")
    image = (comm, fields[45], fields[46]) if len(fields) >= 47 else (comm, b"", b"")  # older kernels: comm alone
    # fields[0] is stat field 3 (state); field N of proc(5) is fields[N - 3].
    return comm, fields[0].decode(), int(fields[1]), int(fields[6]), int(fields[19]), int(fields[21]), image


def _read_exe(base: str) -> str | None:
    try:
        return os.readlink(f"{base}/exe")
    except OSError:
        return None  # a zombie, or another user's process and we are not root: nothing we may act on


def parse_cgroup(data: bytes) -> str | None:
    """The cgroup v2 path (the `0::` line) of /proc/<pid>/cgroup."""
    for line in data.split(b"\n"):
        if line.startswith(b"0::"):
            return line[3:].decode(errors="replace").strip() or None
    return None


def _read_cgroup(base: str) -> str | None:
    try:
        return parse_cgroup(_read(f"{base}/cgroup"))
    except OSError:
        return None


def find_engine_lib(maps_path: str, max_bytes: int = _MAPS_MAX) -> str | None:
    """The first mapped file whose path holds an ENGINE_LIBRARIES marker, reading at most max_bytes of maps."""
    markers = tuple(m.encode() for m, _ in ENGINE_LIBRARIES)
    try:
        fd = os.open(maps_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        seen = 0
        tail = b""
        while seen < max_bytes:
            chunk = os.read(fd, _MAPS_CHUNK)
            if not chunk:
                return None
            seen += len(chunk)
            data = tail + chunk
            lines = data.split(b"\n")
            tail = lines.pop()  # a partial last line: completed by the next chunk
            for line in lines:
                if any(m in line for m in markers):
                    return line.rsplit(b" ", 1)[-1].decode(errors="replace")
        return None
    except OSError:
        return None
    finally:
        os.close(fd)


def parse_cmdline(data: bytes) -> tuple[str, ...]:
    if not data:
        return ()
    parts = data.split(b"\0")
    while parts and parts[-1] == b"":
        parts.pop()  # the terminating NUL, and the NUL padding setproctitle leaves in the old argv area
    return tuple(p.decode(errors="replace") for p in parts)


_KTHREAD_FACTS = _Facts(("", b"", b""), (), None, None, None)


@dataclass(frozen=True, slots=True)
class ScanResult:
    procs: tuple[Proc, ...]
    vanished: int  # exited between listdir and read: normal, counted for the curious
    errors: int  # unparsable entries: reported, never acted on
    reads: int = 0  # processes actually read (the rest were reused from an earlier scan)


class ProcScanner:
    """Scans a proc tree. Keeps a small argv cache between scans.

    Two threads may scan with one scanner (the guard and its scout): the cache sees only single dict reads and
    writes, which are atomic, and a prune that copies the items first. A lost insert costs one cmdline read.
    """

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = str(proc_root)
        self._cache: LiveCache[tuple[int, int], _Facts] = LiveCache()
        self._initial_ns: tuple[int, int | None] | None = None  # PID 1's namespaces, read once when first needed

    def _outside(self, base: str) -> bool:
        if self._initial_ns is None:
            self._initial_ns = initial_namespaces(self.proc_root)
        return outside_namespaces(base, self._initial_ns)

    def read_proc(self, pid: int, adopters: list[int] | None = None) -> Proc | None:
        """One process, or None if it is gone. Raises ProcParseError on garbage.

        `adopters`: where to note the parent pid of a freshly read process that adopts its parent
        (core.engines.identity.wants_parent_maps), so that scan() looks at that parent's maps once."""
        base = f"{self.proc_root}/{pid}"
        try:
            comm, state, ppid, flags, start, rss_pages, image = _parse_stat(pid, _read(f"{base}/stat"))
            uid = os.stat(base).st_uid
            kthread = bool(flags & PF_KTHREAD)
            facts = _KTHREAD_FACTS if kthread else self._cache.get((pid, start))  # kernel threads: nothing to read
            if facts is None or (not kthread and facts.image != image):
                argv = parse_cmdline(_read(f"{base}/cmdline", _CMDLINE_MAX))
                maps = wants_maps(comm, argv)
                lib = find_engine_lib(f"{base}/maps") if maps else None
                exe = _read_exe(base)
                outside = exe is not None and exe_protects(exe) and self._outside(base)
                facts = _Facts(image, argv, exe, _read_cgroup(base), lib, maps, outside)
                if argv or state in ("Z", "X"):  # a live process without argv is in its exec window: read it again
                    self._cache.put((pid, start), facts)
                if adopters is not None and ppid > 2 and wants_parent_maps(comm, argv):
                    adopters.append(ppid)
        except (FileNotFoundError, ProcessLookupError):
            return None
        except PermissionError:
            # hidepid or another user's process on a hardened box: we could not signal it either.
            return None
        return Proc(
            pid=pid,
            ppid=ppid,
            uid=uid,
            comm=comm,
            state=state,
            start_ticks=start,
            rss_bytes=rss_pages * _PAGE_SIZE,
            argv=facts.argv,
            is_kernel_thread=kthread,
            exe=facts.exe,
            cgroup=facts.cgroup,
            engine_lib=facts.engine_lib,
            outside_initial_ns=facts.outside_initial_ns,
            exiting=bool(flags & PF_EXITING) and state not in ("Z", "X"),
        )

    def scan(self, reuse: Callable[[int], Proc | None] | None = None) -> ScanResult:
        """Every process. `reuse(pid)` may hand back an earlier record to keep instead of reading that pid again."""
        procs: list[Proc] = []
        adopters: list[int] = []
        vanished = errors = reads = 0
        try:
            names = os.listdir(self.proc_root)
        except OSError:
            return ScanResult((), 0, 1)
        for name in names:
            if not name.isdigit():
                continue
            pid = int(name)
            kept = reuse(pid) if reuse is not None else None
            if kept is not None:
                procs.append(kept)
                continue
            reads += 1
            try:
                proc = self.read_proc(pid, adopters)
            except (ProcParseError, ValueError, OSError):
                errors += 1
                continue
            if proc is None:
                vanished += 1
            else:
                procs.append(proc)
        if adopters:
            self._read_parent_maps(procs, set(adopters))
        # The guard and its scout thread may share this scanner: core.livecache says why that is safe.
        self._cache.forget_dead(lambda: {p.key for p in procs})
        return ScanResult(tuple(procs), vanished, errors, reads)

    def _read_parent_maps(self, procs: list[Proc], parents: set[int]) -> None:
        """Adoption evidence: the engine library mapped in each parent adoption could accept, read once per
        program image and title (the cache entry's) and kept there, whatever it found."""
        for i, proc in enumerate(procs):
            if proc.pid not in parents or not parent_wants_maps(proc):
                continue
            facts = self._cache.get(proc.key)
            if facts is None or facts.maps_read or facts.argv != proc.argv:
                continue  # not cached (exec window), looked at already, or the entry is of another image by now
            lib = find_engine_lib(f"{self.proc_root}/{proc.pid}/maps")
            self._cache.put(proc.key, facts._replace(engine_lib=lib, maps_read=True))
            if lib is not None:
                procs[i] = replace(proc, engine_lib=lib)


def same_netns(proc_root: Path | str, pid: int) -> bool:
    """Whether `pid` lives in our network namespace: on this node (in the two-node tests each node is one), and its
    sockets are ours to ask the kernel about. False when either link is unreadable."""
    try:
        return os.readlink(f"{proc_root}/{pid}/ns/net") == os.readlink(f"{proc_root}/self/ns/net")
    except OSError:
        return False


def read_start_ticks(proc_root: Path | str, pid: int) -> int | None:
    """Start time of a live pid, None if gone: with the pid it identifies one process across reuse."""
    try:
        return parse_stat(pid, _read(f"{proc_root}/{pid}/stat"))[4]
    except (OSError, ProcParseError, ValueError):
        return None


def read_running_start_ticks(proc_root: Path | str, pid: int) -> int | None:
    """Start time of a pid that still runs; None if gone or a zombie (it has ended, and its parent has not reaped it
    yet: a Ray rank whose raylet died waits for whoever inherits it, 2 s on the test box)."""
    try:
        _comm, state, _ppid, _flags, start_ticks, _rss = parse_stat(pid, _read(f"{proc_root}/{pid}/stat"))
    except (OSError, ProcParseError, ValueError):
        return None
    return None if state in ("Z", "X") else start_ticks


class JobStat(NamedTuple):
    """What the killer reads of each member when it pins it: the start time (with the pid, one process across
    reuse), and the job-control facts (core.kill.terminal: is a shell watching this process?)."""

    start_ticks: int
    pgrp: int
    tty_nr: int


def read_job_stat(proc_root: Path | str, pid: int) -> JobStat | None:
    """Start time, process group and controlling terminal of a live pid from one stat read; None if gone."""
    try:
        data = _read(f"{proc_root}/{pid}/stat")
        close_i = data.rfind(b")")
        if close_i < 0:
            return None
        fields = data[close_i + 2 :].split()
        # fields[N - 3] is proc(5) stat field N: 5 pgrp, 7 tty_nr, 22 starttime.
        return JobStat(int(fields[19]), int(fields[2]), int(fields[4]))
    except (OSError, ValueError, IndexError):
        return None


def read_ancestors(proc_root: Path | str, pid: int, limit: int = 64) -> frozenset[int]:
    """pid's parent, its parent, … up to PID 1 (excluded), from stat files; bounded against ppid cycles."""
    out: set[int] = set()
    cur = pid
    for _ in range(limit):
        try:
            ppid = parse_stat(cur, _read(f"{proc_root}/{cur}/stat"))[2]
        except (OSError, ProcParseError, ValueError):
            break
        if ppid <= 1 or ppid in out:
            break
        out.add(ppid)
        cur = ppid
    return frozenset(out)


def read_cgroup(proc_root: Path | str, pid: int) -> str | None:
    """The cgroup v2 path of a live pid (its `0::` line); None if gone or unreadable."""
    return _read_cgroup(f"{proc_root}/{pid}")


def read_rss_bytes(proc_root: Path | str, pids: Iterable[int]) -> int:
    """The RSS of `pids` summed, from their stat files; a pid gone meanwhile counts nothing."""
    total = 0
    for pid in pids:
        try:
            total += parse_stat(pid, _read(f"{proc_root}/{pid}/stat"))[5] * _PAGE_SIZE
        except (OSError, ValueError):  # ProcParseError is a ValueError
            continue
    return total


def read_descendants(proc_root: Path | str, roots: Iterable[int]) -> list[int]:
    """`roots` and every descendant of theirs, each once, from the kernel's children lists (read_children); a
    kernel without CONFIG_PROC_CHILDREN gives the roots alone."""
    out: list[int] = []
    seen: set[int] = set()
    frontier = list(roots)
    while frontier:
        pid = frontier.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        frontier.extend(read_children(proc_root, pid) or [])
    return out


def read_children(proc_root: Path | str, pid: int) -> list[int] | None:
    """Direct children of pid from /proc/<pid>/task/*/children (one small read per thread).

    None when the kernel lacks CONFIG_PROC_CHILDREN: the caller falls back to a full scan.
    """
    out: list[int] = []
    base = f"{proc_root}/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out  # the process is gone: no children to find
    for tid in tids:
        try:
            out.extend(int(x) for x in _read_all(f"{base}/{tid}/children").split())
        except FileNotFoundError:
            if not os.path.exists(f"{base}/{tid}"):
                continue  # the thread exited
            return None
        except (OSError, ValueError):
            continue
    return out


# A CUDA process keeps /dev/nvidiactl, /dev/nvidia<N> and /dev/nvidia-uvm open for as long as it has a context.
GPU_DEVICE_PREFIX = "/dev/nvidia"
GPU_FDS_LOOKED_AT = 4096  # an engine holds a few hundred fds; this bounds the readlinks for a pathological one


def holds_gpu_device(proc_root: Path | str, pid: int, max_fds: int = GPU_FDS_LOOKED_AT) -> bool:
    """Whether pid has an NVIDIA device file open now: the guard's own check of what telemetry (NVML) reports.

    readlink on /proc/PID/fd/* takes no lock of the target's (unlike maps, which waits on its mmap lock).
    """
    base = f"{proc_root}/{pid}/fd"
    try:
        with os.scandir(base) as entries:
            for n, entry in enumerate(entries):
                if n >= max_fds:
                    return False
                try:
                    if os.readlink(entry.path).startswith(GPU_DEVICE_PREFIX):
                        return True
                except OSError:
                    continue  # closed meanwhile
    except OSError:
        return False  # gone, or not ours to look at
    return False


class IncrementalScanner:
    """The telemetry's process table: fresh where it matters, re-read in slices elsewhere.

    A full scan costs ~15 µs a process here (open/read/close of stat, a stat for the uid, parsing): 30 ms for 2,000
    processes every second, the whole telemetry budget. Most of those are shells and daemons whose stat line does not
    matter second to second. Each cycle this re-reads:
    - every new pid (listdir), so a new compiler or engine is seen at once;
    - the `hot` pids the caller names (engine tree members and compilers: their RSS, state and children matter);
    - one slice of the rest (pid % slices), so a retitled process (setproctitle after start) or a reparented one is
      seen within `slices` cycles.
    Exited pids drop out at once (listdir). The guard never uses this: it scans fully on its kill path.
    """

    def __init__(self, proc_root: Path = Path("/proc"), slices: int = 5) -> None:
        self.scanner = ProcScanner(proc_root)
        self.slices = slices
        self._known: dict[int, Proc] = {}
        self._cycle = 0
        self.reads_last_cycle = 0

    def scan(self, hot: set[int] | frozenset[int] = frozenset()) -> ScanResult:
        self._cycle += 1
        turn = self._cycle % self.slices
        known = self._known

        def reuse(pid: int) -> Proc | None:
            return None if pid % self.slices == turn or pid in hot else known.get(pid)

        result = self.scanner.scan(reuse)
        self._known = {p.pid: p for p in result.procs}
        self.reads_last_cycle = result.reads
        return result
