"""The supervisor of `sparkwatch launch`: runs the engine as launch's child and lets nothing of it outlive launch.

cli.launch.runner drives it and hands it its hooks (`Hooks`: the declaration at start, each chunk of output for the
boot-phase recogniser, a periodic tick for the footprint and the guard's word, the exit); this module knows nothing
of plans, declarations or guards.

- launch is the engine's parent and a child subreaper (prctl, set by cli.launch.runner before the start): workers
  orphaned by a dying root come back to it, so Ctrl-C leaves no process behind. The command runs in its own process
  group (and, where a systemd user manager answers, in its own scope, `systemd-run --user --scope -p MemoryHigh=…`, one
  margin above the guard's kill limit (core.kill.budget.memory_high_bytes): host-side growth past it is throttled by the
  kernel if the guard is not there to kill first; CUDA allocations are not seen by the cgroup on a GB10, which the
  guard's budget covers).
- stdout and stderr come through pipes and are copied unchanged, chunk by chunk (os.read/os.write, no line
  splitting); each chunk then goes to `Hooks.output`. sparkwatch's own lines (`note`) start only at the start of a
  line, never inside the engine's.
- Ctrl-C (SIGINT) is forwarded to the whole tree; a second one sends SIGTERM, a third SIGKILL. SIGTERM and SIGHUP
  are forwarded as they are. When the root is gone, what is left of the tree gets SIGTERM, then SIGKILL after
  LEFTOVER_GRACE_S, and is reaped; what it wrote meanwhile is copied for up to DRAIN_S.
- The tree is read from /proc by common.sources.procs (children lists): no parser of its own here.
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
from types import FrameType
from typing import Protocol

from sparkwatch.common import syscalls
from sparkwatch.common.sources.procs import read_children, read_descendants
from sparkwatch.core.kill.budget import memory_high_bytes

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
SCOPE_PREFIX = (
    "sparkwatch-launch-"  # the scope: sparkwatch-launch-<launcher pid>.scope (core.engines.identity.LAUNCH_SCOPE_RE)
)


class Hooks(Protocol):
    """What launch does around the run, called on the supervisor's (the main) thread."""

    def started(self, pid: int) -> None:
        """The command runs as `pid` (its process group too)."""

    def output(self, data: bytes, stream: int) -> None:
        """A chunk the command wrote on `stream` (0 stdout, 1 stderr), already copied through."""

    def tick(self, pid: int) -> float:
        """Due while the root runs; returns the seconds until the next tick."""
        ...

    def exited(self, status: int | None) -> None:
        """The root was reaped (its wait status), before what is left of the tree is ended."""


def user_manager_socket(env: dict[str, str]) -> bool:
    base = env.get("XDG_RUNTIME_DIR")
    return bool(base) and os.path.exists(os.path.join(str(base), "systemd", "private"))


