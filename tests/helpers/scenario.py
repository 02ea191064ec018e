"""The golden scenario: a GB10 mid-boot with a vLLM compiler burst, a Ray actor compiling, a llama-server, a user's
gcc, and flashinfer/vLLM caches. Shared by the golden test and the fault tests."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from sparkwatch.common.stats import GuardStats, KernelLogStats
from sparkwatch.config.settings import Settings, load_settings
from sparkwatch.core.enums import DriverVerdict
from sparkwatch.core.kill import raygroup
from sparkwatch.core.model import DriverReport, GpuDevice, GpuProcess, GpuReport, ShmFile, ShmLeft, Snapshot
from sparkwatch.telemetry.peerwatch import PeerState
from sparkwatch.telemetry.raywatch import GroupView
from tests.helpers.proctree import FIXED_MTIME, PSI_MEMORY, FakeProc, pin_mtimes, write_module, write_proc

GiB = 1 << 30
MiB = 1 << 20
GENCODE = ["-gencode", "arch=compute_121a,code=sm_121a"]


def scenario_procs(cache_dir: Path) -> list[FakeProc]:
    mod = str(cache_dir / "0.4.1" / "121a" / "cached_ops" / "batch_prefill")
    return [
        FakeProc(1, 0, "systemd", ["/sbin/init"]),
        FakeProc(500, 1, "bash", ["-bash"]),
        FakeProc(
            1000,
            500,
            "vllm",
            ["/venv/bin/python3", "/venv/bin/vllm", "serve", "Qwen/Qwen3-32B"],
            rss_bytes=GiB,
            environ={"HOME": "/home/u", "PATH": "/usr/bin"},
        ),
        FakeProc(
            1001,
            1000,
            "VLLM::EngineCor",
            ["VLLM::EngineCore"],
            rss_bytes=3 * GiB,
            wchan="anon_pipe_read",
            environ={"HOME": "/home/u"},
        ),
        FakeProc(
            1002, 1001, "ninja", ["ninja", "-v", "-C", mod, "-j", "20"], rss_bytes=8 * MiB, environ={"PATH": "/usr/bin"}
        ),
        FakeProc(
            1003,
            1002,
            "nvcc",
            ["/usr/local/cuda/bin/nvcc", *GENCODE, "-c", "a.cu", "-o", "a.cuda.o"],
            rss_bytes=64 * MiB,
        ),
        FakeProc(
            1004,
            1002,
            "nvcc",
            ["/usr/local/cuda/bin/nvcc", "-gencode=arch=compute_121a,code=sm_121a", "-c", "b.cu"],
            rss_bytes=64 * MiB,
        ),
        FakeProc(
            1005,
            1003,
            "cicc",
            ["/usr/local/cuda/nvvm/bin/cicc", "-arch", "compute_121a", "a.cpp1.ii"],
            state="R",
            rss_bytes=3 * GiB,
        ),
        FakeProc(
            1006,
            1004,
            "cicc",
            ["/usr/local/cuda/nvvm/bin/cicc", "-arch", "compute_121a", "b.cpp1.ii"],
            state="R",
            rss_bytes=5 * GiB,
        ),
        FakeProc(1007, 1003, "ptxas", ["ptxas", "-arch=sm_121a", "-m64", "a.ptx"], rss_bytes=256 * MiB),
        FakeProc(
            1008,
            1004,
            "cc1plus",
            ["/usr/lib/gcc/aarch64-linux-gnu/13/cc1plus", "-quiet", "b.cudafe1.cpp"],
            rss_bytes=128 * MiB,
        ),
        FakeProc(
            2000,
            1,
            "llama-server",
            ["./build/bin/llama-server", "-m", "q.gguf"],
            rss_bytes=2 * GiB,
            environ=None,
            wchan="ep_poll",
        ),
        FakeProc(3000, 500, "gcc-13", ["gcc-13", "-O2", "-c", "x.c"], rss_bytes=32 * MiB),
        FakeProc(
            4000,
            1,
            "raylet",
            ["/venv/lib/python3.12/site-packages/ray/core/src/ray/raylet/raylet"],
            rss_bytes=256 * MiB,
            environ={"MAX_JOBS": "4", "RAY_memory_monitor_refresh_ms": "0"},
        ),
        FakeProc(4001, 4000, "ray::RayWorkerW", ["ray::RayWorkerWrapper.execute_method"], rss_bytes=GiB),
        FakeProc(4002, 4001, "ninja", ["ninja", "-C", "/tmp/build"], environ=None),
        FakeProc(4003, 4002, "nvcc", ["nvcc", "-arch=sm_90a", "-c", "c.cu"], rss_bytes=64 * MiB),
    ]


def build_scenario(tmp: Path, psi: bool = True) -> Settings:
    cache = tmp / "home" / ".cache" / "flashinfer"
    arch = cache / "0.4.1" / "121a"
    write_module(arch, "batch_prefill", ["a", "b", "c"], built=["c"])
    write_module(arch, "norm", ["norm"], built=["norm"], linked=True)
    (arch / "flashinfer_jit.log").write_text("jit log\n")
    (cache / "0.2.8" / "90a" / "cached_ops").mkdir(parents=True)
    vllm = tmp / "home" / ".cache" / "vllm" / "torch_compile_cache"
    (vllm / "3f1c2a" / "rank_0_0").mkdir(parents=True)
    (vllm / "3f1c2a" / "rank_0_0" / "inductor.bin").write_bytes(b"x" * 10000)
    pin_mtimes(tmp / "home")
    proc = write_proc(tmp / "proc", scenario_procs(cache), psi=PSI_MEMORY if psi else None)
    # The H200's real buddyinfo, read once through the device tool (tests/fixtures/kmsg/README.md)
    (proc / "buddyinfo").write_bytes((Path(__file__).parent.parent / "fixtures/kmsg/h200-buddyinfo.txt").read_bytes())
    return load_settings(
        None,
        {
            "proc_root": proc,
            "jit_cache_dirs": [cache],
            "vllm_cache_dirs": [vllm],
            "state_dir": tmp / "state",
            "floor": "8GiB",
        },
    )


def guard_stats() -> GuardStats:
    stats = GuardStats(fill_rate_bytes_per_s=150e6, poll_interval_s=0.1)
    stats.kills_total = {"floor": 1}
    stats.killed_processes_total = 9
    stats.last_kill_timestamp_s = FIXED_MTIME + 50.0
    stats.observe_kill_duration(0.12)
    stats.observe_group_teardown(0.41)  # a group's local half reaped 0.41 s after Ray showed the death
    stats.meminfo_errors_total = 1
    return stats


class StaticGuard:
    """The guard's counters as the exporter reads them (stats under a lock), with fixed values."""

    def __init__(self, stats: GuardStats) -> None:
        self.stats = stats
        self.lock = threading.Lock()


