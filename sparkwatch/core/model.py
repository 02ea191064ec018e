"""Frozen records that flow from the sources through the core to the guard, the outbox and the exporter.

Everything here is plain data: no I/O, no methods that reach outside the object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from sparkwatch.core.containerid import ContainerRef, container_of
from sparkwatch.core.enums import CheckStatus, DriverVerdict, EnvSource, JitCacheKind, JitState, MaxJobsState
from sparkwatch.core.eventkinds import EventKind


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
    # Shmem: tmpfs, shared anonymous memory (a torn-down engine's NCCL/IPC segments until released; on some drivers
    # GPU-shared buffers). Counted inside Cached, but it is not page cache the kernel can drop: launch's settle waits
    # for it to fall, the flight recorder keeps it apart (0 where the kernel has no such line).
    shmem_bytes: int = 0

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
    # What a user cannot forge, read by the scanner (None where unreadable): the executable the kernel runs
    # (/proc/PID/exe), the cgroup v2 path (/proc/PID/cgroup), and for generic launchers only the first engine library
    # mapped (/proc/PID/maps, see core.engines.identity.ENGINE_LIBRARIES).
    exe: str | None = None
    cgroup: str | None = None
    engine_lib: str | None = None
    # Outside the initial user or mount namespace (read by the scanner only where `exe` would protect the process):
    # there the executable path can be a bind mount, so it protects nothing (core.engines.identity.protected_by_system).
    outside_initial_ns: bool = False
    exiting: bool = False  # PF_EXITING: in do_exit, still unmapping its memory (a SIGKILLed engine for seconds)

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

    @property
    def container(self) -> ContainerRef | None:
        """The container the root runs in, from its cgroup path (core.containerid), or None when bare."""
        return container_of(self.root.cgroup)


@dataclass(frozen=True, slots=True)
class GpuHolder:
    """A process NVML says holds GPU memory that no engine rule names and no engine tree contains."""

    proc: Proc
    used_gpu_memory_bytes: int | None  # None: NVML could not say how much


@dataclass(frozen=True, slots=True)
class Event:
    """One line of events.jsonl. `fields` holds the kind-specific keys of the contract (e.g. victims for a kill)."""

    id: str
    ts: str
    kind: EventKind
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


# --- The driver (telemetry.sources.driverfacts reads DriverFacts, core.driver.drift judges them into a DriverReport)


@dataclass(frozen=True, slots=True)
class NvmlFacts:
    """What NVML said, when it was asked (live root only). `error_code` is NVML's (core.driver.nvmlcodes.NvmlReturn)."""

    library_version: str | None = None  # nvmlSystemGetNVMLVersion, e.g. "12.580.95.05"
    driver_version: str | None = None  # nvmlSystemGetDriverVersion, e.g. "580.95.05"
    error_code: int | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class DpkgPackage:
    """One stanza of /var/lib/dpkg/status; only 'install ok installed' ones are kept as installed."""

    name: str
    version: str
    status: str

    @property
    def installed(self) -> bool:
        return self.status == "install ok installed"


@dataclass(frozen=True, slots=True)
class DriverFacts:
    """Everything the drift verdict looks at, read from files under one root (plus NVML on the live root).

    A fact that could not be read is None (or empty) and named in `read_errors`: never guessed.
    """

    running_kernel: str | None
    packages: tuple[DpkgPackage, ...] = ()
    dpkg_error: str | None = None  # corrupt/truncated/missing status file, in words
    # kernel -> module files found (paths relative to lib/modules/<kernel>), for the running and the boot kernels
    module_files: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    module_dirs: tuple[str, ...] = ()  # kernels whose lib/modules/<kernel>/ exists at all (containers often lack it)
    boot_kernels: tuple[str, ...] = ()  # from <root>/boot/vmlinuz-*
    grub_entry: str | None = None  # grubenv next_entry, else saved_entry
    loaded_version: str | None = None  # from /proc/driver/nvidia/version
    loaded_open: bool | None = None  # "Open Kernel Module" in that file
    device_nodes: tuple[str, ...] = ()  # /dev/nvidia*
    library_versions: tuple[str, ...] = ()  # from libnvidia-ml.so.<version> files
    nvml: NvmlFacts | None = None  # None: not asked (fixture root, or NVML probing off)
    reboot_required: bool = False
    reboot_required_pkgs: tuple[str, ...] = ()
    read_errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DriverReport:
    """The drift verdict. `verdict` is the worst finding: stranded > will_strand > version_mismatch > not_loaded >
    reboot_pending > ok; `absent` when no NVIDIA driver is installed at all, `unknown` when the facts are too thin."""

    verdict: DriverVerdict
    summary: str
    running_kernel: str | None
    next_boot_kernel: str | None
    running_modules: tuple[str, ...]  # module files for the running kernel ("" when none)
    next_boot_modules: tuple[str, ...]
    stranded: bool
    next_boot_ok: bool | None  # None: next-boot kernel unknown
    loaded: bool | None  # module loaded (proc file, device nodes, NVML); None: no evidence either way
    loaded_version: str | None
    library_version: str | None
    module_version: str | None  # driver version of the installed kernel-module packages (DKMS / kernel-source)
    version_mismatch: bool
    reboot_required: bool
    reboot_required_pkgs: tuple[str, ...]
    dkms: bool  # an nvidia-dkms package is installed
    open_modules: bool | None  # open (GB10 needs them) vs proprietary; None: unknown
    findings: tuple[str, ...] = ()  # plain sentences for detail lines


