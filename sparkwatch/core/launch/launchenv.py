"""The environment `sparkwatch launch` gives an engine: what its compilers and Ray read, never over the user's value.

- MAX_JOBS: ninja's -j for flashinfer's JIT (flashinfer/jit/cpp_ext.py _get_num_workers), torch's cpp_extension and
  SGLang's JIT (sglang/kernels/jit/utils/compile/ninja.py). Unset, ninja runs about nproc + 2 jobs, and the SM121
  FP4 JIT's 20 nvcc at 3-8 GiB each OOM a Spark (flashinfer-ai/flashinfer#3634). Set to flashinfer PR #3899's
  memory-aware default, max(1, min(cpus, (MemAvailable - 16 GiB) // 8 GiB)), over the memory left once the engine's
  weights are in (core.launch.plan.launch_jobs; the PR is open, not in flashinfer 0.7.4: the engine does not do it).
- FLASHINFER_NVCC_THREADS=1 and NVCC_THREADS=1: nvcc --threads per job (flashinfer/jit/cpp_ext.py,
  vllm/envs.py); each thread multiplies a job's memory, and MAX_JOBS was sized for one.
- TORCHINDUCTOR_COMPILE_THREADS: inductor's compile workers (torch/_inductor/config.py decide_compile_threads; vLLM
  forces "1" at import, vllm/env_override.py): the same count as MAX_JOBS for any other engine.
- RAY_memory_monitor_refresh_ms=0: Ray's own memory monitor kills workers by its own rule; with sparkwatch guarding
  the pool one killer decides.
- PYTHONUNBUFFERED=1: the engine's stdout is a pipe to launch, and a block-buffered print would reach the terminal
  (and the phase recogniser) late.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sparkwatch.core.bounded import whole

# MAX_JOBS the user may set: at least 1 (ninja -j0 runs without any limit; torch's cpp_extension passes a 0 through),
# and not past this many compiler jobs (a Spark has 20 cores; 4096 jobs of 8 GiB is a typo, not a setting).
JOBS_MAX = 4096


@dataclass(frozen=True, slots=True)
class EnvChoice:
    name: str
    value: str
    why: str
    kept: bool  # True: the user's own value, left as it is


def user_jobs(env: Mapping[str, str]) -> int | None:
    """The user's MAX_JOBS, None when unset or empty. Raises ValueError naming MAX_JOBS for anything else that is not
    a whole number from 1 to JOBS_MAX: torch's cpp_extension and flashinfer ignore a MAX_JOBS that is not all digits
    and run ninja's default (about nproc + 2 jobs), the very burst launch sets MAX_JOBS against, and launch would have
    kept it as "yours"; 400 digits raised OverflowError in the plan."""
    text = env.get("MAX_JOBS", "")
    if not text:
        return None
    try:
        return whole(text, 1, JOBS_MAX, "compile jobs")
    except ValueError as exc:
        raise ValueError(f"MAX_JOBS: {exc}") from None


def engine_env(env: Mapping[str, str], jobs_count: int) -> tuple[EnvChoice, ...]:
    """What to set (kept=False) and what the user already set (kept=True). `jobs_count`: the plan's MAX_JOBS
    (core.launch.plan.launch_jobs)."""
    jobs = str(max(1, jobs_count))
    wanted = (
        ("MAX_JOBS", jobs, "flashinfer PR #3899's cap: max(1, min(cpus, (MemAvailable - 16 GiB) // 8 GiB))"),
        ("FLASHINFER_NVCC_THREADS", "1", "one nvcc thread per job"),
        ("NVCC_THREADS", "1", "one nvcc thread per job"),
        ("TORCHINDUCTOR_COMPILE_THREADS", jobs, "inductor workers, as many as MAX_JOBS"),
        ("RAY_memory_monitor_refresh_ms", "0", "Ray's own memory killer off: sparkwatch guards the pool"),
        ("PYTHONUNBUFFERED", "1", "log lines reach the terminal as written"),
    )
    out = []
    for name, value, why in wanted:
        if env.get(name):  # an empty value is no value: ours is set
            out.append(EnvChoice(name, env[name], "yours", kept=True))
        else:
            out.append(EnvChoice(name, value, why, kept=False))
    return tuple(out)


def apply(env: Mapping[str, str], choices: tuple[EnvChoice, ...]) -> dict[str, str]:
    out = dict(env)
    for c in choices:
        if not c.kept:
            out[c.name] = c.value
    return out


def describe(choices: tuple[EnvChoice, ...], ray: bool = False, container: bool = False) -> str:
    """The one line launch prints. `ray`: the ranks run on the raylets of a running Ray, which start their workers
    with the raylet's environment (core.launch.rayletenv): what is set here reaches the driver only, and the line
    never says otherwise. `container`: set in the container (`-e`, or the compose file launch adds), over what the
    image and the command set there."""
    set_ = " ".join(f"{c.name}={c.value}" for c in choices if not c.kept)
    kept = " ".join(f"{c.name}={c.value}" for c in choices if c.kept)
    where = "set for the driver only (the Ray ranks read their raylet's environment)" if ray else "set"
    where = "set in the container" if container else where
    line = f"sparkwatch: environment: {where} {set_ or 'nothing'}"
    return line + (f"; kept yours: {kept}" if kept else "")
