"""`sparkwatch wait-settled`: block until a killed engine has let go of the pool, for relaunch scripts.

    sparkwatch wait-settled && vllm serve …

Settled means no engine process the guard could act on is left (its scope: this user's engines, every user's when
run as root, confined by `ancestor_pid`; a process of another user titled VLLM::EngineCore cannot hold the wait of
a user who could never kill it) and MemAvailable has not
risen by more than --tolerance for --quiet-for seconds (core/launch/settle.py says why those defaults). Exit 0 settled,
1 timed out, 2 when meminfo cannot be read. Progress goes to stderr: one updating line on a terminal, a plain line
whenever the situation changes (and every 5 s) otherwise, so logs stay short. It reads /proc only; it never signals.

Then it names the files in /dev/shm that no process holds any more (a SIGKILLed engine's shared memory, out of the
pool until removed: core.launch.shmleft), with their bytes; `--fix` removes those named like an engine's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, TextIO

from sparkwatch.cli import argtypes
from sparkwatch.core.launch.settle import (
    DEFAULT_QUIET_FOR_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOLERANCE_BYTES,
    SettleParams,
    SettleState,
    SettleVerdict,
    describe,
    settle_step,
)
from sparkwatch.core.units import format_size

# Half a second between looks: ten samples per default quiet window, and a /proc scan costs a few ms.
DEFAULT_INTERVAL_S = 0.5
# Without a terminal, repeat an unchanged progress line this often so a log shows the wait is alive.
PLAIN_REPEAT_S = 5.0


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "wait-settled",
        parents=[parent],
        help="wait until no engine process is left and MemAvailable stopped rising (exit 0; 1 on timeout)",
        description="Block until no engine process the guard could act on is left and MemAvailable stopped rising "
        "(by more than --tolerance for --quiet-for seconds): `sparkwatch wait-settled && vllm serve ...` relaunches "
        "into a pool that has really come back. Exit 0 settled, 1 on timeout (naming what is left), 2 when "
        "meminfo cannot be read.",
    )
    p.add_argument(
        "--timeout",
        type=argtypes.seconds(),
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help="give up after S seconds (default %(default)g)",
    )
    p.add_argument(
        "--quiet-for",
        type=argtypes.seconds(),
        default=DEFAULT_QUIET_FOR_S,
        metavar="S",
        help="MemAvailable must not rise for this long (default %(default)g)",
    )
    p.add_argument(
        "--tolerance",
        type=argtypes.size,
        default=DEFAULT_TOLERANCE_BYTES,
        metavar="SIZE",
        help=f"a rise up to SIZE counts as steady (default {format_size(DEFAULT_TOLERANCE_BYTES)})",
    )
    p.add_argument(
        "--interval",
        type=argtypes.seconds(),
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help="seconds between looks (default %(default)g)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--fix",
        action="store_true",
        help="then remove the /dev/shm files a killed engine left (orphaned, yours or any as root, named like an "
        "engine's: psm_, sem.mp-, nccl-, torch_, vllm, sglang)",
    )
    p.set_defaults(handler=handle)


class ProgressLine:
    """One updating line on a terminal; plain lines on a pipe or file, only when the message changes."""

    def __init__(self, stream: TextIO, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()
        self._last_key: object = None
        self._last_plain = 0.0
        self._open = False

    def update(self, text: str, key: object, now: float) -> None:
        if self.quiet:
            return
        if self.tty:
            width = _terminal_width(self.stream)
            self.stream.write("\r\x1b[K" + text[: width - 1])
            self._open = True
        elif key != self._last_key or now - self._last_plain >= PLAIN_REPEAT_S:
            self.stream.write(text + "\n")
            self._last_plain = now
        self._last_key = key
        self.stream.flush()

    def finish(self, text: str) -> None:
        if self.quiet:
            return
        prefix = "\r\x1b[K" if self._open else ""
        self.stream.write(prefix + text + "\n")
        self.stream.flush()
        self._open = False


def _terminal_width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return 80


def _progress_key(verdict: SettleVerdict, params: SettleParams) -> object:
    # A plain-text log gets a new line when the engine count changes, the wait moves to the memory phase, or memory
    # starts or stops rising.
    if verdict.engine_processes:
        return ("engines", verdict.engine_processes)
    return ("memory", verdict.recent_rise_bytes > params.tolerance_bytes)


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from, shm_fix
    from sparkwatch.common.sources.enginetrees import EngineFinder, live_processes
    from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader

    settings = settings_from(args)
    params = SettleParams(quiet_for_s=args.quiet_for, tolerance_bytes=args.tolerance)
    finder = EngineFinder.from_settings(settings, settings.proc_root)  # the guard's scope: only engines we could act on
    progress = ProgressLine(sys.stderr, quiet=args.quiet)
    try:
        reader = MeminfoReader(settings.proc_root)
    except OSError as exc:
        print(f"sparkwatch: cannot read {settings.proc_root / 'meminfo'}: {exc.strerror or exc}", file=sys.stderr)
        return 2

    def leftovers() -> None:  # what a killed engine left in /dev/shm, said (and with --fix removed) once the wait ends
        shm_fix.say(settings.root, settings.proc_root, args.fix, "sparkwatch wait-settled", quiet=args.quiet)

    start = time.monotonic()
    deadline = start + args.timeout
    state = SettleState()
    with reader:
        while True:
            now = time.monotonic()
            left = live_processes(finder.find())
            try:
                mem = reader.read()
            except MeminfoError as exc:
                progress.finish(f"sparkwatch: {exc}")
                return 2
            state, verdict = settle_step(state, params, now, len(left), mem.available_bytes)
            text = describe(verdict, params, left)
            if verdict.settled:
                progress.finish(f"sparkwatch: {text} (waited {now - start:.1f} s)")
                leftovers()
                return 0
            if now >= deadline:
                progress.finish(f"sparkwatch: timed out after {args.timeout:g} s: {text}")
                leftovers()
                return 1
            progress.update(f"sparkwatch: waiting {now - start:.0f}s: {text}", _progress_key(verdict, params), now)
            time.sleep(max(min(args.interval, deadline - now), 0.0))
