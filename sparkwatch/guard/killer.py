"""The killer, the one module that signals engine trees (the supervisor signals only the telemetry process it
started), and the reaper that finishes each kill.

A kill, in the guard's thread and with no fork, no disk sync and no waiting:
1. pin every member of every tree with a pidfd, and check its start time, so a reused PID is never hit (the same
   stat read gives its process group and controlling terminal);
2. SIGSTOP them all but the terminal jobs' leaders (below), then sweep each member's children for anything forked
   meanwhile (a ninja spawning nvcc), stopping what it finds, until the tree stops growing;
3. where a tree is alone in its own cgroup v2 (an engine under `systemd-run --scope`), write cgroup.kill, which is
   atomic against forks; never on a cgroup that holds anything else;
4. SIGKILL through the pidfds: the terminal jobs' leaders first (they were never stopped), then every other member
   (vLLM mid-allocation ignores SIGTERM: the field lost 10 s waiting).

A terminal job's leader (core.kill.terminal.is_terminal_job_leader: `vllm serve` typed at a shell prompt) is never
SIGSTOPped: its job-control shell would report the stop at once (`[1]+ Stopped`, exit 147) and never say it was
killed. It gets SIGKILL only, after the rest of its tree is stopped and swept, so its shell says `Killed` and `$?` is
137. What that costs: such a leader can still fork between the sweep's last look at its children and its SIGKILL
(microseconds; a fork racing the SIGKILL itself is aborted by the kernel). Its children were stopped before that.

Then the Reaper thread, started before the first poll, takes over: process_mrelease on each victim (largest first)
so the pool comes back before the last thread exits, waits on the pidfds, measures, and writes the record.
"""

from __future__ import annotations

import errno
import os
import queue
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparkwatch.common import logs, syscalls
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.common.sources.procs import ProcParseError, ProcScanner, read_ancestors, read_children, read_job_stat
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.engines.identity import EngineRules, Scope, may_touch
from sparkwatch.core.kill.killrecord import KillFacts
from sparkwatch.core.kill.terminal import is_terminal_job_leader
from sparkwatch.core.model import EngineTree, Proc

log = logs.get("killer")
MAX_SWEEPS = 32  # passes after the stop (level by level, then a check of every member); a tree still growing after
# this many is caught by cgroup.kill or SIGKILL


@dataclass
class Victim:
    proc: Proc
    engine: str
    pidfd: int
    tree_root: int
    pgrp: int = 0
    tty_nr: int = 0  # its controlling terminal (0: none), for the line on its owner's terminal
    job_leader: bool = False  # a terminal job's leader: SIGKILL only, never SIGSTOP (see the module's docstring)


@dataclass
class KillJob:
    """Handed from the guard thread to the reaper: what was signalled and when."""

    facts: KillFacts
    victims: list[Victim]
    detected_at: float
    signaled_at: float | None
    available_at_signal: int
    notes: list[str] = field(default_factory=list)
    # Roots whose owner reads the kill from their launch (guard.launchwatch.told_by_launch): no terminal line.
    told_by_launch: frozenset[int] = frozenset()


