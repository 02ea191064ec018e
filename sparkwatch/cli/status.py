"""`sparkwatch status [--once]`: the live terminal view.

It runs the daemon's own snapshot code (`Telemetry(settings).collect()`) in this process, so it needs no daemon, and
like the telemetry it only reads: /proc, the JIT caches, NVML, the events file, launch's declarations (their boot
phases), the running guard's published state (common.guardfile: a few stats and one small read a frame) and, with
`peers`, each peer's document (cli.peerread, on a thread of its own). It never signals and never writes.

Light over a slow SSH link: one redraw a second (rich Live with auto-refresh off, updated once per cycle, in the
normal screen, not the alternate one), a frame of about 25 lines; on a pipe, frames are printed one after another.
"""

from __future__ import annotations

import argparse
import math
import os
import select
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkwatch.cli import argtypes
from sparkwatch.core.report.trend import build_rate, pool_trend

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings
    from sparkwatch.core.model import DriverReport, EngineTree, GpuReport
    from sparkwatch.core.report.gates import GatedView
    from sparkwatch.tui.status_view import StatusFrame

# History kept for the rates: 5 s of MemAvailable (the span a Spark's ~100 MiB noise was measured over); 60 s of
# objects done, because an nvcc job takes tens of seconds and objects finish in steps.
POOL_WINDOW_S = 5.0
BUILD_WINDOW_S = 60.0
ONCE_PROBE_S = 3.0  # `status --once` waits this long at most for each engine's first serving probe
ONCE_PEERS_S = 2.0  # `status --once` waits this long at most for the peers' read (each within a second, all at once)
# The driver verdict reads dpkg's status file (hundreds of KiB): once a minute is plenty, as in the daemon.
DRIVER_CHECK_S = 60.0
# How far back in the events file to look for the last kill.
KILL_LOOKBACK_EVENTS = 500


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "status",
        parents=[parent],
        help="live terminal view: pool, guard, engines, compilers, JIT, GPU",
        description="A live terminal view, redrawn once a second: the memory pool against the floor, the guard "
        "(running, armed or dry run), the engines and their boot phases, compilers and MAX_JOBS, JIT build progress "
        "with an ETA, the GPU, the driver and the last kill. Needs no daemon; q or Ctrl-C quits. On a pipe it prints "
        "plain frames.",
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit (for scripts and bug reports)")
    p.add_argument(
        "--interval",
        type=argtypes.seconds(0.1, 60),
        default=1.0,
        metavar="S",
        help="seconds between frames (default 1)",
    )
    p.add_argument("--state-dir", metavar="DIR", help="where events.jsonl lives (for the last kill)")
    p.set_defaults(handler=handle)


class PreflightedGpu:
    """The GPU source, NVML behind its preflight. A hung libnvidia-ml load would freeze this whole process (it holds
    the GIL), so a throwaway child loads it first (telemetry.sources.nvml_preflight); that child starts here and is
    waited for on the first GPU read, the last of a cycle: its time on the 2-core VM runs beside this process's
    imports and /proc scan instead of before them (bench/RESULTS-startup.md)."""

    def __init__(self, proc_root: Path) -> None:
        from sparkwatch.telemetry.sources.nvml_preflight import Preflight

        self.proc_root = proc_root
        self._preflight = Preflight.start()
        self._source: Any = None

    def collect(self) -> GpuReport:
        if self._source is None:
            from sparkwatch.telemetry.sources.nvml import NvmlSource
            from sparkwatch.telemetry.sources.nvml_preflight import NvmlOff

            reason = self._preflight.reason()
            self._source = NvmlSource(proc_root=self.proc_root) if reason is None else NvmlOff(reason)
        report: GpuReport = self._source.collect()
        return report

    def close(self) -> None:
        if self._source is None:
            self._preflight.abandon()  # no GPU read came: its child is still ours to reap
        close = getattr(self._source, "close", None)
        if close is not None:
            close()


