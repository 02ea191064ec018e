"""The compiler census: which compilers run, in which engine tree, for which arch, and whether MAX_JOBS bounds them.

flashinfer JIT-compiles inside vLLM's profiling run: python -> ninja -> nvcc -> cicc / ptxas / fatbinary (and c++
for host code). ninja defaults to one job per core, and each nvcc/cicc holds 3-8 GiB: on a Spark's 20 cores that
is ~70 GiB on top of resident weights. A healthy reading with MAX_JOBS=4, sampled on Sparks, is 7-9 processes (4 ninja
jobs plus each nvcc's cicc/ptxas children).

`tool_of` / `is_compiler` is the one "is this a compiler" rule: the census, the JIT state and the tree view use it.

Pure: it takes the process table and the environ values a source has read, and returns records.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sparkwatch.core.enums import EnvSource, MaxJobsState
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import CompileCensus, EngineCompile, EngineTree, Proc
from sparkwatch.core.units import format_size
from sparkwatch.core.words import plural

# Every tool the census reports, in exposition order; each is exported even at 0, so "none" is visible.
CUDA_TOOLS: tuple[str, ...] = ("nvcc", "cicc", "ptxas", "fatbinary", "nvlink", "cudafe++")
BUILD_TOOLS: tuple[str, ...] = ("ninja",)
HOST_TOOLS: tuple[str, ...] = ("cc1plus", "cc1", "gcc", "g++", "c++", "cc", "clang", "clang++")
TOOLS: tuple[str, ...] = CUDA_TOOLS + BUILD_TOOLS + HOST_TOOLS
# The jobs MAX_JOBS bounds, and the ones that hold gigabytes: one cicc per nvcc job, nvcc waits on it.
JOB_TOOLS = frozenset({"nvcc", "cicc"})

# comm is cut to 15 characters and distributions version their compilers: gcc-13, aarch64-linux-gnu-g++-13.
_HOST_RE = re.compile(r"^(?:[a-z0-9_]+-linux-gnu-)?(gcc|g\+\+|c\+\+|cc|clang|clang\+\+)(?:-\d+(?:\.\d+)*)?$")
_ARCH_VALUE_RE = re.compile(r"(?:compute|sm|lto)_(\d+[a-z]?)")
_ARCH_FLAGS = ("-arch", "--gpu-architecture", "-gencode", "--generate-code", "-code", "--gpu-code")

MAX_JOBS_VARS = ("MAX_JOBS",)


def tool_of(proc: Proc) -> str | None:
    """The compiler tool a process is, from its comm (what the kernel says it executes), or None."""
    if proc.is_kernel_thread or proc.state == "Z":
        return None  # a finished, unreaped ninja or nvcc holds no memory and compiles nothing
    comm = proc.comm
    if comm in CUDA_TOOLS or comm in BUILD_TOOLS or comm in ("cc1plus", "cc1"):
        return comm
    match = _HOST_RE.match(comm)
    if match:
        return match.group(1)
    return None


def is_compiler(proc: Proc) -> bool:
    """A live compiler process (a zombie one compiles nothing and holds no memory)."""
    return tool_of(proc) is not None


def parse_archs(argv: Sequence[str]) -> frozenset[str]:
    """The CUDA archs a compiler command targets, as flashinfer names them ("121a").

    Understands `-gencode arch=compute_121a,code=sm_121a`, `-gencode=arch=…`, `-arch=sm_121a`, `-arch sm_121a`,
    `--gpu-architecture=compute_90`, `--generate-code …`, and cicc's/ptxas' own `-arch compute_121a`.
    """
    found: set[str] = set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _ARCH_FLAGS:
            if not eq:
                value = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            found.update(_ARCH_VALUE_RE.findall(value))
        i += 1
    return frozenset(found)


@dataclass(frozen=True, slots=True)
class EnvReading:
    """What a source read from /proc/<pid>/environ: the variables asked for, or None when unreadable."""

    values: Mapping[str, str] | None


@dataclass(frozen=True, slots=True)
class EnvironRequest:
    """Whose environ the census needs this cycle, and why."""

    pids: Mapping[int, EnvSource]


def _ancestors(proc: Proc, by_pid: Mapping[int, Proc]) -> list[Proc]:
    out = []
    seen = {proc.pid}
    cur = by_pid.get(proc.ppid)
    while cur is not None and cur.pid not in seen:
        out.append(cur)
        seen.add(cur.pid)
        cur = by_pid.get(cur.ppid)
    return out


def _tree_of(trees: Sequence[EngineTree]) -> dict[int, EngineTree]:
    return {pid: tree for tree in trees for pid in tree.pids}


def _raylet_for(tree: EngineTree, by_pid: Mapping[int, Proc]) -> Proc | None:
    """The raylet whose environment the tree's actors inherit: an ancestor of the root, or one inside the tree."""
    for proc in (tree.root, *_ancestors(tree.root, by_pid)):
        if proc.comm == "raylet":
            return proc
    for proc in tree.members:
        if proc.comm == "raylet":
            return proc
    return None


