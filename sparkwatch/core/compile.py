"""The compiler census: which compilers run, in which engine tree, for which arch, and whether MAX_JOBS bounds them.

flashinfer JIT-compiles inside vLLM's profiling run: python -> ninja -> nvcc -> cicc / ptxas / fatbinary (and c++
for host code). ninja defaults to one job per core, and each nvcc/cicc holds 3-8 GiB: 20 jobs are ~70 GiB on top of
resident weights (FIELD-NOTES "The compiler burst"). A healthy reading with MAX_JOBS=4 is 7-9 processes.

Pure: it takes the process table and the environ values a source has read, and returns records.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sparkwatch.model import CompileCensus, EngineCompile, EngineTree, Proc

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
    if proc.is_kernel_thread:
        return None
    comm = proc.comm
    if comm in CUDA_TOOLS or comm in BUILD_TOOLS or comm in ("cc1plus", "cc1"):
        return comm
    match = _HOST_RE.match(comm)
    if match:
        return match.group(1)
    return None


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
    """Whose environ the census needs this cycle, and why (role: "compiler", "raylet" or "engine")."""

    pids: Mapping[int, str]


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

    With Ray, actors inherit the raylet's environment, not the shell's that ran `vllm serve` (FIELD-NOTES), so the
    root alone would lie. The compiler itself is best: it shows what was inherited.
    """
    by_pid = {p.pid: p for p in procs}
    pids: dict[int, str] = {}
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
) -> tuple[str, str | None, str | None]:
    compiler = _first_compiler(tree)
    raylet = _raylet_for(tree, by_pid)
    candidates = [(compiler, "compiler"), (raylet, "raylet"), (tree.root, "engine")]
    for proc, role in candidates:
        if proc is None:
            continue
        reading = environ.get(proc.pid)
        if reading is None or reading.values is None:
            continue  # unreadable: ask the next one; never guess
        for var in MAX_JOBS_VARS:
            value = reading.values.get(var)
            if value:
                return "set", value, role
        return "unset", None, role
    return "unknown", None, None


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
        if parent is not None and parent.comm == proc.comm and parent.argv == proc.argv:
            # A fork that has not exec'd yet (nvcc and ninja fork, then exec sh/cicc/ptxas): the same job, once.
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


# --- the burst alert


@dataclass(frozen=True, slots=True)
class BurstState:
    """Between cycles: whether a burst is on, which reasons were already announced, and when compilers went quiet."""

    active: bool = False
    announced: frozenset[str] = frozenset()
    quiet_since: float | None = None
    peak_jobs: int = 0


@dataclass(frozen=True, slots=True)
class BurstAlert:
    reasons: tuple[str, ...]  # "wide" and/or "max_jobs_unset"
    summary: str
    fields: Mapping[str, object]


# A burst ends after compilers have been gone this long: ninja starts jobs back to back and flashinfer builds module
# after module, so a gap of a few seconds is the same burst, and one burst is one event, not one per module.
BURST_QUIET_S = 30.0


def burst_step(
    state: BurstState, c: CompileCensus, jobs_alert: int, now: float, quiet_s: float = BURST_QUIET_S
) -> tuple[BurstState, BurstAlert | None]:
    """Advance the burst state by one census; an alert only for a reason not yet announced in this burst."""
    compilers = sum(c.tools.values())
    if compilers == 0:
        if not state.active:
            return state, None
        quiet_since = state.quiet_since if state.quiet_since is not None else now
        if now - quiet_since >= quiet_s:
            return BurstState(), None
        return BurstState(True, state.announced, quiet_since, state.peak_jobs), None
    reasons = []
    if c.parallel_jobs > jobs_alert:
        reasons.append("wide")
    unset = [e for e in c.engines if e.tools and e.max_jobs_state == "unset"]
    if unset:
        reasons.append("max_jobs_unset")
    peak = max(state.peak_jobs, c.parallel_jobs)
    fresh = tuple(r for r in reasons if r not in state.announced)
    new_state = BurstState(True, state.announced | frozenset(reasons), None, peak)
    if not fresh:
        return new_state, None
    parts = []
    if "wide" in fresh:
        parts.append(f"{c.parallel_jobs} parallel nvcc/cicc jobs exceed {jobs_alert}")
    if "max_jobs_unset" in fresh:
        names = ", ".join(f"{e.kind} {e.root_pid}" for e in unset)
        parts.append(f"MAX_JOBS is unset in the environment the compilers inherit ({names})")
    summary = (
        "compiler burst: " + "; ".join(parts) + f" ({compilers} compiler processes, {c.rss_bytes >> 20} MiB RSS)."
        " Set MAX_JOBS=4 (with Ray: in every raylet's environment)."
    )
    fields: dict[str, object] = {
        "reasons": list(fresh),
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
    return new_state, BurstAlert(fresh, summary, fields)
