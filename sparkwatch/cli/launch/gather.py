"""Gathering what `sparkwatch launch`'s plan needs (sizes, the pool, running engines, learned peaks) and printing it.

All I/O is here; the decision is core.launch.plan's. Reading is cheap by design: stat of each weight file, a bounded
config.json, /proc/meminfo, /proc/buddyinfo, the declarations directory and the state dir's peaks.json. A 40-shard
directory plans in well under 200 ms (bench/launch_bench.py).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkwatch.common import launched, peakstore
from sparkwatch.common.durable import read_regular
from sparkwatch.common.sources.buddyinfo import page_size_bytes, read_buddyinfo
from sparkwatch.common.sources.checkpoint import read_facts
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.common.sources.procs import read_descendants, read_rss_bytes
from sparkwatch.core.driver.freeblocks import BuddyinfoError, free_bytes_in_blocks
from sparkwatch.core.engines.enginecli import EngineCommand, EngineKind, recognise
from sparkwatch.core.launch import launchenv, peaks
from sparkwatch.core.launch.nodeplan import Role, Span, rank_facts, role_of, role_terms, span_of
from sparkwatch.core.launch.plan import (
    DEFAULT_MARGIN_BYTES,
    FreeSource,
    Learned,
    MemoryView,
    ModelFacts,
    Plan,
    Reservation,
    plan_launch,
)
from sparkwatch.core.launch.rayletenv import uses_ray
from sparkwatch.core.redact import redact
from sparkwatch.core.units import MiB

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings

CONTIGUOUS_BLOCK_BYTES = 2 * MiB
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of a process's start time in /proc/PID/stat


@dataclass(frozen=True)
class PlanInputs:
    argv: tuple[str, ...]
    budget: int | str | Mapping[str, int | str] | None = None  # bytes, "auto", None, or each role's (head=, worker=)
    margin_bytes: int | None = None
    engine_reads: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    view: Any = None  # an engine in a container (cli.launch.docker.Container): its checkpoint seen through its mounts


@dataclass(frozen=True)
class PlanContext:
    cmd: EngineCommand
    facts: ModelFacts
    key: str
    engine_version: tuple[int, ...] | None
    estimate_bytes: int
    declared: tuple[launched.Declaration, ...] = ()
    took_s: float = 0.0
    record: peaks.PeakRecord | None = None  # what earlier runs with this key measured, confirmed or not
    span: Span | None = None  # the nodes the engine spans (core.launch.nodeplan): the plan is then this node's share
    role: Role = Role.HEAD  # this node's role in it (core.launch.nodeplan.role_of)


def memory_view(settings: Settings, margin_bytes: int | None) -> MemoryView:
    with MeminfoReader(settings.proc_root) as reader:
        mem = reader.read()
    contiguous: int | None = None
    try:
        zones = read_buddyinfo(settings.proc_root)
        if zones is not None:
            contiguous = free_bytes_in_blocks(zones, page_size_bytes(), CONTIGUOUS_BLOCK_BYTES)
    except (OSError, BuddyinfoError):
        contiguous = None
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    return MemoryView(
        total_bytes=mem.total_bytes,
        available_bytes=mem.available_bytes,
        free_bytes=mem.free_bytes,
        cached_bytes=mem.cached_bytes,
        floor_bytes=settings.floor,
        margin_bytes=DEFAULT_MARGIN_BYTES if margin_bytes is None else margin_bytes,
        contiguous_free_bytes=contiguous,
        cpus=cpus,
    )


_DIST_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)-(?P<version>\d+(?:\.\d+)*)[^/]*\.dist-info$")


def engine_version(argv: tuple[str, ...], package: str) -> tuple[int, ...] | None:
    """The installed version of `package` next to the interpreter the command runs: the console script's shebang (or
    the python named in argv[0]), then its site-packages' `<package>-X.Y.Z.dist-info`. None when it cannot be told."""
    if not argv:
        return None
    exe = shutil.which(argv[0]) or argv[0]
    python = exe
    if not re.search(r"python[\d.]*$", os.path.basename(exe)):
        try:  # never blocks: a FIFO named like the engine is refused (common.durable)
            first = read_regular(Path(exe), 256, follow_symlinks=True).split(b"\n", 1)[0]
        except OSError:
            return None
        if not first.startswith(b"#!"):
            return None
        python = first[2:].decode(errors="replace").strip().split()[0]
    prefix = Path(python).resolve().parent.parent if Path(python).is_absolute() else None
    if prefix is None:
        return None
    for site in sorted(prefix.glob("lib/python3*/site-packages")):
        for entry in site.glob(f"{package}-*.dist-info"):
            m = _DIST_RE.match(entry.name)
            if m and m.group("name").replace("-", "_").lower() == package:
                return tuple(int(x) for x in m.group("version").split(".")[:3])
    return None