def _first_compiler(tree: EngineTree) -> Proc | None:
    """The process whose environment the compilers actually inherited: ninja if there is one, else a compiler."""
    best: Proc | None = None
    for proc in tree.members:
        tool = tool_of(proc)
        if tool == "ninja":
            return proc
        if tool is not None and best is None:
            best = proc
    return best


def environ_request(procs: Sequence[Proc], trees: Sequence[EngineTree]) -> EnvironRequest:
    """Which environs to read: per engine tree, a live compiler (the truth), its raylet, and its root.

    With Ray, actors inherit the raylet's environment, not the shell's that ran `vllm serve`, so the root alone
    would lie. The compiler itself is best: it shows what was inherited.
    """
    by_pid = {p.pid: p for p in procs}
    pids: dict[int, EnvSource] = {}
    for tree in trees:
        compiler = _first_compiler(tree)
        if compiler is not None:
            pids[compiler.pid] = "compiler"
        raylet = _raylet_for(tree, by_pid)
        if raylet is not None:
            pids.setdefault(raylet.pid, "raylet")
        pids.setdefault(tree.root.pid, "engine")
    return EnvironRequest(pids)


def _max_jobs_of(
    tree: EngineTree, by_pid: Mapping[int, Proc], environ: Mapping[int, EnvReading]
) -> tuple[MaxJobsState, str | None, EnvSource | None]:
    compiler = _first_compiler(tree)
    raylet = _raylet_for(tree, by_pid)
    candidates: list[tuple[Proc | None, EnvSource]] = [
        (compiler, "compiler"),
        (raylet, "raylet"),
        (tree.root, "engine"),
    ]
    for proc, role in candidates:
        if proc is None:
            continue
        reading = environ.get(proc.pid)
        if reading is None or reading.values is None:
            continue  # unreadable: ask the next one; never guess
        for var in MAX_JOBS_VARS:
            value = reading.values.get(var)
            if value:
                return MaxJobsState.SET, value, role
        return MaxJobsState.UNSET, None, role
    return MaxJobsState.UNKNOWN, None, None


@dataclass(frozen=True, slots=True)
class _Tally:
    tools: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOOLS, 0))
    rss_bytes: list[int] = field(default_factory=lambda: [0])


def census(procs: Sequence[Proc], trees: Sequence[EngineTree], environ: Mapping[int, EnvReading]) -> CompileCensus:
    """Count compilers, total their RSS, attribute them to engine trees, and judge MAX_JOBS per tree."""
    by_pid = {p.pid: p for p in procs}
    tree_by_pid = _tree_of(trees)
    total = _Tally()
    per_tree: dict[int, _Tally] = {}
    archs: dict[str, int] = {}
    outside = 0
    for proc in procs:
        tool = tool_of(proc)
        if tool is None:
            continue
        parent = by_pid.get(proc.ppid)
        if parent is not None and parent.comm == proc.comm:
            # The parent's own fork, whatever its command line reads at that instant: nvcc and ninja fork, then exec
            # sh/cicc/ptxas, and no compiler starts another of its own name as a job. Comparing command lines
            # miscounted twice on fresh-clone runs of test_real_compiler_burst (three nvcc under `ninja -j 2`): a
            # child caught inside execve (the kernel installs the new program's memory before it renames the task),
            # and a parent whose command line was read while it was still the `nvcc` wrapper script, before its
            # exec of the real nvcc, beside a child forked after it.
            continue
        total.tools[tool] += 1
        total.rss_bytes[0] += proc.rss_bytes
        for arch in parse_archs(proc.argv):
            archs[arch] = archs.get(arch, 0) + 1
        tree = tree_by_pid.get(proc.pid)
        if tree is None:
            outside += 1
            continue
        tally = per_tree.setdefault(tree.root.pid, _Tally())
        tally.tools[tool] += 1
        tally.rss_bytes[0] += proc.rss_bytes
    engines = []
    for tree in trees:
        tally = per_tree.get(tree.root.pid, _Tally())
        state, value, source = _max_jobs_of(tree, by_pid, environ)
        engines.append(
            EngineCompile(
                kind=tree.kind,
                root_pid=tree.root.pid,
                tools={t: n for t, n in tally.tools.items() if n},
                rss_bytes=tally.rss_bytes[0],
                max_jobs_state=state,
                max_jobs=value,
                max_jobs_source=source,
            )
        )
    return CompileCensus(
        tools=total.tools,
        rss_bytes=total.rss_bytes[0],
        parallel_jobs=sum(total.tools[t] for t in JOB_TOOLS),
        archs=dict(sorted(archs.items())),
        engines=tuple(engines),
        outside_engines=outside,
    )