@dataclass(frozen=True, slots=True)
class Check:
    """One line of `sparkwatch doctor`; `fix` is commands a human runs."""

    id: str
    status: CheckStatus
    summary: str
    fix: str | None = None
    detail: str | None = None

    def to_json_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"id": self.id, "status": self.status, "summary": self.summary}
        if self.fix is not None:
            out["fix"] = self.fix
        if self.detail is not None:
            out["detail"] = self.detail
        return out


# --- Telemetry. The telemetry loop (sparkwatch/telemetry/loop.py) builds one Snapshot a cycle and publishes it by
# swapping a reference; the exporter, `status` and sd_notify's STATUS= line only read it. Each source fills its own
# part and owns its record type below; a part is None when its source is off or failed (see `collectors`).


@dataclass(frozen=True, slots=True)
class CollectorStatus:
    """How one source did this cycle: exported as collector_success / collector_duration_seconds."""

    name: str
    success: bool
    duration_s: float
    error: str | None = None


class GpuProcess(NamedTuple):
    """A process holding GPU memory, as NVML lists it (compute and graphics lists merged, one entry per pid).

    A tuple so that `for pid, used, gpu in report.processes` works. `used_gpu_memory_bytes` is None where NVML
    answers NVML_VALUE_NOT_AVAILABLE (WDDM, some containers): the process is on the GPU, its share unknown.
    """

    pid: int
    used_gpu_memory_bytes: int | None
    gpu_index: int


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU as NVML saw it in one cycle, in base units.

    A field NVML answers NOT_SUPPORTED for is None, never 0 (GB10: memory info, memory clock, power limit);
    `supported` says so per field, and `field_errors` holds the NVML return code of any other failure.
    `unified` is True where the GPU has no memory of its own (GB10): memory info NOT_SUPPORTED, zero, or about
    MemTotal. Then `memory_total_bytes`/`memory_used_bytes` are None: the pool is /proc/meminfo's, not VRAM.
    """

    index: int
    uuid: str
    name: str
    bus_id: str
    unified: bool
    power_watts: float | None = None
    power_limit_watts: float | None = None
    utilization_ratio: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    memory_clock_max_hertz: float | None = None
    energy_joules: float | None = None  # since the driver loaded: a counter
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    supported: Mapping[str, bool] = field(default_factory=dict)
    field_errors: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GpuReport:
    """What sources.nvml.NvmlSource saw this cycle.

    `up` is False when NVML could not be initialised or stopped answering; `nvml_return_code` then holds NVML's code
    (core.driver.nvmlcodes.NvmlReturn), or None when a call hung (`error` says which). When up, the code is 0 (SUCCESS).
    """

    up: bool
    nvml_return_code: int | None
    error: str | None = None
    driver_version: str | None = None
    nvml_version: str | None = None
    devices: tuple[GpuDevice, ...] = ()
    call_timeouts_total: int = 0  # NVML calls that outlived the timeout since the source started

    @property
    def processes(self) -> tuple[GpuProcess, ...]:
        return tuple(p for d in self.devices for p in d.processes)


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
    max_jobs_state: MaxJobsState  # SET: the value is in max_jobs

    max_jobs: str | None = None
    max_jobs_source: EnvSource | None = None  # whose environ gave the answer


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

    cache: JitCacheKind
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
    # A container's own cache, read through its engine's /proc/PID/root (telemetry/sources/jitcache.py): that engine's
    # root pid and where it is in words ("container 4f4f4f4f4f4f"); 0 and "" for a cache of the host's own.
    root_pid: int = 0
    where: str = ""


@dataclass(frozen=True, slots=True)
class JitEngineState:
    """idle / compiling / stalled for one engine tree (core.engines.jit decides)."""

    kind: str
    root_pid: int
    state: JitState
    since_ts: float
    reason: str


@dataclass(frozen=True, slots=True)
class BootState:
    """A launched engine's boot as its declaration says (common.launched), while its root runs."""

    root_pid: int
    kind: str
    model: str
    phase: str  # core.launch.bootphase.BootPhase
    phase_since_ts: float
    launched_at: float
    ready_s: float | None = None
    budget_bytes: int | None = None
    peak_bytes: int | None = None
    probe_url: str = ""  # `launch --probe URL`: where the serving probe asks
    first_token_s: float | None = None  # launch to the first good probe
    worker_budget_bytes: int | None = None  # over Ray: its ranks' budget on the other nodes (common.launched)


