"""Running the engine for `sparkwatch launch`: its parent, its pass-through, its boot phases, its end.

- launch is the engine's parent and a child subreaper (prctl): workers orphaned by a dying root come back to it, so
  Ctrl-C leaves no process behind. The command runs in its own process group (and, where a systemd user manager
  answers, in its own scope, `systemd-run --user --scope -p MemoryHigh=…`, one margin above the guard's kill limit
  (core.budget.memory_high_bytes): host-side growth past it is throttled by the kernel if the guard is not there to
  kill first; CUDA allocations are not seen by the cgroup on a GB10, which the guard's budget covers).
- stdout and stderr come through pipes and are copied unchanged, chunk by chunk (os.read/os.write, no line
  splitting); the phase recogniser (core.bootphase) searches each chunk for the anchors that can still come.
- the declaration (common.launched) is written at start, on every phase, when the measured peak grew, and at exit.
- the measured peak is what the tree itself holds (core.footprint): its RSS (the root's descendants and whatever was
  reparented to launch: a worker that double-forked with setsid), its scope's memory.current, and NVML's per-process
  bytes where NVML loads (checked in a throwaway child first, as `status` does). The pool's drop is never a peak:
  everything else on the box is in it.
- one line says where it went; then, from the guard's published state (common.guardstate), whether a guard took it
  (within GUARD_WORD_WAIT_S), or at once and only once that no guard is running (with a budget: that it is not
  enforced).
- Ctrl-C (SIGINT) is forwarded to the whole tree; a second one sends SIGTERM, a third SIGKILL. SIGTERM and SIGHUP
  are forwarded as they are. When the root is gone, what is left of the tree gets SIGTERM, then SIGKILL after
  LEFTOVER_GRACE_S, and is reaped.
- the exit code passes through (128+N for signal N). A SIGKILL that launch did not send is looked up in the guard's
  events.jsonl: a `kill` event naming the root is printed in one line, and launch exits 137.
"""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from sparkwatch.cli.anchorsearch import any_anchor
from sparkwatch.cli.launch_plan import PlanContext
from sparkwatch.common import guardstate, launched, peakstore, syscalls
from sparkwatch.common.events import read_events
from sparkwatch.common.launched import Declaration
from sparkwatch.common.sources.cgroupmem import read_memory_current
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.common.sources.procs import parse_cgroup, parse_stat, read_children, read_start_ticks
from sparkwatch.config.settings import Settings
from sparkwatch.core import launchenv, peaks
from sparkwatch.core.bootphase import BootPhase, PhaseRecognizer
from sparkwatch.core.budget import memory_high_bytes
from sparkwatch.core.footprint import FootprintInputs, footprint
from sparkwatch.core.guardstate import no_guard_line, not_taken_line, taken_line
from sparkwatch.core.plan import Plan
from sparkwatch.core.units import MiB, format_size

SAMPLE_EVERY_S = 1.0  # footprint samples while the engine runs (a /proc walk of the tree and, with NVML, one read)
CHUNK_BYTES = 1 << 20
# Under a stream of output, wake at most this often: each wake-up costs a poll, a read and a write whatever its size,
# and 8 KiB writes at 10 MB/s were 1,200 wake-ups a second (2.2 % of a core on this VM); 50 wake-ups (20 ms) still
# cost 1.0 % at 10 MB/s, 20 (50 ms) 0.7 % (bench/RESULTS-passthrough.md). The pipes are made PIPE_BYTES large so the
# engine never blocks on them meanwhile (10 MB/s fills 500 KB in 50 ms). Idle streams are read the moment they have
# data.
COALESCE_S = 0.05
PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = 1031
LEFTOVER_GRACE_S = 5.0
DRAIN_S = 2.0
# How long launch looks for a guard to take its declaration: the guard reads the declarations each tick (at most
# poll_max_s, 1 s, apart) and republishes guard.json at once when it took a new one.
GUARD_WORD_WAIT_S = 5.0
KILL_EVENT_WAIT_S = 6.0  # the guard writes its kill event after the reap and its settle time (1 s by default)
PEAK_WRITE_MIN_BYTES = 256 * MiB  # rewrite the declaration when the peak grew by this much (or 5 %)
SYSTEM_EVENTS = Path("/var/lib/sparkwatch/events.jsonl")  # the system unit's (XDG_STATE_HOME=/var/lib)
SCOPE_PREFIX = "sparkwatch-launch-"  # the scope: sparkwatch-launch-<launcher pid>.scope (core.engines.LAUNCH_SCOPE_RE)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def user_manager_socket(env: dict[str, str]) -> bool:
    base = env.get("XDG_RUNTIME_DIR")
    return bool(base) and os.path.exists(os.path.join(str(base), "systemd", "private"))


