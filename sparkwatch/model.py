"""Frozen records that flow from the sources through the core to the actuators and the exporter.

Everything here is plain data: no I/O, no methods that reach outside the object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MemInfo:
    """The fields of /proc/meminfo the guard and the telemetry use, in bytes."""

    total_bytes: int
    available_bytes: int
    free_bytes: int
    buffers_bytes: int
    cached_bytes: int
    swap_total_bytes: int
    swap_free_bytes: int

    @property
    def used_bytes(self) -> int:
        # On a unified pool this is the only honest "used": nvidia-smi reports GPU memory as Not Supported.
        return self.total_bytes - self.available_bytes


@dataclass(frozen=True, slots=True)
class Proc:
    """One process as read from /proc/<pid>/{stat,cmdline}.

    `start_ticks` (field 22 of stat) plus `pid` is the identity of a process: a reused PID has a new start time.
    """

    pid: int
    ppid: int
    uid: int
    comm: str
    state: str
    start_ticks: int
    rss_bytes: int
    argv: tuple[str, ...]
    is_kernel_thread: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start_ticks)

    @property
    def display_name(self) -> str:
        """The name people recognise: a process title such as VLLM::EngineCore, else comm."""
        if self.argv and "::" in self.argv[0]:
            return self.argv[0].strip()
        return self.comm


@dataclass(frozen=True, slots=True)
class EngineTree:
    """An engine root and every descendant that may be killed with it (protected subtrees left out)."""

    kind: str
    root: Proc
    members: tuple[Proc, ...]  # root first, then descendants in breadth-first order

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.members)

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.members)


@dataclass(frozen=True, slots=True)
class Event:
    """One line of events.jsonl. `fields` holds the kind-specific keys of the contract (e.g. victims for a kill)."""

    id: str
    ts: str
    kind: str
    node: str
    summary: str
    fields: Mapping[str, object] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "ts": self.ts,
            "kind": self.kind,
            "node": self.node,
            "summary": self.summary,
            **self.fields,
        }


# --- Telemetry. The telemetry loop (sparkwatch/telemetry.py) builds one Snapshot a cycle and publishes it by swapping
# a reference; the exporter, `status` and sd_notify's STATUS= line only read it. Each source fills its own part and
# owns its record type below; a part is None when its source is off or failed (see `collectors`).


@dataclass(frozen=True, slots=True)
class CollectorStatus:
    """How one source did this cycle: exported as collector_success / collector_duration_seconds."""

    name: str
    success: bool
    duration_s: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PsiMemory:
    """Cumulative stall time from <proc_root>/pressure/memory (the `total=` fields, in microseconds)."""

    some_us: int
    full_us: int | None  # the `full` line appeared in 5.2-era kernels; absent means unknown, not zero


@dataclass(frozen=True, slots=True)
class EngineCompile:
    """The compilers inside one engine tree, and what that tree's environment says about MAX_JOBS."""

    kind: str
    root_pid: int
    tools: Mapping[str, int]  # tool -> live process count
    rss_bytes: int
    # "set" (value in max_jobs), "unset", or "unknown" (no environ readable: another user, hidepid, gone)
    max_jobs_state: str
    max_jobs: str | None = None
    max_jobs_source: str | None = None  # "engine" or "raylet": whose environ gave the answer


@dataclass(frozen=True, slots=True)
class CompileCensus:
    """Compiler processes on the node: the burst that fills the pool during flashinfer JIT."""

    tools: Mapping[str, int]  # tool -> live count, every known tool present (0 when none)
    rss_bytes: int
    parallel_jobs: int  # nvcc + cicc processes: what MAX_JOBS bounds
    archs: Mapping[str, int]  # "121a" -> compiler processes targeting it
    engines: tuple[EngineCompile, ...] = ()  # only trees that hold compilers or were asked about
    outside_engines: int = 0  # compiler processes in no engine tree (a pip build, a user's make)


@dataclass(frozen=True, slots=True)
class JitCacheState:
    """One JIT cache: flashinfer's <base>/<version>/<arch>/, or vLLM's torch compile cache (version/arch empty)."""

    cache: str  # "flashinfer" or "vllm"
    version: str
    arch: str
    path: str
    bytes: int
    files: int
    last_change_ts: float  # newest mtime of any file or directory in it
    objects_done: int = 0  # build.ninja object targets that exist (a module with its .so counts whole)
    objects_total: int = 0
    modules_total: int = 0
    modules_built: int = 0  # modules whose <module>.so exists
    error: str | None = None  # part of the tree was unreadable or vanished mid-walk


@dataclass(frozen=True, slots=True)
class JitEngineState:
    """idle / compiling / stalled for one engine tree (core.jit decides)."""

    kind: str
    root_pid: int
    state: str
    since_ts: float
    reason: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    ts: float  # wall-clock time the cycle finished
    mem: MemInfo | None = None
    engines: tuple[EngineTree, ...] = ()
    compile: CompileCensus | None = None
    jit: tuple[JitCacheState, ...] = ()  # per cache/version/arch
    gpu: object | None = None  # GpuReport (sources.nvml)
    driver: object | None = None  # DriverReport (core.drift)
    collectors: tuple[CollectorStatus, ...] = ()
    psi: PsiMemory | None = None  # None: the kernel has no PSI (or it is off)
    jit_states: tuple[JitEngineState, ...] = ()  # per engine tree