def kernel_log_stats() -> KernelLogStats:
    """A box that saw one NV_ERR_NO_MEMORY episode (two no_memory lines, one alloc_failed) and an Xid 79."""
    stats = KernelLogStats(readable=True, lines_total=1234, dropped_total=5)
    stats.nvrm_errors_total.update({"no_memory": 2, "alloc_failed": 1})
    stats.xid_total = {79: 1, 999: 2}
    return stats


class StaticKernelLog:
    def __init__(self, stats: KernelLogStats) -> None:
        self.stats = stats
        self.lock = threading.Lock()


class StaticEvents:
    write_errors_total = 2


def zero_durations(snap: Snapshot) -> Snapshot:
    """Durations are the one nondeterministic number in the exposition."""
    return dataclasses.replace(snap, collectors=tuple(dataclasses.replace(c, duration_s=0.0) for c in snap.collectors))


def gb10_report() -> GpuReport:
    """A GB10 mid-boot as NVML shows it on a real one: memory NOT_SUPPORTED (unified), 12 W while compiling, 0 %
    utilization, and the EngineCore holding GPU memory that its RSS does not show."""
    device = GpuDevice(
        index=0,
        uuid="GPU-5f3e2b9a-0c1d-4e7f-9a2b-3c4d5e6f7a8b",
        name="NVIDIA GB10",
        bus_id="0000000F:01:00.0",
        unified=True,
        power_watts=12.5,
        utilization_ratio=0.0,
        temperature_celsius=41.0,
        sm_clock_hertz=2_418_000_000.0,
        sm_clock_max_hertz=3_003_000_000.0,
        energy_joules=123456.0,
        processes=(
            GpuProcess(1001, 70 * GiB, 0),  # VLLM::EngineCore
            GpuProcess(4001, 2 * GiB, 0),  # the Ray actor
            GpuProcess(31337, 512 * MiB, 0),  # a process in no engine tree
            GpuProcess(31338, None, 0),  # on the GPU, share unknown: left out, not 0
        ),
        supported={"memory": False, "power": True, "utilization": True, "temperature": True, "sm_clock": True},
    )
    return GpuReport(up=True, nvml_return_code=0, driver_version="580.95.05", nvml_version="13.580.95.05",
                     devices=(device,))  # fmt: skip