# --- the burst alerts


@dataclass(frozen=True, slots=True)
class BurstState:
    """Between cycles: whether a burst is on, what was already announced in it, and when compilers went quiet."""

    active: bool = False
    wide_announced: bool = False
    missing_announced: frozenset[int] = frozenset()  # engine root pids already named in a max_jobs_missing event
    quiet_since: float | None = None
    peak_jobs: int = 0


@dataclass(frozen=True, slots=True)
class BurstAlert:
    """One event to record: COMPILE_BURST (the burst is wider than compile_jobs_alert) or MAX_JOBS_MISSING (one
    engine compiles with MAX_JOBS unset in the environment its compilers inherit)."""

    kind: EventKind
    summary: str
    fields: Mapping[str, object]


# A burst ends after compilers have been gone this long: ninja starts jobs back to back and flashinfer builds module
# after module, so a gap of a few seconds is the same burst, and one burst is one event, not one per module.
BURST_QUIET_S = 30.0
MAX_JOBS_FIX = "Set MAX_JOBS=4 where the engine starts (with Ray: in every raylet's environment), then restart it."


def _wide_alert(c: CompileCensus, jobs_alert: int) -> BurstAlert:
    compilers = sum(c.tools.values())
    summary = (
        f"compiler burst: {c.parallel_jobs} parallel nvcc/cicc jobs exceed {jobs_alert} "
        f"({plural(compilers, 'compiler process')}, {format_size(c.rss_bytes)} RSS). {MAX_JOBS_FIX}"
    )
    fields: dict[str, object] = {
        "parallel_jobs": c.parallel_jobs,
        "jobs_alert": jobs_alert,
        "compile_processes": {t: n for t, n in c.tools.items() if n},
        "compile_rss_bytes": c.rss_bytes,
        "archs": sorted(c.archs),
        "engines": [
            {"engine": e.kind, "root_pid": e.root_pid, "max_jobs": e.max_jobs_state, "max_jobs_value": e.max_jobs}
            for e in c.engines
            if e.tools
        ],
    }
    return BurstAlert(EventKind.COMPILE_BURST, summary, fields)


def _missing_alert(e: EngineCompile) -> BurstAlert:
    jobs = sum(n for t, n in e.tools.items() if t in JOB_TOOLS)
    summary = (
        f"{e.kind} engine {e.root_pid} compiles with MAX_JOBS unset (in the {e.max_jobs_source}'s environment): "
        f"ninja runs one nvcc per core, 3-8 GiB each ({jobs} nvcc/cicc jobs now). {MAX_JOBS_FIX}"
    )
    fields: dict[str, object] = {
        "engine": e.kind,
        "root_pid": e.root_pid,
        "max_jobs_source": e.max_jobs_source,
        "parallel_jobs": jobs,
        "compile_processes": dict(e.tools),
        "compile_rss_bytes": e.rss_bytes,
    }
    return BurstAlert(EventKind.MAX_JOBS_MISSING, summary, fields)


def burst_step(
    state: BurstState, c: CompileCensus, jobs_alert: int, now: float, quiet_s: float = BURST_QUIET_S
) -> tuple[BurstState, tuple[BurstAlert, ...]]:
    """Advance the burst state by one census. Within one burst, `compile_burst` is said once, and
    `max_jobs_missing` once per engine whose compilers run with MAX_JOBS unset (not "unknown": never guessed)."""
    compilers = sum(c.tools.values())
    if compilers == 0:
        if not state.active:
            return state, ()
        quiet_since = state.quiet_since if state.quiet_since is not None else now
        if now - quiet_since >= quiet_s:
            return BurstState(), ()
        return BurstState(True, state.wide_announced, state.missing_announced, quiet_since, state.peak_jobs), ()
    alerts: list[BurstAlert] = []
    wide = state.wide_announced
    if c.parallel_jobs > jobs_alert and not wide:
        alerts.append(_wide_alert(c, jobs_alert))
        wide = True
    missing = set(state.missing_announced)
    for e in c.engines:
        if e.tools and e.max_jobs_state == MaxJobsState.UNSET and e.root_pid not in missing:
            alerts.append(_missing_alert(e))
            missing.add(e.root_pid)
    new_state = BurstState(True, wide, frozenset(missing), None, max(state.peak_jobs, c.parallel_jobs))
    return new_state, tuple(alerts)
