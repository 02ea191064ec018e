"""The engines `sparkwatch launch` declared (common.launched), as the guard knows them: who they are, and their events.

The declarations are read on a thread of their own (`start()`: "sparkwatch-decl", when a directory changed, as
inotify says through common.dirwatch, at most every POLL_EVERY_S; without inotify every POLL_EVERY_S), never on the
pool watch's tick: the files are other users' to write, so however many they make, or however they make them, the
guard loop's latency does not depend on them. The pool watch, the budgets and the scout read the last result
(`live()`, `declared()`: replaced whole after each poll, never mutated). Each poll is one stat per declarations
directory; files are read again only when a directory changed, and every read is bounded (common.launched).
A declaration counts only for the process it names, as the kernel reports it (common.launched.vouched): the same pid
and start time, owned by the uid whose file it is (never another user's or root's process on a user's word).
Trusted declarations are engines for the guard's tree building (core.engines.identity, by (pid, start_ticks)), and the
guard records what it sees of them, so one writer keeps events.jsonl:
- `engine_started` when a declared root appears alive (declarations made before this guard started are taken as
  already recorded: a restarted guard does not repeat them); a declaration the guard never saw alive makes no event;
- `engine_ready` when its boot phase reaches ready, with the seconds to ready and the peak launch measured;
- `engine_exited` when launch declares the exit (exit code or signal) or the root is gone, with `killed_by`
  `sparkwatch` when this guard killed it (`note_kill`); after a dry run's decision `killed_by` stays null, `dry_run`
  is true and the summary says it would have been killed.
The same kills are the guard's word to launch (`kill_words`, published in guard.json by the guard process,
common.guardfile): launch reads the one keyed by its declaration, and for a tree whose launch is alive to print that
line (`told_by_launch`) the guard writes no line on the engine's terminal (guard.ttynote), so the owner reads one.
Liveness of declared roots is checked at most once a second (a stat read per declared engine).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.dirwatch import DirWatch
from sparkwatch.common.launched import Declaration, LaunchedWatch
from sparkwatch.common.sources.procs import read_ancestors, read_start_ticks
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.engines.identity import Declared, Launchers, within_ancestor
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.launch.bootphase import BootPhase
from sparkwatch.core.postmortem.flight import LaunchedEngine
from sparkwatch.core.report.guardstate import KILLS_PUBLISHED, SUMMARY_MAX, KillWord
from sparkwatch.core.units import format_size

log = logs.get("guard")

LIVENESS_EVERY_S = 1.0
# Polls stay this far apart, whatever the directories' changes (they are other users' to make), and without inotify
# this is the polling period: a new declaration counts within it (a budget's first look follows at once).
POLL_EVERY_S = 0.2
# With inotify and nothing declared, a look this often all the same: the backstop of a missed event.
IDLE_LOOK_S = 60.0
# A declaration made this long before the guard started is taken as already recorded by an earlier guard.
STARTED_BEFORE_US_S = 5.0
KILLS_REMEMBERED = 64
EXIT_WORD_WAIT_S = 5.0

# Records an event on the reaper's thread: (kind, summary, fields, log level, log line).
Recorder = Callable[[EventKind, str, dict[str, object], int, str], None]


@dataclass
class _Seen:
    decl: Declaration
    started: bool
    ready: bool
    exited: bool
    gone_since: float | None = None


class LaunchedEngines:
    def __init__(
        self,
        dirs: Sequence[Path],
        proc_root: str,
        record: Recorder,
        now_wall: float | None = None,
        *,
        users_root: Path | None = None,
        ancestor_pid: int = 0,
    ) -> None:
        self.watch = LaunchedWatch(dirs, users_root, proc_root)
        self.proc_root = proc_root
        # The guard's `ancestor_pid` (applied live: the pool watch sets it on a reload): a declared tree outside it is
        # never one of the guard's trees, so the guard never says it took it (`live`).
        self.ancestor_pid = ancestor_pid
        self.record = record
        self.started_at = time.time() if now_wall is None else now_wall
        self._seen: dict[tuple[int, int], _Seen] = {}
        self._next_liveness = 0.0
        # tree key -> (trigger, dry run), for engine_exited's killed_by
        self._kills: dict[tuple[int, int], tuple[str, bool]] = {}
        # The latest kills of declared engines, for launch (guard.json): replaced whole, read from the main thread.
        self._kill_words: tuple[KillWord, ...] = ()
        # What other threads read (the scout): replaced whole after each poll, never mutated.
        self._declared: Declared = {}
        self._launchers: Launchers = {}
        self._containers: frozenset[tuple[int, int]] = frozenset()
        self._live: tuple[Declaration, ...] = ()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_r = self._stop_w = -1  # the stop's wake-up of the thread's inotify wait (start, stop)
        self.poll_failures_total = 0
        self.polls_total = 0

    @classmethod
    def for_settings(cls, state_dir: Path, proc_root: Path, record: Recorder, ancestor_pid: int = 0) -> LaunchedEngines:
        watch = LaunchedWatch.of(os.environ, state_dir, proc_root)
        return cls(watch.dirs, str(proc_root), record, users_root=watch.users_root, ancestor_pid=ancestor_pid)

    # --- the thread
    def start(self) -> None:
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = daemon_thread(self._run, "sparkwatch-decl")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._stop_w >= 0:
            os.close(self._stop_w)  # the wait sees the pipe's end and returns
            self._stop_w = -1
        if self._thread is not None:
            self._thread.join(1)  # a daemon thread: never wait on a slow filesystem long

    def _run(self) -> None:
        """Poll, then sleep until a declarations directory changes (common.dirwatch): with nothing declared the
        thread does not wake (IDLE_LOOK_S apart, a backstop); while a declared root lives, once a second for its
        liveness. However often other users' files change, polls stay POLL_EVERY_S apart. Where the kernel refuses
        the watches, every POLL_EVERY_S as before."""
        waker = self._waker()
        last = -math.inf
        try:
            while not self._stop.is_set():
                if self._stop.wait(max(POLL_EVERY_S - (time.monotonic() - last), 0.0)):
                    return
                last = time.monotonic()
                self.polls_total += 1
                try:
                    self.poll(last)
                except Exception as exc:  # never let one bad poll end the thread: the next one reads again
                    self.poll_failures_total += 1
                    if self.poll_failures_total == 1:
                        log.warning("launched engines: poll failed: %r", exc)
                roots = [self.watch.users_root] if self.watch.users_root is not None else []
                if waker is None or not waker.arm(self.watch.all_dirs(), roots):
                    continue  # polled again POLL_EVERY_S on
                living = any(not seen.exited for seen in self._seen.values())
                waker.wait(LIVENESS_EVERY_S if living else IDLE_LOOK_S, self._stop_r)
        finally:
            if waker is not None:
                waker.close()
            os.close(self._stop_r)

    def _waker(self) -> DirWatch | None:
        try:
            return DirWatch()
        except OSError as exc:
            log.warning("launched engines: no inotify (%s): declarations looked at every %g s", exc, POLL_EVERY_S)
            return None

    # --- what the guard uses
    def declared(self) -> Declared:
        """(pid, start_ticks) -> (kind, uid) of every trusted, live declared root (safe from any thread)."""
        return self._declared

    def launchers(self) -> Launchers:
        """(pid, start_ticks) of each declared root -> its launcher's pid
        (core.engines.identity.adopt_launch_orphans)."""
        return self._launchers

    def declarations(self) -> tuple[Declaration, ...]:
        """Every live declaration the kernel vouches for, whether or not the guard's scope holds its tree (the
        budgets read these: a tree outside the scope is never found, so never held to its budget)."""
        return self._live

    def live(self) -> tuple[Declaration, ...]:
        """The live declared engines this guard guards, which it publishes as taken (guard.json): those whose root
        its `ancestor_pid` holds. A tree outside it is never one of the guard's trees (core.engines.identity), so
        its budget is never enforced, and launch must not be told "enforced": the guard took a declaration there,
        never killed, and the engine reached 900 MiB over a budget of 300 MiB. Read on the caller's thread, a stat
        file per ancestor of each declared root, only with `ancestor_pid` set."""
        if not self.ancestor_pid:
            return self._live
        return tuple(
            d
            for d in self._live
            if within_ancestor(self.ancestor_pid, d.root_pid, read_ancestors(self.proc_root, d.root_pid))
        )

    def boot_phases(self) -> tuple[LaunchedEngine, ...]:
        """Each live launched engine as the flight recorder keeps it (safe from any thread): its kind and model's
        last path part ("vllm Qwen3-32B": a record field holds a name, not a path), root pid and boot phase."""
        return tuple(
            LaunchedEngine(f"{d.kind} {os.path.basename(d.model.rstrip('/'))}".strip(), d.root_pid, str(d.phase))
            for d in self._live
        )

    def note_kill(self, key: tuple[int, int], trigger: str, dry_run: bool = False, summary: str = "") -> bool:
        """Remember a kill (or a dry run's decision) for engine_exited; when the tree is a declared engine, also as the
        guard's word to its launch (`kill_words`). True when it was one: the caller has guard.json republished."""
        self._kills[key] = (trigger, dry_run)
        while len(self._kills) > KILLS_REMEMBERED:
            self._kills.pop(next(iter(self._kills)))
        if key not in self._declared:
            return False
        word = KillWord(key[0], key[1], trigger, summary[:SUMMARY_MAX], dry_run)
        self._kill_words = (*(w for w in self._kill_words if w.tree_key != key), word)[-KILLS_PUBLISHED:]
        return True

    def kill_words(self) -> tuple[KillWord, ...]:
        """The latest kills of declared engines (safe from any thread), for guard.json."""
        return self._kill_words

    def told_by_launch(self, key: tuple[int, int], parent_pid: int) -> bool:
        """Whether the owner learns of this tree's kill from its launch: a declared root whose parent is the launch
        that declared it (alive when the guard scanned; it prints the guard's word on its own terminal), or a
        container's top process whose launch is alive (it watches the container from outside)."""
        launcher = self._launchers.get(key)
        if launcher is not None and key in self._containers:
            return read_start_ticks(self.proc_root, launcher) is not None
        return launcher is not None and launcher == parent_pid

    # --- the tick
    def poll(self, now: float) -> None:
        """Read what changed; record what happened (on the declarations thread; a bad file is counted by the watch,
        which returns only the declarations the kernel vouches for)."""
        decls = self.watch.poll()
        current = {d.tree_key: d for d in decls}
        check_live = now >= self._next_liveness
        if check_live:
            self._next_liveness = now + LIVENESS_EVERY_S
        for key, decl in current.items():
            seen = self._seen.get(key)
            if seen is None:
                old = decl.launched_at < self.started_at - STARTED_BEFORE_US_S
                seen = _Seen(decl, started=old, ready=old and not decl.booting, exited=False)
                self._seen[key] = seen
            else:
                seen.decl = decl
            if not seen.started:
                seen.started = True
                self._started(decl)
            # Ready is a real answer where launch knows the endpoint: its first one-token completion; else the phase.
            answered = decl.first_token_s is not None or (decl.phase == BootPhase.READY and not decl.probe_url)
            if answered and not seen.ready:
                seen.ready = True
                self._ready(decl)
            if not seen.exited and (decl.exited_at is not None or (check_live and self._gone(seen, now))):
                seen.exited = True
                self._exited(decl)
        for key in list(self._seen):
            if key not in current:
                seen = self._seen.pop(key)
                if not seen.exited and not self._alive(seen.decl):
                    self._exited(seen.decl)  # the file went with its engine (a launcher that cleaned up early)
                elif not seen.exited:
                    self._seen[key] = seen  # the file is gone, the engine is not: keep guarding it
        live = [s for s in self._seen.values() if not s.exited]
        self._live = tuple(s.decl for s in live)
        self._declared = {s.decl.tree_key: (s.decl.kind, s.decl.uid) for s in live}
        self._launchers = {s.decl.tree_key: s.decl.launcher_pid for s in live}
        self._containers = frozenset(s.decl.tree_key for s in live if s.decl.container)
        for key in [k for k, s in self._seen.items() if s.exited and k not in current]:
            del self._seen[key]  # bounded: an exited engine whose file is gone is forgotten

    def _alive(self, decl: Declaration) -> bool:
        return read_start_ticks(self.proc_root, decl.root_pid) == decl.start_ticks

    def _gone(self, seen: _Seen, now: float) -> bool:
        """The root exited and its launcher will not say how: it is gone too, or EXIT_WORD_WAIT_S passed (launch
        declares the exit right after its wait, before it ends what is left of the tree)."""
        if self._alive(seen.decl):
            seen.gone_since = None
            return False
        if seen.gone_since is None:
            seen.gone_since = now
        launcher = read_start_ticks(self.proc_root, seen.decl.launcher_pid) is not None
        return not launcher or now - seen.gone_since >= EXIT_WORD_WAIT_S

    # --- events
    @staticmethod
    def _fields(decl: Declaration) -> dict[str, object]:
        return {
            "engine": decl.kind,
            "root_pid": decl.root_pid,
            "model": decl.model,
            "key": decl.key,
            "budget_bytes": decl.budget_bytes,
            "estimate_bytes": decl.estimate_bytes,
            "launched_at": decl.launched_at,
            "uid": decl.uid,
        }

    def _started(self, decl: Declaration) -> None:
        budget = f", budget {format_size(decl.budget_bytes)}" if decl.budget_bytes else ""
        summary = f"Launched {decl.kind} {decl.model} (root pid {decl.root_pid}{budget})."
        self.record(EventKind.ENGINE_STARTED, summary, self._fields(decl), logging.INFO, f"sparkwatch: {summary}")

    def _ready(self, decl: Declaration) -> None:
        peak = "" if decl.peak_bytes is None else f", peak {format_size(decl.peak_bytes)}"
        ttft = decl.first_token_s
        took = decl.ready_s if decl.ready_s is not None else (ttft or 0.0)
        first = f", first token after {ttft:.1f} s" if ttft is not None else ""
        summary = f"{decl.kind} {decl.model} (root pid {decl.root_pid}) is ready after {took:.0f} s{first}{peak}."
        fields = {
            **self._fields(decl),
            "seconds_to_ready": decl.ready_s,
            "seconds_to_first_token": ttft,
            "peak_bytes": decl.peak_bytes,
            "phases": [{"phase": str(p), "at": at} for p, at in decl.phases],
        }
        self.record(EventKind.ENGINE_READY, summary, fields, logging.INFO, f"sparkwatch: {summary}")

    def _exited(self, decl: Declaration) -> None:
        trigger, dry_run = self._kills.get(decl.tree_key, (None, False))
        if decl.exit_signal is not None:
            how = f"killed by signal {decl.exit_signal}"
        elif decl.exit_code is not None:
            how = f"exit code {decl.exit_code}"
        else:
            how = "exit status unknown (its launcher is gone)"
        by = ""
        if trigger:
            by = f"; {'would have been killed by sparkwatch in a dry run' if dry_run else 'killed by sparkwatch'} "
            by += f"(trigger {trigger})"
        ran = (decl.exited_at or time.time()) - decl.launched_at
        summary = f"{decl.kind} {decl.model} (root pid {decl.root_pid}) exited after {ran:.0f} s: {how}{by}."
        fields = {
            **self._fields(decl),
            "exit_code": decl.exit_code,
            "signal": decl.exit_signal,
            "killed_by": "sparkwatch" if trigger and not dry_run else None,
            "trigger": trigger,
            "dry_run": dry_run,
            "phase": str(decl.phases[-2][0] if decl.phase == BootPhase.EXITED and len(decl.phases) > 1 else decl.phase),
            "peak_bytes": decl.peak_bytes,
            "ran_s": round(ran, 3),
        }
        self.record(EventKind.ENGINE_EXITED, summary, fields, logging.INFO, f"sparkwatch: {summary}")