def find_cgroup2_mount(proc_root: Path) -> Path | None:
    """Where the unified hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid boxes)."""
    try:
        with open(proc_root / "self" / "mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                pre, _, post = line.partition(" - ")
                if post.split(" ", 1)[0] == "cgroup2":
                    return Path(pre.split()[4])
    except OSError:
        pass
    return None


def _cgroup2_path(proc_root: Path, pid: int) -> str | None:
    try:
        with open(proc_root / str(pid) / "cgroup", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def _cgroup_members(cgroup_dir: Path) -> set[int] | None:
    """Every pid in the cgroup and its descendants, None if unreadable."""
    pids: set[int] = set()
    try:
        for dirpath, _dirs, files in os.walk(cgroup_dir):
            if "cgroup.procs" in files:
                with open(os.path.join(dirpath, "cgroup.procs"), encoding="ascii") as fh:
                    pids.update(int(x) for x in fh.read().split())
    except (OSError, ValueError):
        return None
    return pids


class Killer:
    def __init__(self, proc_root: Path, rules: EngineRules, scope: Scope, cgroup_root: Path | None = None) -> None:
        self.proc_root = proc_root
        self.rules = rules
        self.scope = scope
        # Resolved once at start-up, not on the kill path.
        self.cgroup_root = cgroup_root if cgroup_root is not None else find_cgroup2_mount(proc_root)
        self._own_cgroup = _cgroup2_path(proc_root, os.getpid())
        self._scanner = ProcScanner(proc_root)  # this thread's own scanner for swept children
        self._self_ancestors: frozenset[int] = frozenset()

    def kill(
        self,
        trees: Iterable[EngineTree],
        dry_run: bool = False,
        *,
        rules: EngineRules | None = None,
        scope: Scope | None = None,
    ) -> tuple[list[Victim], float | None, list[str], str]:
        """Stop and SIGKILL every tree. Returns (victims, monotonic time of the last SIGKILL, notes, method).

        `dry_run`, `rules` and `scope` are the caller's, per kill (the config snapshot of the tick that chose the
        tree): the record it writes, what is signalled and what the sweep may touch can never disagree.
        """
        if rules is not None:
            self.rules = rules
        if scope is not None:
            self.scope = scope
        notes: list[str] = []
        victims: dict[int, Victim] = {}
        trees = list(trees)
        # Our ancestors now (a few stat reads): a sweep must never stop the shell or unit that runs us.
        self._self_ancestors = read_ancestors(self.proc_root, self.scope.self_pid)
        for tree in trees:
            for proc in tree.members:
                victim = self._pin(proc, tree.kind, tree.root.pid)
                if victim is not None:
                    victims[proc.pid] = victim
        for v in victims.values():
            v.job_leader = is_terminal_job_leader(v.proc.pid, v.pgrp, v.tty_nr, v.proc.ppid in victims)
        if dry_run:
            for v in victims.values():
                os.close(v.pidfd)
            return list(victims.values()), None, notes, "dry-run"

        for v in list(victims.values()):
            if not v.job_leader:
                self._signal(v, signal.SIGSTOP)
        self._sweep_children(victims, notes)

        method = "pidfd"
        for tree in trees:
            if self._cgroup_kill(tree, victims, notes):
                method = "cgroup.kill+pidfd"
        leaders = [v for v in victims.values() if v.job_leader]
        for v in leaders:
            self._signal(v, signal.SIGKILL)
        for v in victims.values():
            if not v.job_leader:
                self._signal(v, signal.SIGKILL)
        if leaders:
            notes.append(f"SIGKILL without SIGSTOP for terminal job leader(s) {sorted(v.proc.pid for v in leaders)}")
        return list(victims.values()), time.monotonic(), notes, method

    def _pin(self, proc: Proc, engine: str, root: int) -> Victim | None:
        try:
            fd = syscalls.pidfd_open(proc.pid)
        except ProcessLookupError:
            return None
        except OSError:
            return None
        # The pidfd now pins whatever holds this pid. If its start time differs from the scan's, the pid was reused.
        stat = read_job_stat(self.proc_root, proc.pid)
        if stat is None or stat.start_ticks != proc.start_ticks:
            os.close(fd)
            return None
        return Victim(proc=proc, engine=engine, pidfd=fd, tree_root=root, pgrp=stat.pgrp, tty_nr=stat.tty_nr)

    def _signal(self, victim: Victim, sig: int) -> None:
        try:
            syscalls.pidfd_send_signal(victim.pidfd, sig)
        except ProcessLookupError:
            pass  # already exited
        except OSError as exc:
            log.error("signal %d to pid %d failed: %s", sig, victim.proc.pid, exc)

    def _sweep_children(self, victims: dict[int, Victim], notes: list[str]) -> None:
        """Catch what the tree forked between the scan and the stop; stop it too, until the tree is stable.

        First the new members' children, level by level; then once more every member's, because a member caught in
        the middle of a fork when SIGSTOP arrived finishes that fork before it stops. The tree is stable when a pass
        over every member finds nothing new.
        """
        frontier = list(victims.values())
        verifying = False
        for _ in range(MAX_SWEEPS):
            found: list[Victim] = []
            by_parent: dict[int, list[int]] | None = None  # one full scan a pass where the kernel has no children
            for parent in frontier:
                children = read_children(self.proc_root, parent.proc.pid)
                if children is None:
                    if by_parent is None:
                        by_parent = {}
                        for p in self._scanner.scan().procs:
                            by_parent.setdefault(p.ppid, []).append(p.pid)
                    children = by_parent.get(parent.proc.pid, [])
                for pid in children:
                    if pid in victims:
                        continue
                    try:
                        proc = self._scanner.read_proc(pid)
                    except (ProcParseError, ValueError):
                        continue
                    if proc is None or proc.ppid != parent.proc.pid or not self._may_touch(proc):
                        continue
                    victim = self._pin(proc, parent.engine, parent.tree_root)
                    if victim is None:
                        continue
                    victims[pid] = victim
                    self._signal(victim, signal.SIGSTOP)
                    found.append(victim)
            if found:
                frontier, verifying = found, False
            elif verifying:
                return
            else:
                frontier, verifying = list(victims.values()), True
        notes.append(f"tree still growing after {MAX_SWEEPS} sweeps")

    def _may_touch(self, proc: Proc) -> bool:
        """core.engines.identity.may_touch: the scanner's rule, with our ancestors read from /proc."""
        return may_touch(proc, self.rules, self.scope, self._self_ancestors)

    def _cgroup_kill(self, tree: EngineTree, victims: dict[int, Victim], notes: list[str]) -> bool:
        if self.cgroup_root is None:
            return False
        path = _cgroup2_path(self.proc_root, tree.root.pid)
        if not path or path == "/" or path == self._own_cgroup:
            return False
        if self._own_cgroup and (self._own_cgroup + "/").startswith(path.rstrip("/") + "/"):
            return False  # our own cgroup lies inside: never
        cgroup_dir = self.cgroup_root / path.lstrip("/")
        members = _cgroup_members(cgroup_dir)
        tree_pids = {pid for pid, v in victims.items() if v.tree_root == tree.root.pid}
        if not members or not members <= tree_pids:
            return False  # the cgroup holds something that is not this tree: signal processes instead
        try:
            (cgroup_dir / "cgroup.kill").write_text("1")
        except OSError as exc:
            notes.append(f"cgroup.kill on {path} failed: {exc.strerror}")
            return False
        notes.append(f"cgroup.kill {path}")
        return True


@dataclass
class _Pending:
    job: KillJob
    deadline: float  # give up waiting for exits at this monotonic time
    reaped_at: float | None = None  # all exited (or deadline passed) at this time; then the settle time runs
    survivors: list[Victim] = field(default_factory=list)


def _exited(pidfd: int) -> bool:
    """Whether the process behind `pidfd` has exited (its pidfd polls readable), without waiting."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


# While kills are pending, the reaper looks at their pidfds every 5 ms: the reap time it reports is that precise, and
# 200 polls a second of a handful of fds cost nothing next to a kill.
PENDING_POLL_S = 0.005


class Reaper:
    """Finishes each kill off the guard's thread: mrelease, announce, wait for exit, measure, record.

    It also writes the guard's other log lines, in the order the guard sent them: the KILL line is announced as soon
    as its job arrives (right after mrelease), so nothing the guard logs later can land before it. Several kills may
    be pending at once (an escalation during a slow teardown): each is announced at once and finished on its own.
    """

    def __init__(
        self,
        proc_root: Path,
        announce: Callable[[KillJob], None],
        finish: Callable[[KillJob, KillFacts], None],
        wait_s: float = 10.0,
        settle_s: float = 0.5,
        *,
        reaped: Callable[[KillJob], None] | None = None,
    ) -> None:
        self._queue: queue.SimpleQueue[KillJob | Callable[[], None] | None] = queue.SimpleQueue()
        self._announce = announce
        self._finish = finish
        # Told (on this thread) when a job's victims have all exited or its wait ran out: the guard's teardown state
        # learns of the reap from here, the one place that checks it.
        self._reaped = reaped
        self.wait_s = wait_s
        self.settle_s = settle_s
        self._meminfo = MeminfoReader(proc_root)
        self._thread = daemon_thread(self._run, "sparkwatch-reaper")
        self.mrelease_supported: bool | None = None

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: KillJob) -> None:
        self._queue.put(job)

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the reaper's thread, in order with the kills submitted before it (a log line, an event)."""
        self._queue.put(fn)

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        pending: list[_Pending] = []
        while True:
            items: list[KillJob | Callable[[], None] | None] = []
            if pending:
                self._poll(pending, PENDING_POLL_S)
                while True:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
            else:
                items.append(self._queue.get())
            for item in items:
                if item is None:
                    self._finish_now(pending)
                    return
                try:
                    if isinstance(item, KillJob):
                        self._release(item)  # memory first, words second
                        self._announce(item)
                        if item.signaled_at is None:  # dry run or no victim: nothing to wait for
                            self._finish(item, item.facts)
                        else:
                            pending.append(_Pending(item, deadline=item.signaled_at + self.wait_s))
                    else:
                        item()
                except Exception as exc:  # the reaper must outlive any one bad job
                    log.error("reaper error: %r", exc)
            for p in self._done(pending):
                pending.remove(p)
                try:
                    self._finish(p.job, self._facts(p))
                except Exception as exc:
                    log.error("reaper error: %r", exc)
                finally:
                    self._close(p.job)

    def _poll(self, pending: list[_Pending], timeout_s: float) -> None:
        """Mark exited victims; a pidfd reports POLLIN when its process has exited."""
        poller = select.poll()
        fds = {v.pidfd: v for p in pending if p.reaped_at is None for v in p.job.victims}
        for fd in fds:
            poller.register(fd, select.POLLIN)
        exited = {fd for fd, _ in poller.poll(timeout_s * 1000)} if fds else set()
        if not fds:
            time.sleep(timeout_s)
        now = time.monotonic()
        for p in pending:
            if p.reaped_at is not None:
                continue
            alive = [v for v in p.job.victims if v.pidfd not in exited]
            if not alive or now >= p.deadline:
                p.reaped_at, p.survivors = now, alive
                if self._reaped is not None:
                    self._reaped(p.job)

    def _finish_now(self, pending: list[_Pending]) -> None:
        """Stopping in the middle of a teardown or settle time (SIGTERM, a restart): record every pending kill now with
        what is known (victims still alive are its survivors, MemAvailable is read now), so that no kill that was
        signalled goes without its event."""
        now = time.monotonic()
        for p in pending:
            try:
                if p.reaped_at is None:
                    p.reaped_at, p.survivors = now, [v for v in p.job.victims if not _exited(v.pidfd)]
                self._finish(p.job, self._facts(p, settle_s=now - p.reaped_at))
            except Exception as exc:
                log.error("reaper error: %r", exc)
            finally:
                self._close(p.job)

    def _done(self, pending: list[_Pending]) -> list[_Pending]:
        now = time.monotonic()
        return [p for p in pending if p.reaped_at is not None and now >= p.reaped_at + self.settle_s]

    def _facts(self, p: _Pending, settle_s: float | None = None) -> KillFacts:
        """The kill's measured facts, MemAvailable read `settle_s` after the reap (the configured settle time unless
        the reaper is stopping sooner)."""
        job = p.job
        assert job.signaled_at is not None and p.reaped_at is not None
        try:
            after: int | None = self._meminfo.read().available_bytes
        except MeminfoError:
            after = None
        return replace(
            job.facts,
            detect_to_signal_ms=(job.signaled_at - job.detected_at) * 1000,
            signal_to_reaped_ms=None if p.survivors else (p.reaped_at - job.signaled_at) * 1000,
            reclaimed_bytes=None if after is None else after - job.available_at_signal,
            available_after_settle_bytes=after,
            settle_s=self.settle_s if settle_s is None else settle_s,
            survivors=tuple(v.proc.pid for v in p.survivors),
        )

    @staticmethod
    def _close(job: KillJob) -> None:
        for v in job.victims:
            try:
                os.close(v.pidfd)
            except OSError:
                pass

    def _release(self, job: KillJob) -> None:
        """process_mrelease every victim, largest first: it frees anonymous memory even for a victim stuck in D."""
        if job.signaled_at is None or self.mrelease_supported is False:
            return
        for v in sorted(job.victims, key=lambda v: -v.proc.rss_bytes):
            if syscalls.process_mrelease(v.pidfd) == errno.ENOSYS:
                self.mrelease_supported = False  # kernel < 5.15: exit frees it, a little later
                return
            self.mrelease_supported = True

    def reap(self, job: KillJob) -> KillFacts:
        """The same measurement as the thread's, for one job, blocking (tests and one-shot callers)."""
        if job.signaled_at is None:
            return job.facts
        p = _Pending(job, deadline=job.signaled_at + self.wait_s)
        while p.reaped_at is None:
            self._poll([p], PENDING_POLL_S)
        time.sleep(max(p.reaped_at + self.settle_s - time.monotonic(), 0))
        facts = self._facts(p)
        self._close(job)
        return facts