def tree_pids(proc_root: str, root: int, extra: list[int]) -> list[int]:
    """The root and every descendant (and what was reparented to us), from the kernel's children lists."""
    out: list[int] = []
    seen: set[int] = set()
    frontier = [root, *extra]
    while frontier:
        pid = frontier.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        frontier.extend(read_children(proc_root, pid) or [])
    return out


def rss_of(proc_root: str, pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"{proc_root}/{pid}/stat", "rb") as fh:
                total += parse_stat(pid, fh.read())[5] * _PAGE
        except (OSError, ValueError):
            continue
    return total


def gpu_reader(settings: Settings) -> Any | None:
    """NVML's per-process bytes for the footprint, or None where it would hang (nvml_preflight) or fails to build."""
    from sparkwatch.telemetry.sources.nvml import NvmlSource
    from sparkwatch.telemetry.sources.nvml_preflight import nvml_hang_reason

    if nvml_hang_reason() is not None:
        return None
    return NvmlSource(proc_root=settings.proc_root)


def gpu_bytes_of(source: Any | None, pids: list[int]) -> int | None:
    """The GPU bytes NVML lists for `pids`, summed; None when NVML is not up (no reading: the footprint then has no
    GPU part, core.footprint)."""
    from sparkwatch.core.model import GpuReport

    if source is None:
        return None
    report = source.collect()
    if not isinstance(report, GpuReport) or not report.up:
        return None
    wanted = set(pids)
    return sum(p.used_gpu_memory_bytes or 0 for p in report.processes if p.pid in wanted)


def read_cgroup(proc_root: str, pid: int) -> str | None:
    try:
        with open(f"{proc_root}/{pid}/cgroup", "rb") as fh:
            return parse_cgroup(fh.read())
    except OSError:
        return None