class StatusApp:
    """Collects a snapshot a cycle and keeps the short histories the rates need. Reads only."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        gpu = PreflightedGpu(settings.proc_root)  # first: its child runs while the imports below do
        from sparkwatch.telemetry.loop import Telemetry

        self.settings = settings
        self.clock = clock
        # The daemon hands Telemetry its drift watcher's latest report; here a once-a-minute check stands in for it.
        self.telemetry = Telemetry(settings, gpu_source=gpu, driver=self._driver_report)
        self.host = socket.gethostname()
        self.available: deque[tuple[float, float]] = deque()
        self.objects_done: dict[str, deque[tuple[float, float]]] = {}
        self._events_key: tuple[int, int] | None = None
        self._last_kill: Mapping[str, Any] | None = None
        self._gated: tuple[GatedView, ...] = ()
        self._driver: DriverReport | None = None
        self._driver_error: str | None = None
        self._driver_checked = -math.inf
        self._started_ts: float | None = None
        self._containers: Any = None  # telemetry.sources.dockerapi.ContainerLookup, built at the first container
        self._peers_note: tuple[str, ...] = ()  # the one line on the peers (issue 37), under the guard's
        if settings.peers:
            from sparkwatch.common.peerproof import settings_line

            line, _display_only = settings_line(settings)
            self._peers_note = (line,) if line else ()
        self._peers: Any = None  # cli.peerread.PeerBoard: the peers read on a thread of their own (PEERS)
        if settings.peers:
            from sparkwatch.cli.peerread import PeerBoard

            self._peers = PeerBoard(settings, max(settings.peer_poll_s, 1.0))

    def frame(self, live: bool = False, peers_wait_s: float = 0.0) -> StatusFrame:
        from sparkwatch.tui.status_view import BuildView, StatusFrame  # rich: only when there is a frame to draw

        snap = self.telemetry.collect()
        self.telemetry.drain_events()  # the daemon records these; a viewer drops them
        now = self.clock()
        if self._started_ts is None:
            self._started_ts = snap.ts
        if snap.mem is not None:
            self.available.append((now, float(snap.mem.available_bytes)))
        while self.available and now - self.available[0][0] > POOL_WINDOW_S:
            self.available.popleft()
        builds = []
        seen = set()
        for cache in snap.jit:
            hist = self.objects_done.setdefault(cache.path, deque())
            hist.append((now, float(cache.objects_done)))
            while hist and now - hist[0][0] > BUILD_WINDOW_S:
                hist.popleft()
            seen.add(cache.path)
            builds.append(BuildView(cache, build_rate(list(hist), cache.objects_total)))
        for path in set(self.objects_done) - seen:
            del self.objects_done[path]
        from sparkwatch.common.guardfile import read_guards, reader_paths

        guards = read_guards(reader_paths(os.environ, self.settings.state_dir))
        containers, containers_note = self._container_lines(snap.engines)
        return StatusFrame(
            containers=containers,
            containers_note=containers_note,
            guards=guards.states,
            guard_notes=guards.notes + self._peers_note,
            snapshot=snap,
            host=self.host,
            floor_bytes=self.settings.floor,
            warn_headroom_bytes=self.settings.warn_headroom,
            compile_jobs_alert=self.settings.compile_jobs_alert,
            trend=pool_trend(list(self.available), self.settings.floor),
            builds=tuple(builds),
            last_kill=self._read_last_kill(),
            gated=self._gated,
            events_path=str(self.settings.events_path),
            driver_error=self._driver_error,
            live=live,
            started_ts=self._started_ts,
            peers=None if self._peers is None else self._peers.views(peers_wait_s),
        )

    def _container_lines(self, trees: Sequence[EngineTree]) -> tuple[dict[int, str], str | None]:
        """Root pid -> the line naming its container, read through the Docker API here (kept 10 s; no daemon
        needed), and why the containers are named by id only when the socket could not be read (said once)."""
        refs = {t.root.pid: ref for t in trees if (ref := t.container) is not None}
        if not refs:
            return {}, None
        from sparkwatch.core.container import container_line

        if self._containers is None:
            from sparkwatch.telemetry.sources.dockerapi import ContainerLookup

            self._containers = ContainerLookup(self.settings.docker_host)
        facts = self._containers.lookup(ref.id for ref in refs.values())
        lines = {pid: container_line(ref, facts.get(ref.id)) for pid, ref in refs.items()}
        return lines, self._containers.note

    def _read_last_kill(self) -> Mapping[str, Any] | None:
        from sparkwatch.common.eventlog import read_events

        path = self.settings.events_path
        try:
            st = os.stat(path)
        except OSError:
            self._events_key, self._last_kill, self._gated = None, None, ()
            return None
        key = (st.st_mtime_ns, st.st_size)
        if key != self._events_key:  # re-read only when the file changed
            from sparkwatch.core.report.gates import gated_now

            self._events_key = key
            events = read_events(path, KILL_LOOKBACK_EVENTS)
            # A dry run's would_kill shows too (the view marks it "[dry run]"): it is the decision a kill would be.
            kills = [e for e in events if e.get("kind") in ("kill", "would_kill")]
            self._last_kill = kills[-1] if kills else None
            # Containers the after-kill gate paused and has not released (telemetry.afterkill records both).
            self._gated = gated_now(events)
        return self._last_kill

    def _driver_report(self) -> DriverReport | None:
        """Called by Telemetry.collect(): never raises, re-reads the facts at most once a DRIVER_CHECK_S."""
        from sparkwatch.core.driver.drift import judge
        from sparkwatch.telemetry.sources.driverfacts import read_driver_facts

        now = self.clock()
        if now - self._driver_checked >= DRIVER_CHECK_S:
            self._driver_checked = now
            try:
                # Files only (dpkg status, /lib/modules, /proc/driver/nvidia): the GPU row already asks NVML.
                self._driver = judge(read_driver_facts(Path(self.settings.root), None))
                self._driver_error = None
            except Exception as exc:  # said in the view, never fatal to it
                self._driver_error = f"{type(exc).__name__}: {exc}"
        return self._driver

    def close(self) -> None:
        if self._peers is not None:
            self._peers.close()
        self.telemetry.close()


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.tui.console import emit, make_console
    from sparkwatch.tui.status_view import render

    settings = settings_from(args, state_dir=args.state_dir)
    app = StatusApp(settings)
    try:
        if args.once:
            console = make_console()
            # One frame: the engines' serving word too, each probed once first (at most 3 s: the probe's thread).
            app.telemetry.collect()
            app.telemetry.probes.settle(min(settings.probe_timeout_s, ONCE_PROBE_S) + 0.5)
            emit(render(app.frame(peers_wait_s=ONCE_PEERS_S), console.width))
            return 0
        console = make_console()
        if not console.is_terminal:
            return _frames_to_pipe(app, args.interval)
        return _live(app, args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        app.close()


def _ticks(interval_s: float) -> Iterator[None]:
    """Sleep to the next tick; a slow cycle starts the next one at once rather than bunching up."""
    next_at = time.monotonic()
    while True:
        yield
        next_at += interval_s
        delay = next_at - time.monotonic()
        if delay < 0:
            next_at = time.monotonic()
            delay = 0
        time.sleep(delay)


QUIT_KEYS = frozenset(b"qQ")


class QuitKeys:
    """The live view's keyboard: `q` ends it (as in top, less and htop), besides Ctrl-C.

    On a terminal stdin goes to cbreak mode (keys arrive one by one, unechoed; Ctrl-C still interrupts) and is put
    back as it was on the way out, whatever ends the view. The wait between frames is a select() on stdin, so a key
    is seen at once and costs no extra wake-up. Without a terminal on stdin it only sleeps.
    """

    def __init__(self, fd: int | None = None) -> None:
        self.fd = sys.stdin.fileno() if fd is None else fd
        self._saved: list[Any] | None = None

    def __enter__(self) -> QuitKeys:
        import termios
        import tty

        if os.isatty(self.fd):
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        import termios

        if self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`; True as soon as a quit key is pressed."""
        if self._saved is None:
            time.sleep(timeout_s)
            return False
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return False
            data = os.read(self.fd, 64)
            if not data or any(b in QUIT_KEYS for b in data):
                return True  # q, or the terminal went away
            if left <= 0:
                return False


def _live(app: StatusApp, interval_s: float) -> int:
    from rich.live import Live

    from sparkwatch.tui.console import inert, make_console
    from sparkwatch.tui.status_view import render

    console = make_console()
    # auto_refresh off: exactly one redraw per cycle, whatever rich's default rate; the normal screen (not the
    # alternate one) so the last frame stays in the scrollback when the user quits.
    with (
        QuitKeys() as keys,
        Live(
            console=console, auto_refresh=False, transient=False, redirect_stdout=False, redirect_stderr=False
        ) as live,
    ):
        next_at = time.monotonic()
        while True:
            live.update(inert(render(app.frame(live=True), console.width)), refresh=True)
            next_at = max(next_at + interval_s, time.monotonic())  # a slow cycle starts the next one at once
            if keys.wait(next_at - time.monotonic()):
                return 0


def _frames_to_pipe(app: StatusApp, interval_s: float) -> int:
    from sparkwatch.tui.console import PIPE_WIDTH, emit
    from sparkwatch.tui.status_view import render

    for _ in _ticks(interval_s):
        emit(render(app.frame(), PIPE_WIDTH))
        print(flush=True)
    return 0  # pragma: no cover