def running(
    settings: Settings, env: Mapping[str, str], now: float
) -> tuple[tuple[launched.Declaration, ...], list[Reservation]]:
    """Engines launched and still running, and every other engine tree (named in a fix, reserving nothing: what it
    holds is already out of MemAvailable). What a declared engine reserves is core.launch.plan.reserve's rule over
    what the kernel says of its tree (RSS, its root's age, whether the engine rules see an engine in it) and its
    launch's plan; the declaration's own word decides only whether it is still booting, which lapses at BOOT_MAX_S."""
    from sparkwatch.common.sources.enginetrees import EngineFinder
    from sparkwatch.core.engines.identity import engine_kinds

    watch = launched.LaunchedWatch.of(env, settings.state_dir, settings.proc_root)
    decls = tuple(d for d in watch.poll() if d.exited_at is None and _alive(d.root_pid, d.start_ticks, settings))
    finder = EngineFinder.from_settings(settings, settings.proc_root, any_user=True)
    try:
        procs, trees = finder.scan()
    except OSError:
        procs, trees = (), []
    engines = set(engine_kinds(procs, finder.rules)) if decls else set()  # the rules alone: no declaration's word
    uptime_s = _uptime_s(settings.proc_root) if decls else None
    me = os.geteuid()
    parents = {p.pid: p.ppid for p in procs}
    out = []
    for d in decls:
        pids = read_descendants(settings.proc_root, [d.root_pid])
        age_s = None if uptime_s is None else max(uptime_s - d.start_ticks / CLOCK_TICKS, 0.0)
        out.append(
            Reservation(
                kind=d.kind,
                root_pid=d.root_pid,
                name=redact(f"{d.kind} {d.model}".strip()),  # another user's words, printed in the plan: redacted
                footprint_bytes=read_rss_bytes(settings.proc_root, pids),
                budget_bytes=d.budget_bytes,
                booting=d.booting,
                estimate_bytes=d.estimate_bytes,
                phase=str(d.phase),
                age_s=age_s,
                engine=any(pid in engines for pid in pids),
                other_uid=None if d.uid == me or d.launch_id.startswith(f"{me}-") else d.uid,  # (a container: yours)
                launched=parents.get(d.root_pid) == d.launcher_pid,
            )
        )
    declared = {d.root_pid for d in decls}
    for tree in trees:
        if tree.root.pid in declared:
            continue
        name = redact(f"{tree.kind} {tree.root.display_name}")
        out.append(Reservation(tree.kind, tree.root.pid, name, tree.rss_bytes))
    return decls, out


def _uptime_s(proc_root: Path) -> float | None:
    """Seconds since boot (<proc_root>/uptime: CLOCK_BOOTTIME, the clock of a process's start ticks)."""
    try:
        return float(read_regular(Path(proc_root) / "uptime", 256).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start_ticks: int, settings: Settings) -> bool:
    from sparkwatch.common.sources.procs import read_start_ticks

    return read_start_ticks(settings.proc_root, pid) == start_ticks


def gather(settings: Settings, inputs: PlanInputs) -> tuple[Plan, PlanContext]:
    """The plan for `inputs.argv` now. Raises ValueError, one line naming the field, for a flag value out of range or
    one the engine would refuse, a MAX_JOBS that is not 1 to JOBS_MAX, and a checkpoint file that is not what it must
    be (common.sources.checkpoint.CheckpointError)."""
    started = time.monotonic()
    cmd = recognise(inputs.argv)
    env = inputs.env
    if cmd.kind == EngineKind.OTHER:
        facts = ModelFacts(source="")
    else:
        read = inputs.view.facts if inputs.view else read_facts  # a container's: through its mounts
        facts = read(cmd.model, env, cmd.flag("download_dir"), cmd.flag("revision"))
    version = engine_version(cmd.argv, "vllm") if cmd.kind == EngineKind.VLLM and not inputs.view else None
    view = memory_view(settings, inputs.margin_bytes)
    span = span_of(cmd, uses_ray(inputs.argv, env))
    role = role_of(cmd) if span is not None else Role.HEAD
    budget = inputs.budget.get(role) if isinstance(inputs.budget, Mapping) else inputs.budget  # this node's role's
    explicit = budget if isinstance(budget, int) else None
    jobs = launchenv.user_jobs(env)
    reads = FreeSource(inputs.engine_reads) if inputs.engine_reads else None
    records = peakstore.load(settings.state_dir)
    key_role = None if span is None else str(role)
    key = peaks.peak_key(cmd, explicit, key_role)
    record = records.get(key)

    def learned_for(command: EngineCommand) -> Learned | None:
        """The measured peak for `command` (the command or a fix of it), once two runs agree (core.launch.peaks)."""
        found = records.get(peaks.peak_key(command, explicit, key_role))
        confirmed = found.learned_bytes if found is not None else None
        if found is None or confirmed is None:
            return None
        return Learned(confirmed, found.estimate_bytes or 0, found.runs, found.ready_s)

    decls, reservations = running(settings, env, time.time())
    plan = plan_launch(
        cmd, facts if span is None else rank_facts(facts, span), view, reservations, learned_for=learned_for,
        budget=budget, jobs=jobs, engine_version=version, engine_reads=reads,
        extra=() if span is None else role_terms(role, span),
    )  # fmt: skip
    if plan.learned is not None and not plan.learned.estimate_bytes:
        plan = replace(plan, learned=replace(plan.learned, estimate_bytes=plan.estimate.needs_bytes))
    ctx = PlanContext(
        cmd=cmd,
        facts=facts,
        key=key,
        engine_version=version,
        estimate_bytes=plan.estimate.needs_bytes,
        declared=decls,
        took_s=time.monotonic() - started,
        record=record,
        span=span,
        role=role,
    )
    return plan, ctx


def replan(settings: Settings, inputs: PlanInputs, ctx: PlanContext) -> tuple[Plan, PlanContext]:
    """The plan again after a fix (the pool changed; the checkpoint did not)."""
    plan, new = gather(settings, inputs)
    return plan, replace(new, facts=ctx.facts)
