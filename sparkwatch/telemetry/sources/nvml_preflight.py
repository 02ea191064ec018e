"""Will libnvidia-ml load? Asked in a short child process, before this process loads it.

A `dlopen` of a hung libnvidia-ml.so.1 (a constructor that never returns, a driver stuck in the kernel) holds the
calling interpreter's GIL, and every thread stops with it: measured, 0 reads in 4 s. No timeout inside the process
can help, so the telemetry process, `status` and `doctor` first let a throwaway child load and initialise it. If the
child does not finish in time, they run without NVML and say why (`NvmlOff`), instead of hanging.

The child can start before its answer is needed (`Preflight.start()`, then `reason()`): the telemetry process starts
it before its own imports, `status` on a thread, so its 65 ms on the 2-core VM run beside them instead of before
them. It runs with `-S` (no site): it needs ctypes alone, and site with the venv's .pth files was half of its time
(42 -> 19-24 ms a child, medians of 30, on the 2-core VM).
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkwatch.core.model import GpuReport

LIBRARY = "libnvidia-ml.so.1"
# Measured: nvmlInit on an H200 host 0.3-1.2 s, the child's interpreter start 0.05-0.2 s; 10 s is a hang.
PREFLIGHT_TIMEOUT_S = 10.0
_CHILD = (
    "import ctypes, sys\n"
    "try:\n"
    f"    lib = ctypes.CDLL({LIBRARY!r})\n"
    "except OSError:\n"
    "    sys.exit(0)\n"  # absent: NVML's own error path reports that, quickly and without hanging
    "init = getattr(lib, 'nvmlInit_v2', None)\n"
    "if init is not None:\n"
    "    init()\n"
)


class Preflight:
    """One load check in a child process, started now and answered by `reason()`; its time runs from `start()`."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, error: str | None, started: float) -> None:
        self.proc = proc
        self._error = error
        self._started = started

    @classmethod
    def start(cls) -> Preflight:
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CHILD],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError as exc:
            return cls(None, f"NVML off: could not start the NVML load check: {exc}", started)
        return cls(proc, None, started)

    def reason(self, timeout_s: float | None = None) -> str | None:
        """None when libnvidia-ml loaded and initialised (or is absent) within timeout_s (PREFLIGHT_TIMEOUT_S) of
        start(); else why NVML stays off."""
        timeout_s = PREFLIGHT_TIMEOUT_S if timeout_s is None else timeout_s
        proc = self.proc
        if proc is None:
            return self._error
        try:
            proc.wait(max(0.0, self._started + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return f"NVML off: {LIBRARY} did not load and initialise within {timeout_s:g} s (hung library or driver?)"
        return None

    def abandon(self) -> None:
        """The answer is not wanted (the process stops first): end the child and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def nvml_hang_reason(timeout_s: float | None = None) -> str | None:
    """None when libnvidia-ml loads and initialises (or is absent) within timeout_s; else why NVML stays off."""
    return Preflight.start().reason(timeout_s)


class NvmlOff:
    """A GPU source that never loads NVML: each cycle reports the GPU down with the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def collect(self) -> GpuReport:
        from sparkwatch.core.model import GpuReport  # noqa: PLC0415 - not before the telemetry's own imports

        return GpuReport(up=False, nvml_return_code=None, error=self.reason)