@dataclass(frozen=True, slots=True)
class EngineServing:
    """Whether an engine serves, as the one-token probe last found it (core.engines.serving, telemetry/serving.py)."""

    kind: str
    root_pid: int
    endpoint: str  # host:port probed (the listening socket the engine owns), or as its command line names it
    state: str  # core.engines.serving.Serving
    failures: int = 0  # in a row
    latency_s: float | None = None  # of the last good probe
    last_ok_ts: float | None = None
    wedged_for_s: float | None = None
    error: str = ""  # the last failure, in words
    # core.engines.progress: whether it served progress counters at the last look after a failed probe (None: never
    # looked; False: none, so it is never killed as wedged), the requests running then, and for `busy` how far its
    # lead counter moved since the look before.
    counted: bool | None = None
    running: float | None = None
    moved: float | None = None


@dataclass(frozen=True, slots=True)
class ShmFile:
    """A regular file in /dev/shm (telemetry/sources/shmfiles.py): tmpfs pages, out of the pool until unlinked."""

    name: str
    dev: int  # st_dev and st_ino: what /proc/PID/maps and the fd links are matched on (a path differs per namespace)
    ino: int
    uid: int  # its owner
    # Allocated: st_blocks * 512. A 1 GiB ftruncate never written holds nothing; its apparent size would lie.
    held_bytes: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.ino)


@dataclass(frozen=True, slots=True)
class ShmScan:
    """One look at /dev/shm and at who holds its files (telemetry/sources/shmfiles.py)."""

    files: tuple[ShmFile, ...]
    used: frozenset[tuple[int, int]]  # (dev, ino) of the files a live process maps or holds open
    # The owners (uids) of the live processes whose fds or maps could not be read: any of them may hold any file.
    unreadable: tuple[int, ...] = ()
    # This /proc does not show every process (another PID namespace, hidepid): a process unseen may hold any file.
    partial_table: bool = False


@dataclass(frozen=True, slots=True)
class ShmLeft:
    """The /dev/shm files no process holds (core.launch.shmleft.judge): what an engine killed left in the pool."""

    orphans: tuple[ShmFile, ...]
    # False: a process of another user could not be read by a user who is not root (or /proc does not show them
    # all), so any orphan may be held after all; the files are named, never removed, and no metric claims them.
    certain: bool = True
    why_uncertain: str = ""

    @property
    def held_bytes(self) -> int:
        return sum(f.held_bytes for f in self.orphans)


@dataclass(frozen=True, slots=True)
class Snapshot:
    ts: float  # wall-clock time the cycle finished
    mem: MemInfo | None = None
    engines: tuple[EngineTree, ...] = ()
    compile: CompileCensus | None = None  # telemetry: core.engines.compile
    jit: tuple[JitCacheState, ...] = ()  # telemetry: per cache/version/arch
    gpu: GpuReport | None = None  # sources.nvml
    driver: DriverReport | None = None  # core.driver.drift over telemetry.sources.driverfacts
    collectors: tuple[CollectorStatus, ...] = ()
    psi: PsiMemory | None = None  # None: the kernel has no PSI (or it is off)
    jit_states: tuple[JitEngineState, ...] = ()  # per engine tree
    # (min_block label, bytes free in blocks at least that big) from /proc/buddyinfo: "2MiB", "64KiB"
    free_contiguous: tuple[tuple[str, int], ...] = ()
    gpu_unknown: tuple[GpuHolder, ...] = ()  # GPU holders no rule names: core.engines.identity.unknown_gpu_holders
    boots: tuple[BootState, ...] = ()  # engines `sparkwatch launch` declared, with their boot phase
    serving: tuple[EngineServing, ...] = ()  # per probed engine: telemetry/serving.py
    shm: ShmLeft | None = None  # /dev/shm's orphans, from the shm watch's last scan (telemetry/shmwatch.py)
