"""What a launched tree holds now (core.kill.footprint), without the pool's drop: everything else on the box is in
that. Its processes' RSS or its scope's memory.current, and NVML's per-process bytes where NVML loads (checked in a
throwaway child first, as `status` does)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkwatch.common.sources.cgroupmem import read_memory_current
from sparkwatch.common.sources.procs import read_rss_bytes
from sparkwatch.core.kill.footprint import FootprintInputs, footprint

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings


def gpu_reader(settings: Settings) -> Any | None:
    """NVML's per-process bytes for the footprint, or None where it would hang (nvml_preflight) or fails to build."""
    from sparkwatch.telemetry.sources.nvml import NvmlSource
    from sparkwatch.telemetry.sources.nvml_preflight import nvml_hang_reason

    if nvml_hang_reason() is not None:
        return None
    return NvmlSource(proc_root=settings.proc_root)


def gpu_bytes_of(source: Any | None, pids: list[int]) -> int | None:
    """The GPU bytes NVML lists for `pids`, summed; None when NVML is not up (no reading: the footprint then has no
    GPU part, core.kill.footprint)."""
    from sparkwatch.core.model import GpuReport

    if source is None:
        return None
    report = source.collect()
    if not isinstance(report, GpuReport) or not report.up:
        return None
    wanted = set(pids)
    return sum(p.used_gpu_memory_bytes or 0 for p in report.processes if p.pid in wanted)


def sample(proc_root: str, pids: list[int], gpu: Any | None, cgroup: str | None) -> int:
    """The footprint of `pids` (and the scope `cgroup`, when it is the tree's own) now, in bytes."""
    gpu_bytes = gpu_bytes_of(gpu, pids)
    return footprint(
        FootprintInputs(
            rss_bytes=read_rss_bytes(proc_root, pids),
            gpu_bytes=gpu_bytes,
            gpu_age_s=None if gpu_bytes is None else 0.0,
            cgroup_bytes=read_memory_current(cgroup),
        )
    ).bytes