class Supervisor:
    def __init__(
        self, cmd: list[str], env: dict[str, str], proc_root: str, *, quiet: bool = False, use_scope: bool = True
    ) -> None:
        self.cmd = cmd
        self.env = env
        self.proc_root = proc_root
        self.quiet = quiet
        self.use_scope = use_scope
        self.unit = f"{SCOPE_PREFIX}{os.getpid()}"
        self._signals: list[int] = []
        self.sent: list[int] = []  # the signals launch sent the tree (a SIGKILL not among them came from elsewhere)
        self._stderr_at_line_start = True
        self.stdout_fd = 1  # where the command's stdout is copied (2: a detached container's, cli.launch.incontainer)

    # --- output
    def note(self, text: str) -> None:
        """A sparkwatch line on stderr, only at the start of a line (never inside the engine's own)."""
        if self.quiet:
            return
        prefix = "" if self._stderr_at_line_start else "\n"
        os.write(2, f"{prefix}sparkwatch: {text}\n".encode())
        self._stderr_at_line_start = True

    def _copy(self, fd_in: int, fd_out: int, stream: int, hooks: Hooks) -> bool:
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
        hooks.output(data, stream)
        return True

    # --- signals
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _forward(self, pid: int) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            interrupts = sum(1 for s in self.sent if s in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL))
            send: int = signum
            if signum == signal.SIGINT:
                send = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)[min(interrupts, 2)]
            self.sent.append(send)
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
        for pid in read_descendants(self.proc_root, [root, *(read_children(self.proc_root, os.getpid()) or [])]):
            if pid in (os.getpid(), root) and sig != signal.SIGKILL and pid != root:
                continue
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    # --- the run
    def argv(self, budget: int | None) -> list[str]:
        if not self.use_scope or shutil.which("systemd-run") is None or not user_manager_socket(self.env):
            return list(self.cmd)
        props = ["-p", f"MemoryHigh={memory_high_bytes(budget)}"] if budget else []
        return [
            "systemd-run", "--user", "--scope", "--quiet", "--collect", f"--unit={self.unit}", *props, "--", *self.cmd,
        ]  # fmt: skip

    @property
    def scoped(self) -> bool:
        """Whether the command runs in its own scope (systemd-run moves it there once started)."""
        return self.use_scope and len(self.argv(None)) != len(self.cmd)

    def run(self, argv: list[str], env: dict[str, str], hooks: Hooks) -> tuple[int, int | None]:
        """Run `argv` to its end: (its pid, its wait status). Raises OSError when it did not start."""
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        stdin = subprocess.DEVNULL if sys.stdin is None or sys.stdin.isatty() else None
        try:
            proc = subprocess.Popen(
                argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, process_group=0
            )
        except OSError:
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)
            raise
        try:
            return proc.pid, self._supervise(proc, wake_r, hooks)
        finally:
            proc.returncode = proc.returncode if proc.returncode is not None else 0
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)

    def _supervise(self, proc: subprocess.Popen[bytes], wake_r: int, hooks: Hooks) -> int | None:
        pid = proc.pid
        assert proc.stdout is not None and proc.stderr is not None
        hooks.started(pid)
        pidfd = syscalls.pidfd_open(pid)
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        for fd in (out_fd, err_fd):
            os.set_blocking(fd, False)
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # above /proc/sys/fs/pipe-max-size: the default 64 KiB still works, with more wake-ups
        poller = select.poll()
        streams = {out_fd: (self.stdout_fd, 0), err_fd: (2, 1)}
        for fd in streams:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        poller.register(pidfd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        status: int | None = None
        open_streams = set(streams)
        next_tick = time.monotonic()
        try:
            busy = False
            while status is None:
                if busy:
                    time.sleep(COALESCE_S)
                timeout = max(next_tick - time.monotonic(), 0.0)
                busy = False
                for fd, _ev in poller.poll(timeout * 1000):
                    if fd in streams:
                        busy = True
                        out, stream = streams[fd]
                        if not self._copy(fd, out, stream, hooks):
                            poller.unregister(fd)
                            open_streams.discard(fd)
                    elif fd == wake_r:
                        try:
                            os.read(wake_r, 512)
                        except BlockingIOError:
                            pass
                self._forward(pid)
                status = self._reap(pid)
                if time.monotonic() >= next_tick and status is None:
                    now = time.monotonic()
                    next_tick = now + hooks.tick(pid)
        finally:
            poller.unregister(pidfd)
            poller.unregister(wake_r)
            os.close(pidfd)
        hooks.exited(status)  # at once: the guard's engine_exited carries the exit code
        self._end_leftovers(pid)
        self._drain(streams, open_streams, poller, hooks)
        return status

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
            for p in read_descendants(self.proc_root, left):
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

    def _drain(
        self, streams: dict[int, tuple[int, int]], open_fds: set[int], poller: select.poll, hooks: Hooks
    ) -> None:
        """What the tree wrote before it ended, up to EOF (its last writers are gone) or DRAIN_S."""
        deadline = time.monotonic() + DRAIN_S
        while open_fds and time.monotonic() < deadline:
            for fd, _ev in poller.poll(100):
                if fd in open_fds and not self._copy(fd, streams[fd][0], streams[fd][1], hooks):
                    open_fds.discard(fd)
                    poller.unregister(fd)


def _pgrp_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
