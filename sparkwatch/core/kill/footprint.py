"""What one engine tree holds in the unified pool, counted once. The one rule, for the guard's budgets and launch's
learned peaks alike. Pure.

A footprint is only memory that belongs to the tree: a budget kill and a learned peak rest on nothing else.
Sources (docs/engines.md, "Footprint", says how exact each is on a GB10, with sources):
- the RSS of the tree's processes: the CPU side; it leaves out CUDA allocations (ray-project/ray#66335);
- the cgroup's memory.current when the tree owns its cgroup (a `launch` scope): RSS plus the cgroup's page cache and
  kernel memory; it also leaves out CUDA allocations (Blackwellboy/model-serving-minefield#57). It overlaps RSS, so
  the host side is the larger of the two, never their sum;
- GPU bytes per pid (NVML usedGpuMemory, through telemetry): exact for driver allocations (vllm-project/vllm#55828).
  A hint with an age: a reading older than GPU_STALE_S counts as none;
- the pool's drop since launch (MemAvailable at launch - now) is kept beside the footprint, never in it: everything
  else on the box that grows is in it (a 1.0 GiB budget was "exceeded" by a 1.3 GiB drop while the tree held 201 MiB,
  and a 200 MiB engine "learned" 3.5 GiB), so it may only warn (`budget_near`) while the engine is the only one
  starting, as the one sign of CUDA memory that NVML's per-pid figure misses; it never kills and is never learned.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sparkwatch.core.containerid import container_of
from sparkwatch.core.engines.identity import LAUNCH_SCOPE_RE
from sparkwatch.core.kill.policy import GPU_STALE_S


class FootprintSource(StrEnum):
    RSS = "rss"
    RSS_GPU = "rss+gpu"
    CGROUP = "cgroup"
    CGROUP_GPU = "cgroup+gpu"
    POOL_DROP = "pool_drop"  # only a warning's source (Footprint.warn_bytes): never a kill's, never a peak's


@dataclass(frozen=True, slots=True)
class FootprintInputs:
    rss_bytes: int
    gpu_bytes: int | None = None  # summed over the tree's pids; None: no reading
    gpu_age_s: float | None = None
    cgroup_bytes: int | None = None  # memory.current of a cgroup the tree owns
    pool_drop_bytes: int | None = None  # only while the engine is the only one starting


@dataclass(frozen=True, slots=True)
class Footprint:
    bytes: int  # what the tree itself holds: what a budget kills on and a peak learns
    source: FootprintSource
    gpu_bytes: int | None  # the GPU part that counted (None: no fresh reading)
    pool_drop_bytes: int | None = None  # the pool's drop, when it was given and says more than `bytes`: a warning only

    @property
    def warn_bytes(self) -> int:
        """What a `budget_near` warning compares with the budget: the footprint, or the pool's drop when larger."""
        return max(self.bytes, self.pool_drop_bytes or 0)

    @property
    def warn_source(self) -> FootprintSource:
        return FootprintSource.POOL_DROP if self.warn_bytes > self.bytes else self.source


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
    drop = inp.pool_drop_bytes if inp.pool_drop_bytes is not None and inp.pool_drop_bytes > total else None
    return Footprint(total, source, gpu, drop)


# A declared scope counts only as what `sparkwatch launch` makes (`…/sparkwatch-launch-<pid>.scope`) and only where the
# root really is in it (the scanner's read of /proc/PID/cgroup): a declaration cannot point anyone at a larger group.
def owned_scope(root_cgroup: str | None, declared_cgroup: str | None, container: str = "") -> str | None:
    """The cgroup whose memory.current is the tree's: the declared scope, when the root is in it; for a declared
    container (`container`, its id), the container's own cgroup, when the root is in it."""
    if not declared_cgroup or declared_cgroup != root_cgroup:
        return None
    ref = container_of(declared_cgroup) if container else None
    if not LAUNCH_SCOPE_RE.search(declared_cgroup) and (ref is None or ref.id != container):
        return None
    return declared_cgroup
