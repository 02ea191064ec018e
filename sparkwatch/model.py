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
class Snapshot:
    ts: float  # wall-clock time the cycle finished
    mem: MemInfo | None = None
    engines: tuple[EngineTree, ...] = ()
    compile: object | None = None  # CompileCensus (telemetry)
    jit: tuple[object, ...] = ()  # JitCacheState per cache/version/arch (telemetry)
    gpu: object | None = None  # GpuReport (sources.nvml)
    driver: object | None = None  # DriverReport (core.drift)
    collectors: tuple[CollectorStatus, ...] = ()
