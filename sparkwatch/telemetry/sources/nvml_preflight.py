"""Will libnvidia-ml load? Asked in a short child process, before this process loads it.

A `dlopen` of a hung libnvidia-ml.so.1 (a constructor that never returns, a driver stuck in the kernel) holds the
calling interpreter's GIL, and every thread stops with it: measured, 0 reads in 4 s. No timeout inside the process
can help, so the telemetry process, `status` and `doctor` first let a throwaway child load and initialise it. If the
child does not finish in time, they run without NVML and say why (`NvmlOff`), instead of hanging.
"""

from __future__ import annotations

import subprocess
import sys

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


def nvml_hang_reason(timeout_s: float = PREFLIGHT_TIMEOUT_S) -> str | None:
    """None when libnvidia-ml loads and initialises (or is absent) within timeout_s; else why NVML stays off."""
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _CHILD],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError as exc:
        return f"NVML off: could not start the NVML load check: {exc}"
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"NVML off: {LIBRARY} did not load and initialise within {timeout_s:g} s (hung library or driver?)"
    return None


class NvmlOff:
    """A GPU source that never loads NVML: each cycle reports the GPU down with the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def collect(self) -> GpuReport:
        return GpuReport(up=False, nvml_return_code=None, error=self.reason)