def find_kill_event(paths: list[Path], root_pid: int, since_wall: float) -> dict[str, Any] | None:
    """The guard's kill event whose victims include `root_pid`, recorded after `since_wall`."""
    from datetime import datetime

    for path in paths:
        try:
            events = read_events(path, 64)
        except OSError:
            continue
        for event in reversed(events):
            if event.get("kind") != "kill" or event.get("dry_run"):
                continue
            try:
                ts = datetime.fromisoformat(str(event.get("ts", "")).replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
            if ts < since_wall - 1:
                continue
            victims = event.get("victims") or []
            if any(isinstance(v, dict) and v.get("pid") == root_pid for v in victims):
                found: dict[str, Any] = event
                return found
    return None


class Launch:
    def __init__(
        self,
        settings: Settings,
        plan: Plan,
        ctx: PlanContext,
        cmd: list[str],
        *,
        quiet: bool = False,
        use_scope: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.ctx = ctx
        self.cmd = cmd
        self.quiet = quiet
        self.use_scope = use_scope
        self.env = dict(os.environ if env is None else env)
        self.proc_root = str(settings.proc_root)
        self.exit_text = ""
        self._signals: list[int] = []
        self._sent: list[int] = []
        self._stderr_at_line_start = True
        self.recognizer = PhaseRecognizer(str(plan.estimate.kind), any_of=any_anchor)
        self.phase_peaks: dict[str, int] = {}
        self.decl: Declaration | None = None
        self.directory = launched.launched_dir(self.env, settings.state_dir)
        self.killed_by: dict[str, Any] | None = None
        self.unit = f"{SCOPE_PREFIX}{os.getpid()}"
        self.gpu: Any | None = None
        self._guard_wait_until: float | None = None  # monotonic; None: nothing (more) to say about the guard

    # --- output
    def note(self, text: str) -> None:
        """A sparkwatch line on stderr, only at the start of a line (never inside the engine's own)."""
        if self.quiet:
            return
        prefix = "" if self._stderr_at_line_start else "\n"
        os.write(2, f"{prefix}sparkwatch: {text}\n".encode())
        self._stderr_at_line_start = True

    def _copy(self, fd_in: int, fd_out: int, stream: int) -> bool:
        try:
            data = os.read(fd_in, CHUNK_BYTES)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd_out, view) :]
            except BlockingIOError:
                select.select([], [fd_out], [], 1.0)
            except BrokenPipeError:
                break
        if fd_out == 2:
            self._stderr_at_line_start = data.endswith(b"\n")
        for phase in self.recognizer.feed(data, stream):
            self._enter(phase)
        return True

    # --- declaration
    def _write_decl(self) -> None:
        if self.decl is None:
            return
        try:
            launched.write(self.directory, self.decl)
        except OSError as exc:
            self.note(f"could not write the declaration in {self.directory}: {exc.strerror or exc}")

    def _enter(self, phase: BootPhase) -> None:
        if self.decl is None:
            return
        now = time.time()
        self.decl = self.decl.entered(phase, now)
        self._write_decl()
        if phase == BootPhase.READY:
            self.note(f"{self.decl.kind} is ready after {self.decl.ready_s or 0:.0f} s (phase ready)")
        else:
            self.note(f"phase {phase} after {now - self.decl.launched_at:.0f} s")

    # --- the guard's word (common.guardstate): where the declaration went, and whether a guard took it
    def _declared_to_guard(self) -> None:
        """One line saying where the declaration went; at once when no guard runs, else once one took it (or
        GUARD_WORD_WAIT_S passed), from `_guard_word`."""
        if self.decl is None:
            return
        path = self.directory / self.decl.file_name
        if not path.exists():
            return  # _write_decl said why
        self.note(f"declared in {path}")
        seen = guardstate.read_guards(guardstate.reader_paths(self.env, self.settings.state_dir))
        if not seen.running:
            self.note(no_guard_line(self.plan.budget_bytes))
            return
        self._guard_wait_until = time.monotonic() + GUARD_WORD_WAIT_S
        self._guard_word()

    def _guard_word(self) -> None:
        if self._guard_wait_until is None or self.decl is None:
            return
        seen = guardstate.read_guards(guardstate.reader_paths(self.env, self.settings.state_dir))
        state = seen.taken_by(self.decl.tree_key)
        if state is not None:
            self.note(taken_line(state, self.plan.budget_bytes))
        elif not seen.running:
            self.note(no_guard_line(self.plan.budget_bytes))  # it stopped meanwhile
        elif time.monotonic() >= self._guard_wait_until:
            self.note(not_taken_line(seen.states, self.plan.budget_bytes, GUARD_WORD_WAIT_S))
        else:
            return
        self._guard_wait_until = None

    # --- signals
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _forward(self, pid: int) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            interrupts = sum(1 for s in self._sent if s in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL))
            send: int = signum
            if signum == signal.SIGINT:
                send = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)[min(interrupts, 2)]
            self._sent.append(send)
            if send == signal.SIGKILL:
                self._kill_all(pid, signal.SIGKILL)
            else:
                try:
                    os.killpg(pid, send)
                except OSError:
                    pass
            self.note(f"sent {signal.Signals(send).name} to the engine's process group {pid}")

    def _kill_all(self, root: int, sig: int) -> None:
        try:
            os.killpg(root, sig)
        except OSError:
            pass
        for pid in tree_pids(self.proc_root, root, read_children(self.proc_root, os.getpid()) or []):
            if pid in (os.getpid(), root) and sig != signal.SIGKILL and pid != root:
                continue
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    # --- the run
    def _argv(self, budget: int | None) -> list[str]:
        if not self.use_scope or shutil.which("systemd-run") is None or not user_manager_socket(self.env):
            return list(self.cmd)
        props = ["-p", f"MemoryHigh={memory_high_bytes(budget)}"] if budget else []
        return [
            "systemd-run", "--user", "--scope", "--quiet", "--collect", f"--unit={self.unit}", *props, "--", *self.cmd,
        ]  # fmt: skip

    def run(self) -> int:
        plan = self.plan
        choices = launchenv.engine_env(self.env, plan.estimate.jobs)
        if not self.quiet:
            print(launchenv.describe(choices), file=sys.stderr, flush=True)
        env = launchenv.apply(self.env, choices)
        self.gpu = gpu_reader(self.settings)  # before the subreaper: its check is a child of ours, reaped by it
        syscalls.set_child_subreaper()
        try:  # the pool-drop baseline the guard's budget warning reads (never a kill's nor a peak's)
            with MeminfoReader(self.settings.proc_root) as reader:
                baseline = reader.read().available_bytes
        except (OSError, MeminfoError):
            baseline = plan.view.available_bytes
        try:
            launched.prune(self.directory, time.time())
        except OSError:
            pass
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        stdin = subprocess.DEVNULL if sys.stdin is None or sys.stdin.isatty() else None
        argv = self._argv(plan.budget_bytes)
        try:
            proc = subprocess.Popen(
                argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, process_group=0
            )
        except OSError as exc:
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            print(f"sparkwatch: {self.cmd[0]}: {exc.strerror or exc}", file=sys.stderr)
            self.exit_text = "did not start"
            return 127 if isinstance(exc, FileNotFoundError) else 126
        try:
            return self._supervise(proc, baseline, wake_r)
        finally:
            proc.returncode = proc.returncode if proc.returncode is not None else 0
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)
            close = getattr(self.gpu, "close", None)
            if close is not None:
                close()

    def _supervise(self, proc: subprocess.Popen[bytes], baseline: int, wake_r: int) -> int:
        pid = proc.pid
        assert proc.stdout is not None and proc.stderr is not None
        started_wall = time.time()
        ticks = read_start_ticks(self.proc_root, pid) or 0
        # The scope's cgroup, once systemd-run has moved the command into it (read again at each sample until then:
        # before the move the child is still in our own cgroup, whose memory.current is not the engine's).
        scoped = self.use_scope and len(self._argv(None)) != len(self.cmd)
        cgroup = None
        est = self.plan.estimate
        self.decl = Declaration(
            root_pid=pid,
            start_ticks=ticks,
            uid=os.geteuid(),
            kind=str(est.kind),
            model=est.model or "",
            key=self.ctx.key,
            budget_bytes=self.plan.budget_bytes,
            launched_at=started_wall,
            launcher_pid=os.getpid(),
            available_at_launch_bytes=baseline,
            estimate_bytes=est.needs_bytes,
            cgroup=cgroup,
        ).entered(BootPhase.STARTING, started_wall)
        self._write_decl()
        self.note(
            f"started {est.kind} as pid {pid}"
            + (f", budget {format_size(self.plan.budget_bytes)}" if self.plan.budget_bytes else "")
        )
        self._declared_to_guard()
        pidfd = syscalls.pidfd_open(pid)
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        for fd in (out_fd, err_fd):
            os.set_blocking(fd, False)
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # above /proc/sys/fs/pipe-max-size: the default 64 KiB still works, with more wake-ups
        poller = select.poll()
        streams = {out_fd: (1, 0), err_fd: (2, 1)}
        for fd in streams:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        poller.register(pidfd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        status: int | None = None
        open_streams = set(streams)
        next_sample = time.monotonic()
        peak = 0
        written_peak = 0
        try:
            busy = False
            while status is None:
                if busy:
                    time.sleep(COALESCE_S)
                timeout = max(next_sample - time.monotonic(), 0.0)
                busy = False
                for fd, _ev in poller.poll(timeout * 1000):
                    if fd in streams:
                        busy = True
                        out, stream = streams[fd]
                        if not self._copy(fd, out, stream):
                            poller.unregister(fd)
                            open_streams.discard(fd)
                    elif fd == wake_r:
                        try:
                            os.read(wake_r, 512)
                        except BlockingIOError:
                            pass
                self._forward(pid)
                status = self._reap(pid)
                if time.monotonic() >= next_sample and status is None:
                    next_sample = time.monotonic() + min(SAMPLE_EVERY_S, self._guard_poll_s())
                    self._guard_word()
                    if scoped and cgroup is None:
                        cgroup = self._scope_cgroup(pid)
                    fp = self._sample(pid, cgroup)
                    phase = str(self.recognizer.phase)
                    self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), fp)
                    if fp > peak:
                        peak = fp
                        if self.decl is not None and peak - written_peak >= max(
                            PEAK_WRITE_MIN_BYTES, written_peak // 20
                        ):
                            self.decl = _with_peak(self.decl, peak)
                            written_peak = peak
                            self._write_decl()
        finally:
            poller.unregister(pidfd)
            poller.unregister(wake_r)
            os.close(pidfd)
        self._declare_exit(status, peak)  # at once: the guard's engine_exited carries the exit code
        self._end_leftovers(pid)
        self._drain(streams, open_streams, poller)
        return self._finish(pid, status, peak, started_wall)

    def _guard_poll_s(self) -> float:
        """While waiting for a guard's word, look four times a second: the line comes when the guard took it."""
        return SAMPLE_EVERY_S if self._guard_wait_until is None else 0.25

    def _declare_exit(self, status: int | None, peak: int) -> None:
        sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None
        self.recognizer.exited()
        if self.decl is None:
            return
        now = time.time()
        decl = _with_peak(self.decl, max(peak, self.decl.peak_bytes or 0)).entered(BootPhase.EXITED, now)
        self.decl = replace(decl, exit_code=code, exit_signal=sig, exited_at=now)
        self._write_decl()

    def _scope_cgroup(self, pid: int) -> str | None:
        """The root's cgroup when it is our own scope (`…/sparkwatch-launch-<pid>.scope`), declared for the guard."""
        path = read_cgroup(self.proc_root, pid)
        if path is None or not path.endswith(f"/{self.unit}.scope"):
            return None
        if self.decl is not None:
            self.decl = replace(self.decl, cgroup=path)
            self._write_decl()
        return path

    def _sample(self, pid: int, cgroup: str | None) -> int:
        """What the tree holds now (core.footprint, without the pool's drop): the root's descendants and what was
        reparented to launch (the subreaper), their RSS or the scope's memory.current, and NVML's bytes for them."""
        orphans = [p for p in read_children(self.proc_root, os.getpid()) or [] if p != pid]
        pids = tree_pids(self.proc_root, pid, orphans)
        gpu = gpu_bytes_of(self.gpu, pids)
        return footprint(
            FootprintInputs(
                rss_bytes=rss_of(self.proc_root, pids),
                gpu_bytes=gpu,
                gpu_age_s=None if gpu is None else 0.0,
                cgroup_bytes=read_memory_current(cgroup),
            )
        ).bytes

    def _reap(self, pid: int) -> int | None:
        """Reap every child that exited (orphans reparented to us too); the root's wait status, once it exited."""
        status = None
        while True:
            try:
                got, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return status
            if got == 0:
                return status
            if got == pid:
                status = st

    def _end_leftovers(self, root: int) -> None:
        """What is left of the tree once the root is gone: SIGTERM, then SIGKILL after the grace time, reaped."""
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        sig = signal.SIGTERM
        while True:
            left = [p for p in read_children(self.proc_root, os.getpid()) or [] if p != root]
            pgrp_alive = _pgrp_alive(root)
            if not left and not pgrp_alive:
                return
            for p in tree_pids(self.proc_root, left[0], left[1:]) if left else []:
                try:
                    os.kill(p, sig)
                except OSError:
                    pass
            try:
                os.killpg(root, sig)
            except OSError:
                pass
            time.sleep(0.1)
            self._reap(root)
            if time.monotonic() >= deadline:
                sig = signal.SIGKILL
            if time.monotonic() >= deadline + LEFTOVER_GRACE_S:
                return

    def _drain(self, streams: dict[int, tuple[int, int]], open_fds: set[int], poller: select.poll) -> None:
        """What the tree wrote before it ended, up to EOF (its last writers are gone) or DRAIN_S."""
        deadline = time.monotonic() + DRAIN_S
        while open_fds and time.monotonic() < deadline:
            for fd, _ev in poller.poll(100):
                if fd in open_fds and not self._copy(fd, streams[fd][0], streams[fd][1]):
                    open_fds.discard(fd)
                    poller.unregister(fd)

    def _finish(self, pid: int, status: int | None, peak: int, started_wall: float) -> int:
        code, sig = 0, None
        if status is not None:
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                code = 128 + sig
            else:
                code = os.WEXITSTATUS(status)
        self.exit_text = f"exit code {code}" if sig is None else f"killed by {signal.Signals(sig).name}"
        if self.decl is not None and self.decl.ready_s is not None and peak > 0:
            self._learn(peak)
        if sig == signal.SIGKILL and signal.SIGKILL not in self._sent:
            paths = [self.settings.state_dir / "events.jsonl", SYSTEM_EVENTS]
            deadline = time.monotonic() + KILL_EVENT_WAIT_S
            event = None
            while event is None and time.monotonic() < deadline:
                event = find_kill_event(paths, pid, started_wall)
                if event is None:
                    time.sleep(0.2)
            self.killed_by = event
            if event is not None:
                print(
                    f"sparkwatch: the guard killed {self.plan.estimate.kind} (pid {pid}), trigger "
                    f"{event.get('trigger')}: {event.get('summary')}",
                    file=sys.stderr,
                )
                self.exit_text = f"killed by the sparkwatch guard ({event.get('trigger')})"
            else:
                print(
                    f"sparkwatch: {self.plan.estimate.kind} (pid {pid}) was killed with SIGKILL; no sparkwatch kill "
                    "event names it (the kernel's OOM killer or another program?)",
                    file=sys.stderr,
                )
            return 128 + signal.SIGKILL
        return code

    def _learn(self, peak: int) -> None:
        assert self.decl is not None
        try:
            records = peakstore.load(self.settings.state_dir)
            records[self.ctx.key] = peaks.fold(
                records.get(self.ctx.key),
                peak,
                phases=self.phase_peaks,
                ready_s=self.decl.ready_s,
                estimate_bytes=self.plan.estimate.needs_bytes,
                at=time.time(),
            )
            peakstore.save(self.settings.state_dir, records)
        except OSError as exc:
            self.note(f"could not record the measured peak: {exc.strerror or exc}")


def _with_peak(decl: Declaration, peak: int) -> Declaration:
    return replace(decl, peak_bytes=peak)


def _pgrp_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