class StaticGpu:
    def collect(self) -> GpuReport:
        return gb10_report()


def stranded_driver() -> DriverReport:
    """The DGX OS update that removed the running kernel's modules (6.17 installed, 6.11 left without nvidia.ko)."""
    return DriverReport(
        verdict=DriverVerdict.STRANDED,
        summary="the running kernel 6.11.0-1016-nvidia has no NVIDIA modules; 6.17.0-1008-nvidia does",
        running_kernel="6.11.0-1016-nvidia",
        next_boot_kernel="6.17.0-1008-nvidia",
        running_modules=(),
        next_boot_modules=("/lib/modules/6.17.0-1008-nvidia/kernel/nvidia-580-open/nvidia.ko",),
        stranded=True,
        next_boot_ok=True,
        loaded=False,
        loaded_version=None,
        library_version="580.95.05",
        module_version="580.95.05",
        version_mismatch=False,
        reboot_required=True,
        reboot_required_pkgs=("linux-image-6.17.0-1008-nvidia",),
        dkms=False,
        open_modules=True,
    )


def shm_leftovers() -> ShmLeft:
    """What a SIGKILLed vLLM left in /dev/shm: its shm_broadcast queue and a multiprocessing semaphore."""
    return ShmLeft(
        (ShmFile("psm_3f9a1c2e", 27, 101, 0, 640 * MiB), ShmFile("sem.mp-k2x8q1wz", 27, 102, 0, 4096)), certain=True
    )


def group_view() -> GroupView:
    """Two Sparks, one engine over Ray: the driver and one rank on 10.0.0.1 (this node), the rank on 10.0.0.2 dead,
    as raywatch sees it before the teardown; one teardown handed to the guard so far."""
    a, b = "a" * 56, "b" * 56
    state = raygroup.RayState(
        nodes=(raygroup.RayNode(a, "10.0.0.1", True), raygroup.RayNode(b, "10.0.0.2", True)),
        jobs=(raygroup.RayJob("01000000", 100, "10.0.0.1", True),),
        actors=(
            raygroup.RayActor("x1", "RayWorkerWrapper", "ALIVE", "01000000", a, 200, "5e7bd1a2c7f3"),
            raygroup.RayActor("x2", "RayWorkerWrapper", "DEAD", "01000000", b, 300, "5e7bd1a2c7f3"),
        ),
        placement_groups=(raygroup.RayPlacementGroup("5e7bd1a2c7f3", "01000000", "CREATED", (a, b)),),
    )
    return GroupView(raygroup.group_rows(state, frozenset({a})), state.nodes, 1, 0)


def peer_view() -> tuple[PeerState, ...]:
    """Node A's two peers: spark-b answering, spark-c gone quiet (lost)."""
    return (PeerState("10.0.0.2:9847", "spark-b", False), PeerState("spark-c:9847", "spark-c", True))
