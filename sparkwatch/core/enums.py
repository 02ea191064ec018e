"""Every verdict, state and status sparkwatch carries between modules: typed, so a misspelt value is a mypy error.

StrEnum members are their own string values, so they serialise as is into events.jsonl, metric labels, the doctor
JSON and the webhook body: those strings are a contract (docs/contract.md). Event kinds live in core/eventkinds.py.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

# Whose /proc/<pid>/environ answered the MAX_JOBS question: a live compiler (what was really inherited), its raylet
# (Ray actors inherit the raylet's environment, not the shell's), or the engine root.
EnvSource = Literal["compiler", "raylet", "engine"]
# A process's role in an engine tree as `sparkwatch engines` draws it (core.engines.proctree).
ProcRole = Literal["root", "worker", "compiler", "process"]
# Which JIT cache a JitCacheState is: flashinfer's <base>/<version>/<arch>/ or vLLM's torch compile cache.
JitCacheKind = Literal["flashinfer", "vllm"]


class DriverVerdict(StrEnum):
    """The drift verdict (core.driver.drift), worst first; the `verdict` label of sparkwatch_driver_info."""

    STRANDED = "stranded"  # the running kernel has no NVIDIA modules
    WILL_STRAND = "will_strand"  # the next boot's kernel has none
    VERSION_MISMATCH = "version_mismatch"  # loaded module and user-space library differ
    NOT_LOADED = "not_loaded"  # modules installed for this kernel, driver not loaded
    REBOOT_PENDING = "reboot_pending"  # apt asked for a reboot
    OK = "ok"
    ABSENT = "absent"  # no NVIDIA driver installed at all
    UNKNOWN = "unknown"  # the facts are too thin to judge (running kernel unreadable)


class DriverProblem(StrEnum):
    """An open driver alert episode (core.report.alerts.driver_step); each opens with its own event kind."""

    STRANDED = "stranded"
    WILL_STRAND = "will_strand"
    VERSION_MISMATCH = "version_mismatch"
    NOT_LOADED = "not_loaded"


class JitState(StrEnum):
    """One engine's JIT state (core.engines.jit); the `state` label of sparkwatch_jit_state."""

    IDLE = "idle"
    COMPILING = "compiling"
    STALLED = "stalled"


class MaxJobsState(StrEnum):
    """What the environment the compilers inherit says about MAX_JOBS (core.engines.compile)."""

    SET = "set"
    UNSET = "unset"
    UNKNOWN = "unknown"  # no environ readable: another user's process, hidepid, or gone


class CheckStatus(StrEnum):
    """One `sparkwatch doctor` line; any FAIL makes the command exit 1."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
