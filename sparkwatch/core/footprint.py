"""What one engine tree holds in the unified pool, counted once. The one rule, for the guard's budgets and launch's
learned peaks alike. Pure.

Sources (docs/engines.md, "Footprint", says how exact each is on a GB10, with sources):
- the RSS of the tree's processes: the CPU side; it leaves out CUDA allocations (ray-project/ray#66335);
- the cgroup's memory.current when the tree owns its cgroup (a `launch` scope): RSS plus the cgroup's page cache and
  kernel memory; it also leaves out CUDA allocations (Blackwellboy/model-serving-minefield#57). It overlaps RSS, so
  the host side is the larger of the two, never their sum;
- GPU bytes per pid (NVML usedGpuMemory, through telemetry): exact for driver allocations (vllm-project/vllm#55828).
  A hint with an age: a reading older than GPU_STALE_S counts as none;
- the pool's drop since launch (MemAvailable at launch - now): right for the whole box, but everything else that
  grows is in it, so it is charged to an engine only while that engine is the only one starting, and only where it
  is larger than what the other sources add up to (a GB10 whose per-pid NVML figure is missing or partial).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from sparkwatch.core.policy import GPU_STALE_S


class FootprintSource(StrEnum):
    RSS = "rss"
    RSS_GPU = "rss+gpu"
    CGROUP = "cgroup"
    CGROUP_GPU = "cgroup+gpu"
    POOL_DROP = "pool_drop"


@dataclass(frozen=True, slots=True)
class FootprintInputs:
    rss_bytes: int
    gpu_bytes: int | None = None  # summed over the tree's pids; None: no reading
    gpu_age_s: float | None = None
    cgroup_bytes: int | None = None  # memory.current of a cgroup the tree owns
    pool_drop_bytes: int | None = None  # only while the engine is the only one starting


@dataclass(frozen=True, slots=True)
class Footprint:
    bytes: int
    source: FootprintSource
    gpu_bytes: int | None  # the GPU part that counted (None: no fresh reading)


def footprint(inp: FootprintInputs) -> Footprint:
    gpu = inp.gpu_bytes
    if gpu is not None and (inp.gpu_age_s is None or inp.gpu_age_s > GPU_STALE_S):
        gpu = None
    cgroup = inp.cgroup_bytes is not None and inp.cgroup_bytes > inp.rss_bytes
    host = inp.cgroup_bytes if cgroup and inp.cgroup_bytes is not None else inp.rss_bytes
    total = host + (gpu or 0)
    if gpu is None:
        source = FootprintSource.CGROUP if cgroup else FootprintSource.RSS
    else:
        source = FootprintSource.CGROUP_GPU if cgroup else FootprintSource.RSS_GPU
    if inp.pool_drop_bytes is not None and inp.pool_drop_bytes > total:
        return Footprint(inp.pool_drop_bytes, FootprintSource.POOL_DROP, gpu)
    return Footprint(total, source, gpu)


# A declared scope counts only as what `sparkwatch launch` makes (`…/sparkwatch-launch-<pid>.scope`) and only where the
# root really is in it (the scanner's read of /proc/PID/cgroup): a declaration cannot point anyone at a larger group.
SCOPE_RE = re.compile(r"/sparkwatch-launch-\d+\.scope$")


def owned_scope(root_cgroup: str | None, declared_cgroup: str | None) -> str | None:
    """The cgroup whose memory.current is the tree's: the declared scope, when the root is in it."""
    if not declared_cgroup or declared_cgroup != root_cgroup or not SCOPE_RE.search(declared_cgroup):
        return None
    return declared_cgroup
